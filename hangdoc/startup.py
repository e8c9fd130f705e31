"""``HANGDOC="options" torchrun ... train.py``: wrap a job without changing its command line.

    HANGDOC="--record --hang-timeout 300" torchrun --nproc-per-node 4 train.py --lr 0.1

runs every rank as ``torchrun ... -m hangdoc --record --hang-timeout 300 train.py --lr 0.1`` would
(the same options, the same :func:`hangdoc.wrap` helpers), but torchrun still launches
``train.py``, so its failure table reads ``train.py FAILED`` and not ``hangdoc FAILED``
(torchrun names the table after the first word of its own command line, out of a rank's reach).

How: the wheel installs ``hangdoc-startup.pth`` (:data:`PTH_NAME`) in site-packages; Python runs
its one line (:data:`PTH_LINE`) in every interpreter that starts with the ``site`` module, as it
does coverage's ``process_startup``. Without ``$HANGDOC`` that line is one dictionary lookup in
``os.environ`` and imports nothing. With it, :func:`activate` starts the helpers before the
script's first line, in the process that runs a script (``python train.py``, ``python -m pkg``),
and only there:

* not in a launcher (``torchrun``, ``python -m torch.distributed.run``, ``accelerate``,
  ``deepspeed``) that has no rank of its own: the variable is left for the ranks it starts;
* not in ``python -c`` (multiprocessing's spawned workers), an interactive or stdin interpreter,
  or hangdoc itself (``python -m hangdoc`` wraps the script by its own command line);
* once per job process: the wrapped process takes ``HANGDOC`` out of its environment, so what it
  starts (data loader workers, compile workers, ``subprocess`` calls) runs unwrapped.

A value that is not valid options is one warning line on stderr and the job runs without hangdoc:
this hook never raises and never stops a job. ``HANGDOC=1`` asks for the defaults (prefixed
output only), as ``python -m hangdoc train.py`` does.

Python's ``-S`` or ``-I`` turn the ``site`` module (and so the hook) off; ``python -m hangdoc``
works there.
"""

from __future__ import annotations

import argparse  # imported only where $HANGDOC is set: the .pth line imports this module then
import os
import sys

__all__ = ["activate", "PTH_NAME", "PTH_LINE", "ENV"]

ENV = "HANGDOC"
#: the file the wheel puts in site-packages (setup.py reads both names from here)
PTH_NAME = "hangdoc-startup.pth"
#: a .pth line that starts with ``import`` is executed by ``site``; ``os`` is imported already
#: by then, so a process without $HANGDOC pays one lookup and imports nothing more
PTH_LINE = "import os; os.environ.get('HANGDOC') and __import__('hangdoc.startup').startup.activate()\n"

#: what runs a job's ranks instead of being one (a script's basename, or a ``-m`` module)
LAUNCHERS = frozenset(("torchrun", "torch.distributed.run", "torch.distributed.launch", "accelerate",
                       "accelerate.commands.launch", "accelerate.commands.accelerate_cli", "deepspeed",
                       "deepspeed.launcher.runner", "deepspeed.launcher.launch", "hangdoc", "hangdoc.__main__"))
_done = False  # site may read the same .pth twice (a venv's lib64 -> lib link): start once
helpers = None  # the running hangdoc.runtime.wrap.Helpers, for a test or a debugger to see


def main_of(argv: "list[str]") -> "tuple[str, str] | None":
    """What an interpreter's command line (``sys.orig_argv``) runs: ``("script", path)``,
    ``("module", name)``, or None (``-c``, stdin, interactive, ``--version``).

        >>> main_of(["python3", "-u", "train.py", "--lr", "1"]), main_of(["python", "-um", "pkg.train"])
        (('script', 'train.py'), ('module', 'pkg.train'))
        >>> main_of(["python", "-X", "dev", "-W", "error", "-c", "pass"]) is None
        True
    """
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            i += 1
            break
        if not arg.startswith("-") or arg == "-":
            break
        if arg.startswith("--"):
            if arg == "--check-hash-based-pycs":
                i += 1
            elif arg in ("--help", "--version", "--help-env", "--help-xoptions", "--help-all"):
                return None
            i += 1
            continue
        # short options, possibly clustered (-uB, -um pkg, -Wignore)
        for j in range(1, len(arg)):
            c = arg[j]
            if c in "cmWX":
                value = arg[j + 1:] or (argv[i + 1] if i + 1 < len(argv) else "")
                i += 1 if arg[j + 1:] else 2
                if c == "c":
                    return None
                if c == "m":
                    return ("module", value) if value else None
                break
            if c in "hV?":
                return None
        else:
            i += 1
    if i >= len(argv) or argv[i] == "-":
        return None
    return ("script", argv[i])


def _command_line() -> "list[str]":
    argv = getattr(sys, "orig_argv", None)  # Python >= 3.10
    if argv:
        return list(argv)
    try:
        with open("/proc/self/cmdline", "rb") as f:
            raw = f.read()
        return [a.decode(sys.getfilesystemencoding(), "surrogateescape") for a in raw.split(b"\0")[:-1]]
    except OSError:
        return [sys.executable] + list(sys.argv)  # the script's path is sys.argv[0]; -m is not told apart


def should_wrap(main: "tuple[str, str] | None") -> bool:
    """Whether a process that runs ``main`` (see :func:`main_of`) is one to wrap: a script or a
    module, not a launcher (a launcher started inside a rank still launches: it is left too).

        >>> should_wrap(("script", "/venv/bin/torchrun")), should_wrap(("script", "train.py"))
        (False, True)
        >>> should_wrap(("module", "torch.distributed.run")), should_wrap(None)
        (False, False)
    """
    if main is None:
        return False
    kind, what = main
    return (what if kind == "module" else os.path.basename(what)) not in LAUNCHERS


def activate() -> None:
    """Start :func:`hangdoc.wrap`'s helpers for this process as ``$HANGDOC``'s options ask, if this
    process runs a job's script (see the module's docstring). Never raises."""
    global _done
    if _done:
        return
    _done = True
    try:
        value = os.environ.get(ENV, "")
        if not value or not should_wrap(main_of(_command_line())):
            return
        if getattr(sys.modules.get("__main__"), "__file__", None) is not None:
            return  # not the interpreter's start-up: a site.addsitedir() while a script runs
        os.environ.pop(ENV, None)  # this process is the job's: what it starts is not wrapped again
        options = parse(value)
        if options is None:
            return
        # .pth files are read one site directory at a time: torch may be in one not on sys.path
        # yet (a venv made with --system-site-packages, a .pth that adds a path after this one).
        # site imports sitecustomize once every directory is in: start then, before the script.
        sys.meta_path.insert(0, _AfterSite(options))
    except Exception as e:  # a startup hook must never take the interpreter down
        _warn(f"not started ({type(e).__name__}: {e}); the job runs without it")


class _AfterSite:
    """A meta path finder that finds nothing: it starts the helpers when ``site`` looks for
    ``sitecustomize`` (every site directory is on ``sys.path`` by then), and takes itself out."""

    def __init__(self, options: dict) -> None:
        self.options = options

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name in ("sitecustomize", "usercustomize"):
            try:
                sys.meta_path.remove(self)
            except ValueError:
                return None  # started already (a lookup from inside the start)
            start(self.options)
        return None


def start(options: dict) -> None:
    """Start the helpers now, and the exit handling ``python -m hangdoc`` has. Never raises."""
    global helpers
    try:
        from hangdoc.runtime.wrap import Helpers

        helpers = Helpers().start(**options)
        _hook_exit(helpers)
    except Exception as e:
        _warn(f"not started ({type(e).__name__}: {e}); the job runs without it")


def parse(value: str) -> "dict | None":
    """``hangdoc.wrap``'s options from ``$HANGDOC`` (``python -m hangdoc``'s options, or ``1``);
    None, after one warning, for a value that is not.

        >>> parse("--record --hang-timeout 300")["hang_timeout"], parse("1")["prefix"]
        (300.0, True)
    """
    import shlex

    from hangdoc.cli import UsageError
    from hangdoc.cli.run import add_arguments, wrap_options

    words = [] if value.strip().lower() in ("1", "on", "yes", "true") else shlex.split(value)
    parser = _Parser(prog=f"{ENV}=", add_help=False)
    add_arguments(parser)
    try:
        args = parser.parse_args(words)
        if args.script or args.module is not None:
            raise UsageError(f"takes options only, not a script or -m ({value!r}); the command line names the script")
        return wrap_options(args)
    except (UsageError, _BadOptions) as e:
        _warn(f"${ENV}: {e}; the job runs without hangdoc")
        return None


class _BadOptions(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> "None":  # type: ignore[override]
        raise _BadOptions(message)  # not argparse's exit(2): the job must run


def _hook_exit(helpers: "object") -> None:
    """What ``python -m hangdoc`` does around the script, done at the interpreter's edges: an
    uncaught exception goes to torchrun's error file (its failure table shows the traceback) and
    is printed once prefixed, and the helpers stop at exit as they do when the script returns."""
    import atexit

    from hangdoc.cli.run import _record_for_torchelastic

    previous = sys.excepthook

    def excepthook(kind, value, tb):  # type: ignore[no-untyped-def]
        try:
            if isinstance(value, Exception):
                _record_for_torchelastic(value)
        except BaseException:
            pass
        target = _unprefixed_stderr()
        if target is None:
            return previous(kind, value, tb)
        # torch's init_process_group put its hook in front of this one: it puts "[rankN]: " on
        # every line it captures from sys.stderr; where hangdoc's prefix or torchrun's names the
        # rank already, write past it to the real stderr (as -m hangdoc calls the inner hook)
        saved = sys.stderr
        sys.stderr = target
        try:
            previous(kind, value, tb)
        finally:
            sys.stderr = saved

    sys.excepthook = excepthook
    atexit.register(helpers.stop)  # type: ignore[attr-defined]


def _unprefixed_stderr() -> "object | None":
    """``sys.__stderr__`` while torch's ``_distributed_excepthook`` (which would add ``[rankN]: ``)
    is running us and the rank is shown already on every line; None otherwise."""
    hook = sys.excepthook
    if getattr(hook, "__name__", "") != "_distributed_excepthook" or \
            getattr(hook, "__module__", "") != "torch.distributed.distributed_c10d":
        return None
    if sys.stderr is sys.__stderr__ or sys.__stderr__ is None:
        return None
    try:
        from hangdoc.runtime.launcher_prefix import rank_shown

        return sys.__stderr__ if rank_shown(2) else None
    except Exception:
        return None


def _warn(message: str) -> None:
    try:
        sys.stderr.write(f"hangdoc: {message}\n")
        sys.stderr.flush()
    except Exception:
        pass
