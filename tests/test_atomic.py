"""write_atomic gives files the mode open() would: 0o666 less the umask, or the existing file's mode."""

from __future__ import annotations

import os
import stat

from hangdoc.atomic import write_atomic


def _mode(p) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def test_new_file_gets_the_umask_mode(tmp_path):
    old = os.umask(0o027)
    try:
        write_atomic(tmp_path / "a.txt", "x")
        with open(tmp_path / "b.txt", "w") as f:
            f.write("x")
    finally:
        os.umask(old)
    assert _mode(tmp_path / "a.txt") == _mode(tmp_path / "b.txt") == 0o640


def test_existing_file_keeps_its_mode(tmp_path):
    p = tmp_path / "c.txt"
    p.write_text("old")
    os.chmod(p, 0o604)
    write_atomic(p, b"new")
    assert p.read_bytes() == b"new" and _mode(p) == 0o604


def test_umask_is_left_alone(tmp_path):
    old = os.umask(0o077)
    try:
        write_atomic(tmp_path / "d.txt", "x")
        assert os.umask(0o077) == 0o077
    finally:
        os.umask(old)
    assert _mode(tmp_path / "d.txt") == 0o600
