"""The watchdog-signal fallback of ``hangdoc dump``: the stacks of a hangdoc-wrapped process,
written by its own faulthandler when sent its watchdog's signal, read back from the file it holds.

The process (maybe another user's, ``hangdoc dump`` maybe root) controls that file's name and
everything at it: the file is found by the name the kernel shows for the descriptor, and read only
through that descriptor, checked (a regular file, the same inode before and after the open, owned
by the process's uid), never by its name. See docs/security.md.

    >>> signal_file(os.getpid()) is None  # no watchdog here
    True
"""

from __future__ import annotations

import errno
import os
import re
import signal
import stat
import time
from dataclasses import dataclass
from typing import Optional

#: seconds to wait for a hangdoc-wrapped process's faulthandler to write after its signal
SIGNAL_WAIT = 3.0
#: the most bytes of faulthandler output read back after one signal
SIGNAL_MAX = 4 << 20

_SIGNAL_FILE = re.compile(r"hangdoc-signal-(\d+)-(SIG\w+)-")


@dataclass
class Attempt:
    ok: bool
    text: str = ""
    how: str = ""
    reason: str = ""


def signal_file(pid: int) -> Optional[tuple]:
    """(``/proc/PID/fd/N``, signal number) of the faulthandler file a hangdoc-wrapped process holds
    open, else None. The file is found by the name the kernel shows for the descriptor, and only
    ever read through that descriptor (:func:`open_signal_file`), never by the name: the process
    may have put anything at that name since."""
    fd_dir = f"/proc/{pid}/fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return None
    for fd in names:
        link = os.path.join(fd_dir, fd)
        try:
            target = os.readlink(link)
        except OSError:
            continue
        m = _SIGNAL_FILE.search(os.path.basename(target))
        if m and int(m.group(1)) == pid:
            try:
                return link, int(getattr(signal, m.group(2)))
            except AttributeError:
                return None
    return None


def open_signal_file(link: str, uid: int) -> int:
    """A read-only descriptor of the file behind ``link`` (``/proc/PID/fd/N``: opening it reaches
    the very file the process holds open, whatever its name now points to), checked: a regular file
    (type checked before the open, so a FIFO is never opened, and again on the descriptor) owned by
    ``uid``, the process's owner (root's ``hangdoc dump`` must not read a file the process could
    not: a descriptor it holds write-only, say). OSError (with the reason) otherwise.

        >>> import tempfile
        >>> f = tempfile.NamedTemporaryFile()
        >>> os.close(open_signal_file(f"/proc/self/fd/{f.fileno()}", os.getuid()))
        >>> open_signal_file(f"/proc/self/fd/{f.fileno()}", os.getuid() + 1)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        PermissionError: ...
        >>> f.close()
    """
    before = os.stat(link)
    if not stat.S_ISREG(before.st_mode):
        raise OSError(errno.EINVAL, "the signal file is not a regular file")
    fd = os.open(link, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        now = os.fstat(fd)
        if not stat.S_ISREG(now.st_mode) or (now.st_dev, now.st_ino) != (before.st_dev, before.st_ino):
            raise OSError(errno.EINVAL, "the signal file changed while it was opened")
        if now.st_uid != uid:
            raise PermissionError(errno.EPERM, f"the signal file is owned by uid {now.st_uid}, the process by uid {uid}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _signal_unsafe(pid: int, signum: int) -> Optional[str]:
    """Why sending ``signum`` to ``pid`` could hurt it, from the kernel's own view
    (``/proc/PID/status``): not caught (the job put the default action back, which ends the process
    for SIGUSR1), or ignored (faulthandler would never write). None when it is safe. (``SigBlk`` is
    the main thread's alone: another thread takes a process-directed signal it blocks.)

        >>> _signal_unsafe(os.getpid(), signal.SIGUSR2)  # no handler here: SIGUSR2 would kill us
        'SIGUSR2 has no handler in the process (it would end it)'
    """
    try:
        with open(f"/proc/{pid}/status") as f:
            masks = {k: int(v, 16) for k, _, v in (line.partition(":") for line in f)
                     if k in ("SigCgt", "SigIgn")}
    except (OSError, ValueError):
        return None  # no /proc view: as before, trust the signal file
    bit = 1 << (signum - 1)
    name = signal.Signals(signum).name
    if "SigCgt" in masks and not masks["SigCgt"] & bit:
        return f"{name} has no handler in the process (it would end it)"
    if masks.get("SigIgn", 0) & bit:
        return f"{name} is ignored in the process"
    return None


def signal_dump(pid: int, wait: float = SIGNAL_WAIT, uid: Optional[int] = None) -> Attempt:
    """Ask a hangdoc-wrapped process for its stacks with its watchdog signal (faulthandler, C level).

    The file is read through the descriptor the process holds (:func:`open_signal_file`), and only
    what was added after the signal, at most :data:`SIGNAL_MAX` bytes."""
    found = signal_file(pid)
    if found is None:
        return Attempt(False, how="signal", reason="not hangdoc-wrapped")
    link, signum = found
    refused = _signal_unsafe(pid, signum)
    if refused:
        return Attempt(False, how="signal", reason=f"signal: not sent, {refused}")
    try:
        fd = open_signal_file(link, os.stat(f"/proc/{pid}").st_uid if uid is None else uid)
    except OSError as e:
        return Attempt(False, how="signal", reason=f"signal: not sent, {e.strerror or e}")
    try:
        try:
            before = os.fstat(fd).st_size
            os.kill(pid, signum)
        except OSError as e:
            return Attempt(False, how="signal", reason=f"signal: {e}")
        deadline = time.monotonic() + wait
        size = before
        while time.monotonic() < deadline:
            time.sleep(0.05)
            now = os.fstat(fd).st_size
            if now > before and now == size:
                break  # grew, then stayed the same for one tick: written
            size = now
        try:
            size = min(os.fstat(fd).st_size, before + SIGNAL_MAX)
            text = os.pread(fd, max(0, size - before), before).decode("utf-8", "replace")
        except OSError as e:
            return Attempt(False, how="signal", reason=f"signal: {e}")
    finally:
        os.close(fd)
    if not text.strip():
        return Attempt(False, how="signal", reason=f"no faulthandler output {wait:g}s after {signal.Signals(signum).name}")
    return Attempt(True, text, how="signal")
