"""The file faulthandler writes a watchdog's signal dumps into, in the shared temp directory.

Its name (``hangdoc-signal-PID-SIGNAME-*.txt``) is how ``hangdoc dump`` finds a hangdoc-wrapped
process among another's open files (``/proc/PID/fd``), which works even though variables set after
exec never show in ``/proc/PID/environ``. The directory is shared: every file here is this user's,
regular, never followed through a link nor opened in a way that can block.

    >>> import os
    >>> f = create("SIGUSR1", shared=False)
    >>> os.path.basename(f.name).startswith(f"{SIGNAL_FILE_PREFIX}{os.getpid()}-SIGUSR1-")
    True
    >>> step_aside(f); os.path.basename(f.name).startswith(SIGNAL_FILE_PREFIX + "off-")
    True
    >>> f.close(); os.unlink(f.name)
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

try:
    import fcntl
except ImportError:  # not Linux: no flock
    fcntl = None  # type: ignore[assignment]

SIGNAL_ENV = "HANGDOC_WATCHDOG_SIGNAL"
#: file name pattern of the file faulthandler writes signal dumps into; ``hangdoc dump`` finds
#: hangdoc-wrapped processes by this name among their open files (``/proc/PID/fd``), which works
#: even though variables set after exec never show in ``/proc/PID/environ``.
SIGNAL_FILE_PREFIX = "hangdoc-signal-"


def create(signame: str, shared: bool) -> Any:
    """A new signal file, open for faulthandler, under a shared lock held as long as it is open
    (forked children share it): the mark of a live owner, which :func:`remove_stale` respects
    whatever pid namespace it runs in. ``shared``: the job handles the signal itself, and the name
    ("-shared-") keeps ``hangdoc dump`` from sending it just to read stacks."""
    prefix = f"{SIGNAL_FILE_PREFIX}shared-" if shared else SIGNAL_FILE_PREFIX
    f = tempfile.NamedTemporaryFile(mode="w+b", prefix=f"{prefix}{os.getpid()}-{signame}-", suffix=".txt", delete=False)
    if fcntl is not None:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            pass
    return f


def step_aside(f: Any) -> None:
    """Rename ``f`` so that ``hangdoc dump`` no longer sends its signal (the job took the signal over)."""
    name = f.name
    off = os.path.join(os.path.dirname(name), os.path.basename(name).replace(SIGNAL_FILE_PREFIX, SIGNAL_FILE_PREFIX + "off-", 1))
    try:
        os.rename(name, off)
        f.name = off
    except (OSError, AttributeError):
        pass


def remove_stale(limit: int = 2000) -> None:
    """Signal files of processes that are gone (killed before ``stop``, which removes its own);
    at most ``limit`` of them looked at. The temp directory is shared: only this user's regular
    files are touched, and none is ever opened in a way that can block (another user's FIFO named
    like a signal file would keep this thread, the watchdog, in ``open`` for ever) or follow a link."""
    import stat

    from hangdoc.bounds import MAX_PID, bounded_int

    if fcntl is None:
        return  # no flock: a live owner in another pid namespace could not be told apart

    paths = []
    try:
        with os.scandir(tempfile.gettempdir()) as entries:
            for entry in entries:
                if entry.name.startswith(SIGNAL_FILE_PREFIX) and entry.name.endswith(".txt"):
                    paths.append(entry.path)
                    if len(paths) >= limit:
                        break
    except OSError:
        return
    me = os.geteuid()
    for path in paths:
        parts = os.path.basename(path)[len(SIGNAL_FILE_PREFIX):].split("-")
        # isdigit() says yes to "²" and int() then raises: anyone's file name must not end the sweep
        pid = next((v for v in (bounded_int(x, 1, MAX_PID) for x in parts if x.isdigit()) if v is not None), None)
        if pid is None or pid == os.getpid():
            continue
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_uid != me:
            continue  # a FIFO, a link, a device, someone else's file: not ours to open or remove
        try:
            os.kill(pid, 0)
            continue  # alive here
        except ProcessLookupError:
            pass
        except (OSError, OverflowError):
            continue  # alive, another user's (or no pid at all)
        # No such pid in this pid namespace; it may still live in another (a container sharing
        # /tmp): its owner holds a lock on the file while it is open.
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
                         | getattr(os, "O_NOCTTY", 0))
        except OSError:
            continue
        try:
            now = os.fstat(fd)
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino) or not stat.S_ISREG(now.st_mode):
                continue  # swapped since the lstat
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # held: alive somewhere
        finally:
            os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass
