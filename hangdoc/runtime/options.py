"""Where hangdoc writes inside a job, and what its files are called.

One output directory for everything (trace files, collective records, stack dumps, reports), shared
by all ranks: ``--out DIR`` / ``out=`` / ``$HANGDOC_OUT``, else ``./hangdoc-out``. Every file name
carries host, rank (or local rank) and pid, so ranks never write the same file and
``hangdoc aggregate DIR`` reads the directory whole.

    >>> from hangdoc.runtime.identity import Identity
    >>> ident = Identity(host="n1", rank=5, local_rank=1, world_size=8, local_world_size=4, pid=77)
    >>> file_name("trace", ident)
    'trace-n1-1-77.txt'
    >>> file_name("collectives", ident)
    'collectives-n1-r5-77.jsonl'
    >>> file_name("stacks", ident)
    'stacks-n1-r5-77.txt'
    >>> output_dir("/tmp/run1", create=False)
    '/tmp/run1'
"""

from __future__ import annotations

import os
import signal
from typing import Optional, Union

from hangdoc.runtime.identity import Identity, identity

__all__ = ["output_dir", "file_name", "file_path", "signal_number", "DEFAULT_OUT", "ENV_OUT", "KINDS"]

DEFAULT_OUT = "hangdoc-out"
ENV_OUT = "HANGDOC_OUT"

#: kind -> file name pattern (fields of Identity); see docs/architecture.md
KINDS = {
    "trace": "trace-{host}-{local_rank}-{pid}.txt",
    "collectives": "collectives-{host}-r{rank}-{pid}.jsonl",
    "stacks": "stacks-{host}-r{rank}-{pid}.txt",
}


def output_dir(out: Optional[str] = None, create: bool = True) -> str:
    """The output directory: ``out``, else ``$HANGDOC_OUT``, else ``./hangdoc-out`` (absolute).

    It is made absolute at once, so a later ``os.chdir`` in the training script does not scatter
    files; with ``create`` it is created (by any rank, races are harmless).
    """
    path = out or os.environ.get(ENV_OUT) or DEFAULT_OUT
    path = os.path.abspath(os.path.expanduser(path))
    if create:
        os.makedirs(path, exist_ok=True)
    return path


def file_name(kind: str, ident: Optional[Identity] = None) -> str:
    """The file name of ``kind`` ("trace", "collectives", "stacks") for ``ident`` (default: this process)."""
    try:
        pattern = KINDS[kind]
    except KeyError:
        raise ValueError(f"unknown file kind {kind!r}; one of {', '.join(KINDS)}") from None
    ident = ident or identity()
    return pattern.format(host=ident.host, rank=ident.rank, local_rank=ident.local_rank, pid=ident.pid)


def file_path(kind: str, out: Optional[str] = None, ident: Optional[Identity] = None) -> str:
    """``output_dir(out)`` joined with ``file_name(kind, ident)``; creates the directory."""
    return os.path.join(output_dir(out), file_name(kind, ident))


def signal_number(signum: Union[int, str, None]) -> Optional[int]:
    """A signal given as ``SIGUSR1``, ``usr1``, ``10`` or a number; None for none.
    Raises AttributeError for a name that is no signal.

        >>> signal_number("usr2") == signal.SIGUSR2, signal_number(None)
        (True, None)
    """
    if signum is None or signum == "" or signum == 0:
        return None
    if isinstance(signum, str):
        name = signum.upper()
        if name.isdigit():
            return int(name)
        if not name.startswith("SIG"):
            name = "SIG" + name
        return int(getattr(signal, name))
    return int(signum)
