"""``printflock``: ``print`` that never tears or interleaves a line when many processes share a stream.

Many ranks writing to one console (or one log file) interleave their output mid-line: ``print``
issues several writes (the text, then ``end``) and a pipe only guarantees atomicity up to
``PIPE_BUF`` bytes. ``printflock`` formats the whole message first, then, under an exclusive
``fcntl.flock`` on a node-local lock file, writes it with a single ``os.write`` (looping over partial
writes) and flushes before it unlocks.

    >>> from hangdoc import printflock as print
    >>> print("rank", 0, "says", "hello")
    rank 0 says hello

The lock file lives in ``/dev/shm`` (or the temp directory), named per user, never next to the
module: site-packages may sit on NFS/Lustre, where flock is slow or not supported. Where flock is
unavailable (ENOSYS, EINVAL, ENOLCK, EOPNOTSUPP) it prints without the lock, after one warning.

That directory is shared by every user of the node, so the lock is never trusted to be free: it is
opened with ``O_NOFOLLOW`` and used only when it is a regular file of this user's (else: no lock,
one warning), and it is waited for at most :data:`LOCK_WAIT` seconds. A lock held longer (by a
stopped process, or by anyone who can open it) is given up with one warning: the message is printed
without it, and until the lock is had again it is only tried, never waited for.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import stat
import sys
import tempfile
import threading
import time
import warnings
from typing import Any, Iterator, Optional, TextIO

try:
    import fcntl
except ImportError:  # Windows: no flock; degrade to a plain print.
    fcntl = None  # type: ignore[assignment]

__all__ = ["printflock", "lock_path", "locked", "locked_write", "open_lock"]

_UNSUPPORTED = {errno.ENOSYS, errno.EINVAL, errno.ENOLCK, getattr(errno, "EOPNOTSUPP", -1)}

_state_lock = threading.Lock()  # flock is per open file description, so threads need their own lock
_thread_lock = threading.Lock()
#: environment variable naming the pipes that hangdoc.prefix_output drains ("dev:ino,..."), inherited
#: by child processes
PREFIX_PIPES_ENV = "HANGDOC_PREFIX_PIPES"
_lock_fd: Optional[int] = None
_lock_pid: Optional[int] = None
_disabled = fcntl is None
#: the most seconds a print waits for the lock before it prints without it
LOCK_WAIT = 1.0
#: a wait for the lock timed out: until it is had again, it is tried once per print, not waited for
_gave_up = False
_warned_wait = False


def _reinit_after_fork() -> None:
    # Another thread may have held a lock at the moment of fork(); the child must not inherit that.
    global _state_lock, _thread_lock
    _state_lock = threading.Lock()
    _thread_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reinit_after_fork)


def lock_path() -> str:
    """The node-local lock file: ``$HANGDOC_PRINTFLOCK_LOCK``, else ``/dev/shm`` or the temp dir."""
    override = os.environ.get("HANGDOC_PRINTFLOCK_LOCK")
    if override:
        return override
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    try:
        user = str(os.getuid())
    except AttributeError:
        user = os.environ.get("USERNAME", "user")
    return os.path.join(base, f"hangdoc-printflock-{user}.lock")


def _get_lock_fd() -> Optional[int]:
    global _lock_fd, _lock_pid
    pid = os.getpid()
    # After fork the child shares the parent's open file description, hence its flock: reopen.
    if _lock_fd is not None and _lock_pid == pid:
        return _lock_fd
    path = lock_path()
    try:
        fd = open_lock(path)
    except OSError as e:
        _disable(f"cannot use lock file {path}: {e.strerror or e}")
        return None
    _lock_fd, _lock_pid = fd, pid
    return fd


def open_lock(path: str) -> int:
    """A descriptor of the lock file ``path`` in a directory others can write to (``/dev/shm``):
    created ``0600`` if missing, never through a symlink (``O_NOFOLLOW``), and only when it is a
    regular file owned by this user (anyone's file could be held by anyone for ever). OSError
    otherwise. (Also used by the output prefixer for its per-destination locks.)

        >>> import tempfile
        >>> fd = open_lock(os.path.join(tempfile.mkdtemp(), "x.lock")); os.close(fd)
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
                 | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0), 0o600)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
            raise PermissionError(errno.EPERM, f"owned by uid {st.st_uid}, not by this user")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _acquire(fd: int) -> bool:
    """Take the lock, waiting at most :data:`LOCK_WAIT`; False (once: one warning) when it stays held."""
    global _gave_up, _warned_wait
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _gave_up = False
        return True
    except BlockingIOError:
        if _gave_up:
            return False
    deadline = time.monotonic() + LOCK_WAIT
    delay = 0.0001
    while True:
        time.sleep(delay)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        if time.monotonic() >= deadline:
            _gave_up = True
            if not _warned_wait:
                _warned_wait = True
                warnings.warn(f"hangdoc.printflock: {lock_path()} held for more than {LOCK_WAIT:g}s (a stopped "
                              "process?); printing without the lock until it is free", RuntimeWarning, stacklevel=5)
            return False
        delay = min(2 * delay, 0.005)


