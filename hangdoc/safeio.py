"""Opening input files nobody checked: regular files only, never a hang, every read bounded.

``hangdoc aggregate`` reads whatever it is pointed at. A FIFO blocks a plain ``open`` for ever, a
device such as ``/dev/zero`` never ends, and a symbolic link met while walking a shared directory
may point anywhere. :func:`open_input` opens with ``O_NONBLOCK`` (an open of a FIFO returns at
once), checks the type before and after the open (``lstat``/``stat`` then ``fstat`` of the same
inode), and refuses anything but a regular file with :class:`NotRegularFile`, whose message is one
line. Files met in a directory walk are opened with ``O_NOFOLLOW``. :func:`read_bounded` reads a
whole file only up to a limit.

    >>> import os, tempfile
    >>> d = tempfile.mkdtemp(); p = os.path.join(d, "fifo"); os.mkfifo(p)
    >>> try:
    ...     open_input(p)
    ... except NotRegularFile as e:
    ...     print(e)
    a FIFO (named pipe), not a regular file: not read
"""

from __future__ import annotations

import os
import stat
from typing import BinaryIO

#: the most a whole-file read (a Flight Recorder dump, a py-spy --json block) takes in
MAX_WHOLE_FILE = 512 << 20

_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISLNK, "a symbolic link (not followed in a directory walk)"),
)


class NotRegularFile(OSError):
    """The path is no regular file (FIFO, device, socket, directory, a link not followed)."""


class TooLarge(OSError):
    """A whole-file read went past its limit."""


def kind_of(mode: int) -> str:
    """What a file of this ``st_mode`` is, in words.

    >>> kind_of(stat.S_IFIFO | 0o600), kind_of(stat.S_IFREG | 0o600)
    ('a FIFO (named pipe)', 'a regular file')
    """
    for test, name in _KINDS:
        if test(mode):
            return name
    return "a regular file" if stat.S_ISREG(mode) else "not a regular file"


def check_regular(st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise NotRegularFile(f"{kind_of(st.st_mode)}, not a regular file: not read")


def open_input(path: str, follow: bool = True) -> BinaryIO:
    """``path`` opened for binary reading, if it is a regular file; raises OSError otherwise
    (:class:`NotRegularFile` for a FIFO, device, socket, directory or, with ``follow=False``, a
    symbolic link). Never blocks: the type is checked before the open, the open is non-blocking,
    and the opened inode is checked again (the path may have been swapped in between)."""
    st = os.stat(path) if follow else os.lstat(path)
    check_regular(st)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)
    if not follow:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags)
    try:
        fst = os.fstat(fd)
        check_regular(fst)
        if (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino):
            raise NotRegularFile("replaced while being opened: not read")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bounded(f: BinaryIO, limit: int = MAX_WHOLE_FILE, what: str = "file") -> bytes:
    """All of ``f``, or :class:`TooLarge` when it holds more than ``limit`` bytes."""
    # in pieces: read(limit + 1) would reserve the whole limit up front, however small the file
    parts = []
    total = 0
    while True:
        piece = f.read(min(1 << 20, limit + 1 - total))
        if not piece:
            break
        parts.append(piece)
        total += len(piece)
        if total > limit:
            raise TooLarge(f"{what} larger than {limit >> 20} MiB: not read")
    return b"".join(parts)


def read_source(file: str, limit: int) -> "bytes | None":
    """A source file named by a frame or a dump (``train.py``), read as input: a regular file
    only (a FIFO would block, ``/dev/zero`` never end), at most ``limit`` bytes; None otherwise
    (``<string>``, missing, too large, not a regular file)."""
    if not file or file.startswith("<"):
        return None
    try:
        with open_input(file) as f:
            return read_bounded(f, limit, "source file")
    except (OSError, ValueError):
        return None


#: a run of NULs at least this long is a hole (a file cut or overwritten while written), not
#: binary content: a log rotated with copytruncate goes on at its old offset, leaving NULs before it
HOLE = 64
_NUL_RUN = b"\x00" * HOLE


def drop_nul_runs(data: bytes) -> bytes:
    """``data`` without its runs of :data:`HOLE` or more NULs (single NULs, binary content, stay).

    >>> drop_nul_runs(b"ab" + bytes(100) + b"cd\\x00e")
    b'abcd\\x00e'
    """
    if _NUL_RUN not in data:
        return data
    out = []
    i = 0
    n = len(data)
    while i < n:
        j = data.find(_NUL_RUN, i)
        if j < 0:
            out.append(data[i:])
            break
        out.append(data[i:j])
        k = j + HOLE
        while k < n and data[k] == 0:
            k += 1
        i = k
    return b"".join(out)


#: how far :func:`sniff_head` reads through NULs at the start of a file to find its text
MAX_HOLE_SCAN = 64 << 20


def sniff_head(f: BinaryIO, size: int) -> bytes:
    """The first ``size`` bytes of ``f``, or, when it starts with a hole of NULs, the first bytes
    after it (jumping over a sparse hole with ``SEEK_DATA``; reading through at most
    :data:`MAX_HOLE_SCAN` bytes otherwise). ``f`` is left at its start."""
    head = f.read(size)
    if head[:HOLE] != _NUL_RUN[:len(head[:HOLE])] or not head:
        f.seek(0)
        return head
    if not head.strip(b"\x00"):
        pos = len(head)
        seek_data = getattr(os, "SEEK_DATA", None)
        if seek_data is not None:
            try:
                pos = os.lseek(f.fileno(), 0, seek_data)
            except OSError:  # ENXIO: nothing but a hole to the end
                pos = None
        scanned = 0
        while pos is not None and scanned < MAX_HOLE_SCAN:
            f.seek(pos)
            head = f.read(size)
            if not head or head.strip(b"\x00"):
                break
            pos += len(head)
            scanned += len(head)
        else:
            head = b""
    f.seek(0)
    return head
