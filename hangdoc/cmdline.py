"""What a command line runs: the interpreter's ``-m`` module, ``-c`` code, a script or a program,
and whether that is a launcher (torchrun, ``python -m torch.distributed.run``, deepspeed,
``accelerate launch``). Shared by ``hangdoc dump`` (command lines from ``/proc``) and the readers'
role guess (py-spy's ``Process N: cmd`` line): one rule, judged by what is executed, never by a
substring of a path.

    >>> launcher_name(["python", "/home/u/accelerate/train.py"]) is None
    True
    >>> launcher_name(split("/usr/bin/python3 -u -m torch.distributed.run --nproc-per-node 4 t.py"))
    'torch.distributed.run'
"""

from __future__ import annotations

import os
import re
import shlex
from typing import List, Optional, Sequence, Tuple

PYTHON_NAME = re.compile(r"^(python|pypy)[\d.]*m?$")


def split(command: str) -> List[str]:
    """A command line printed as one string (py-spy's ``Process N:`` line) back into arguments."""
    try:
        return shlex.split(command)
    except ValueError:  # an unmatched quote: the words are still good enough
        return command.split()


#: python options that take a value (``-W error``, ``-Xdev``, ``--check-hash-based-pycs never``)
_PY_OPTS_WITH_VALUE = set("WX")
#: launchers run as a module (``python -m M``); the value is the subcommand they need, if any
_LAUNCHER_MODULES = {
    "torch.distributed.run": None, "torch.distributed.launch": None,
    "deepspeed.launcher.launch": None, "deepspeed.launcher.runner": None,
    "accelerate.commands.launch": None, "accelerate.commands.accelerate_cli": "launch",
}
#: launchers run as a program (a console script: ``python /venv/bin/torchrun``, or ``torchrun``)
_LAUNCHER_PROGRAMS = {"torchrun": None, "deepspeed": None, "accelerate-launch": None, "accelerate": "launch"}


def program_of(cmdline: Sequence[str]) -> Tuple[str, str, List[str]]:
    """What a command line executes: ``(kind, what, arguments)``, kind ``module`` (``-m``), ``code``
    (``-c``), ``script`` (a file given to the interpreter) or ``program`` (not an interpreter).

    >>> program_of(["python3", "-u", "-X", "dev", "-m", "torch.distributed.run", "t.py"])
    ('module', 'torch.distributed.run', ['t.py'])
    >>> program_of(["/venv/bin/python", "/venv/bin/torchrun", "--standalone"])
    ('script', '/venv/bin/torchrun', ['--standalone'])
    >>> program_of(["torchrun", "t.py"])
    ('program', 'torchrun', ['t.py'])
    """
    if not cmdline:
        return "program", "", []
    if not PYTHON_NAME.match(os.path.basename(cmdline[0])):
        return "program", cmdline[0], list(cmdline[1:])
    args = list(cmdline[1:])
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            return ("script", args[i + 1], args[i + 2:]) if i + 1 < len(args) else ("code", "", [])
        if a.startswith("--"):
            i += 2 if a == "--check-hash-based-pycs" else 1
            continue
        if a.startswith("-") and len(a) > 1:
            for j, c in enumerate(a[1:], 1):
                if c in "mc":  # the rest of the cluster or the next argument is the value
                    kind = "module" if c == "m" else "code"
                    if a[j + 1:]:
                        return kind, a[j + 1:], args[i + 1:]
                    return kind, args[i + 1] if i + 1 < len(args) else "", args[i + 2:]
                if c in _PY_OPTS_WITH_VALUE:
                    if not a[j + 1:]:
                        i += 1
                    break
            i += 1
            continue
        return "script", a, args[i + 1:]
    return "code", "", []  # an interactive interpreter


def launcher_name(cmdline: Sequence[str]) -> Optional[str]:
    """The launcher a command line runs (``torchrun``, ``torch.distributed.run``, ``deepspeed``,
    ``accelerate launch``, ...), judged by what is executed: the program or script's base name or
    the ``-m`` module, never a substring of a path (``python /home/u/accelerate/train.py`` is no
    launcher).

    >>> launcher_name(["python", "/home/u/torchrun/train.py"]) is None
    True
    >>> launcher_name(["python", "/venv/bin/accelerate", "launch", "train.py"])
    'accelerate launch'
    """
    kind, what, rest = program_of(cmdline)
    if kind == "module":
        table, name = _LAUNCHER_MODULES, what
    elif kind in ("script", "program"):
        table, name = _LAUNCHER_PROGRAMS, os.path.basename(what)
    else:
        return None
    if name not in table:
        return None
    sub = table[name]
    if sub is None:
        return name
    return f"{name} {sub}" if rest[:1] == [sub] else None
