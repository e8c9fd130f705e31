"""The Python stack of a rank that dies in native code, kept in the output directory.

gloo aborts a rank whose collective does not match its peers' (``terminate called after throwing
an instance of 'gloo::EnforceNotMet'``: SIGABRT), and a segfault or an assertion in an extension
ends a rank the same way: no Python runs after it, so the watchdog's dumps and the recorder's
records of that rank are lost, and the verdict could only say "rank 1 died". The rank's Python
stack at that moment says which call it was in (an extra ``all_reduce`` at ``train.py:27`` while
the others are at ``:38``).

:func:`arm` opens ``fatal-HOST-rN-PID.txt`` in the output directory at the watchdog's start
(``O_CREAT|O_EXCL|O_NOFOLLOW``, mode 0600: a planted link or file there is never written through)
and points :mod:`faulthandler`'s fatal-signal handler (SIGSEGV, SIGFPE, SIGABRT, SIGBUS, SIGILL),
which runs in C with no Python, at it. The file stays empty unless the process dies so; a clean
stop (:func:`disarm`: the watchdog's stop, the end of the interpreter, a launcher's SIGTERM) removes it. An empty one (a SIGKILLed rank) is skipped by the aggregate.
Not armed when the job enabled faulthandler itself (``PYTHONFAULTHANDLER``,
``faulthandler.enable()``): its own choice of file stands; and when the job enables it later
(torchelastic's ``@record`` does, at the start of ``main``), its choice wins and hangdoc never
disables it: faulthandler keeps a reference to the file object it writes to, so hangdoc's is still
the one in use exactly while faulthandler holds that reference.

The exit verdict (:mod:`hangdoc.runtime.exit_verdict`) and ``hangdoc aggregate`` of the output
directory read a non-empty one as that rank's stack dump (``Fatal Python error: Aborted``).
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import stat
import sys
from typing import Any, Optional

PREFIX = "fatal-"
_armed: Optional[Any] = None  # (file object, path, its reference count while faulthandler holds it)
_fork_hook = False


def path_for(out_dir: str, host: str, rank: int, pid: int) -> str:
    return os.path.join(out_dir, f"{PREFIX}{host}-r{rank}-{pid}.txt")


def arm(out_dir: str, host: str, rank: int) -> Optional[str]:
    """Point faulthandler's fatal-signal handler at this rank's file; the path, or None when not
    armed (faulthandler in use by the job, the directory not writable, a file in the way)."""
    global _armed, _fork_hook
    if _armed is not None or faulthandler.is_enabled():
        return None
    path = path_for(out_dir, host, rank, os.getpid())
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        f = os.fdopen(os.open(path, flags, 0o600), "wb", buffering=0)
    except OSError:
        return None
    try:
        faulthandler.enable(file=f, all_threads=True)
    except (OSError, RuntimeError, ValueError):
        f.close()
        _unlink_if_empty(path)
        return None
    _armed = (f, path, sys.getrefcount(f))
    atexit.register(disarm)  # a job that ends by itself (or raises) leaves no empty file
    if not _fork_hook and hasattr(os, "register_at_fork"):
        _fork_hook = True
        os.register_at_fork(after_in_child=_in_child)
    return path


def _ours() -> bool:
    """Whether faulthandler still writes to hangdoc's file (it drops its reference to the file
    object when the job enables it with another file, or disables it)."""
    f, _, held = _armed  # type: ignore[misc]
    return faulthandler.is_enabled() and sys.getrefcount(f) >= held


def _release(unlink: bool) -> None:
    global _armed
    if _armed is None:
        return
    ours = _ours()
    f, path, _ = _armed
    _armed = None
    try:
        if ours:
            faulthandler.disable()
        f.close()
    except (OSError, ValueError):
        pass
    if unlink:
        _unlink_if_empty(path)


def disarm() -> None:
    """Give faulthandler's fatal handler up (only while it is still hangdoc's) and remove the file
    when nothing was written to it."""
    _release(unlink=True)


def _in_child() -> None:
    """A forked child (a DataLoader worker) does not write into its rank's file: a worker's crash
    would read as the rank's own. The file is its parent's: left in place."""
    _release(unlink=False)


def _unlink_if_empty(path: str) -> None:
    try:
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode) and st.st_size == 0 and st.st_uid == os.getuid():
            os.unlink(path)
    except OSError:
        pass