def _disable(reason: str) -> None:
    global _disabled
    if not _disabled:
        _disabled = True
        warnings.warn(f"hangdoc.printflock: {reason}; printing without a lock", RuntimeWarning, stacklevel=4)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except InterruptedError:
            continue
        view = view[n:]


def _is_prefix_pipe(fd: int) -> bool:
    # Writing into a prefixer's pipe must not hold the flock: its reader needs the flock to drain
    # the pipe, and a full pipe would deadlock them. The reader writes whole lines under the lock.
    pipes = os.environ.get(PREFIX_PIPES_ENV)
    if not pipes:
        return False
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    return stat.S_ISFIFO(st.st_mode) and f"{st.st_dev}:{st.st_ino}" in pipes.split(",")


def _target_fd(stream: Any) -> Optional[int]:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return None


def printflock(*args: Any, sep: Optional[str] = " ", end: Optional[str] = "\n", file: Optional[TextIO] = None, flush: bool = False) -> None:
    """Like ``print``, but the whole message is written at once under a cross-process lock.

    Same signature as ``print``; ``flush`` is accepted for compatibility, output is always flushed.

        >>> import io
        >>> buf = io.StringIO()
        >>> printflock("a", "b", sep="-", end="!\\n", file=buf)
        >>> buf.getvalue()
        'a-b!\\n'
    """
    stream = sys.stdout if file is None else file
    if stream is None:  # pythonw / closed stdout: print is a no-op too
        return
    message = (" " if sep is None else sep).join(map(str, args)) + ("\n" if end is None else end)
    fd = _target_fd(stream)
    with (_thread_lock if fd is not None and _is_prefix_pipe(fd) else locked()):
        if fd is not None:
            # Text still buffered in the stream must come out before our bytes.
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
            encoding = getattr(stream, "encoding", None) or "utf-8"
            errors = getattr(stream, "errors", None) or "strict"
            _write_all(fd, message.encode(encoding, errors))
        else:
            stream.write(message)
            stream.flush()


@contextlib.contextmanager
def locked() -> Iterator[None]:
    """Hold the node-wide print lock (and this process's thread lock) for a block of writes.

    The lock is held only for the writes themselves, so a rank blocks here only while another
    rank's write is in progress; a process that dies holding it releases it (the kernel closes
    its descriptors); one that holds it for more than :data:`LOCK_WAIT` (stopped) is given up.
    """
    with _state_lock:
        lock_fd = None if _disabled else _get_lock_fd()
        is_locked = False
        if lock_fd is not None:
            try:
                is_locked = _acquire(lock_fd)
            except OSError as e:
                if e.errno not in _UNSUPPORTED:
                    raise
                _disable(f"flock unavailable ({errno.errorcode.get(e.errno, e.errno)})")
        try:
            yield
        finally:
            if is_locked:
                fcntl.flock(lock_fd, fcntl.LOCK_UN)


def locked_write(fd: int, data: bytes) -> None:
    """Write ``data`` to ``fd`` whole, under the print lock (used by the output prefixer)."""
    with locked():
        _write_all(fd, data)
