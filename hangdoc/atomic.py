"""Atomic file writes: readers of hangdoc's files never see half a file.

    >>> import tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> write_atomic(os.path.join(d, "x.txt"), "hello\\n")
    >>> open(os.path.join(d, "x.txt")).read()
    'hello\\n'
"""

from __future__ import annotations

import os
import tempfile
from typing import Union


def write_atomic(path: Union[str, os.PathLike], data: Union[str, bytes]) -> None:
    """Write to a temporary file in the same directory, fsync, then rename over ``path``."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".hangdoc-", suffix=".tmp", dir=directory)
    try:
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
