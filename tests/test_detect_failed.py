"""The detector's rank-failed verdict (hangdoc.runtime.detect_failed): the script's own exception is
the cause; one out of a torch.distributed call, or after the launcher's SIGTERM, is a consequence."""

from __future__ import annotations

import os

import pytest

from hangdoc.runtime import detect_failed, on_term
from hangdoc.runtime.detect_digest import Digests

DESCRIBE = lambda rec: ("all_reduce([4] float32)", "train.py:7")  # noqa: E731


def _raise_from(filename: str, exc: BaseException) -> BaseException:
    code = compile("raise exc", filename, "exec")
    try:
        exec(code, {"exc": exc})
    except BaseException as e:  # noqa: BLE001 - handed back to the test
        return e
    raise AssertionError("did not raise")


def test_an_exception_from_inside_a_collective_is_a_consequence():
    inside = os.path.join("site-packages", "torch", "distributed", "distributed_c10d.py")
    e = _raise_from(os.sep + inside, RuntimeError("Connection closed by peer [127.0.0.1]:1234"))
    assert detect_failed.from_a_collective(e)
    assert detect_failed.verdict(e, 2, Digests(), DESCRIBE) is None
    mine = _raise_from(os.path.join(os.sep, "work", "train.py"), ValueError("loss is nan"))
    assert not detect_failed.from_a_collective(mine)
    v = detect_failed.verdict(mine, 2, Digests(), DESCRIBE)
    assert (v.kind, v.deviants, v.basis) == ("rank-failed", [2], "raised")
    assert v.text.startswith("rank 2 raised ValueError: loss is nan at train.py:1 in <module>")


def test_torch_s_own_argument_check_inside_a_collective_is_the_ranks_error():
    """``scatter(..., scatter_list=...)`` on a non-source rank, a send to itself: torch.distributed
    raises ValueError before anything is sent (examples/bugs/scatter_list_node_reader.py)."""
    inside = os.path.join("site-packages", "torch", "distributed", "distributed_c10d.py")
    e = _raise_from(os.sep + inside, ValueError("Argument ``scatter_list`` must NOT be specified on non-source ranks."))
    assert not detect_failed.from_a_collective(e)
    v = detect_failed.verdict(e, 2, Digests(), DESCRIBE)
    assert (v.kind, v.deviants) == ("rank-failed", [2])


def test_after_a_sigterm_an_exception_is_the_teardowns(monkeypatch):
    e = _raise_from("train.py", RuntimeError("DataLoader worker (pid(s) 123) exited unexpectedly"))
    assert detect_failed.verdict(e, 1, Digests(), DESCRIBE) is not None
    monkeypatch.setitem(on_term._state, "first", 1.0)
    assert on_term.terminating()
    assert detect_failed.verdict(e, 1, Digests(), DESCRIBE) is None


@pytest.mark.parametrize("message", ["a\x1b[31mred\x07\nline", "x" * 5000, ""])
def test_the_message_is_one_bounded_printable_line(message):
    e = _raise_from("train.py", ValueError(message))
    text = detect_failed.verdict(e, 0, Digests(), DESCRIBE).text
    assert text.isprintable() and len(text) < 400, text
    if not message:
        assert text.startswith("rank 0 raised ValueError at train.py:1")


def test_the_last_collective_is_named():
    d = Digests()
    rec = (0, "all_reduce", ("default_pg", (0, 1)), ((4,),), ("float32",), None, None, False, 7)
    d.hook("default_pg", "all_reduce", ((4,),), ("float32",), None, rec)
    e = _raise_from("train.py", KeyError("batch"))
    v = detect_failed.verdict(e, 1, d, DESCRIBE)
    assert "its last collective was #0 of default_pg, all_reduce([4] float32) at train.py:7" in v.text, v.text
    assert v.deviant_entry[1:] == ["all_reduce([4] float32)", "train.py:7"]
