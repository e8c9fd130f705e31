"""Atomic file writes: readers of hangdoc's files never see half a file.

    >>> import tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> write_atomic(os.path.join(d, "x.txt"), "hello\\n")
    >>> open(os.path.join(d, "x.txt")).read()
    'hello\\n'
"""

from __future__ import annotations

import os
import stat
import tempfile
import threading
from typing import Optional, Union


def write_atomic(path: Union[str, os.PathLike], data: Union[str, bytes], mode: Optional[int] = None) -> None:
    """Write to a temporary file in the same directory, fsync, then rename over ``path``.

    The file gets the mode a plain ``open(path, "w")`` would give it: an existing file keeps its
    mode, a new one gets ``0o666`` less the umask (``mkstemp`` alone would leave it ``0o600``);
    ``mode`` (``0o600`` for stacks that may hold local variables) overrides both: the file is
    never readable by others, not even for a moment.

    >>> import stat, tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "m.txt")
    >>> write_atomic(p, "a"); os.chmod(p, 0o640); write_atomic(p, "b")
    >>> oct(stat.S_IMODE(os.stat(p).st_mode))
    '0o640'
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    if mode is None:
        try:
            mode = stat.S_IMODE(os.stat(path).st_mode)
        except OSError:
            mode = 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(prefix=".hangdoc-", suffix=".tmp", dir=directory)
    try:
        try:
            os.fchmod(fd, mode)
        except (AttributeError, OSError):  # no fchmod (Windows) or a filesystem without modes
            pass
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8", "replace") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


_umask_lock = threading.Lock()


def _umask() -> int:
    # Read it without changing it where the kernel says it (Linux >= 4.7): setting and restoring it
    # would briefly change the mode of files other threads of the user's job create meanwhile.
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    with _umask_lock:
        old = os.umask(0o022)
        os.umask(old)
    return old
