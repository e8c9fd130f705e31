"""``req.wait()`` on a torch.distributed request, told from its function's calls
(hangdoc.analysis.source_waits.request_wait), and relative file names of py-spy dumps found under
the scripts' directories (set_source_roots)."""

from __future__ import annotations

import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hangdoc.analysis import source_waits
from hangdoc.analysis.diagnose import diagnose
from hangdoc.analysis.signatures import classify_stack
from hangdoc.model import Frame, Job, Process, Report, Thread

SOURCE = textwrap.dedent("""\
    import torch.distributed as dist

    def rotate(kv, nxt, prv, incoming):
        ops = [dist.P2POp(dist.isend, kv, nxt), dist.P2POp(dist.irecv, incoming, prv)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()

    def reduce_async(t):
        h = dist.all_reduce(t, async_op=True)
        h.wait()

    def two_kinds(t):
        a = dist.all_reduce(t, async_op=True)
        b = dist.broadcast(t, 0, async_op=True)
        a.wait()

    def child(p, done_event):
        done_event.wait()
        p.wait()

    def handles(reqs):
        reqs[0].wait(timeout=timedelta_s)
""")


@pytest.fixture
def src(tmp_path):
    p = tmp_path / "ring.py"
    p.write_text(SOURCE)
    return str(p)


def _line(text):
    return next(i for i, line in enumerate(SOURCE.splitlines(), 1) if line.strip() == text)


def test_a_request_of_batch_isend_irecv_is_a_p2p_wait(src):
    assert source_waits.request_wait(src, _line("req.wait()")) == ("p2p", "batch_isend_irecv", "req.wait()")


def test_a_request_of_one_async_collective_is_that_collective(src):
    assert source_waits.request_wait(src, _line("h.wait()")) == ("collective", "all_reduce", "h.wait()")


def test_two_kinds_of_collective_or_no_distributed_call_claim_nothing(src):
    assert source_waits.request_wait(src, _line("a.wait()")) is None  # which of the two: unknown
    assert source_waits.request_wait(src, _line("p.wait()")) is None  # a Popen, say
    assert source_waits.request_wait(src, _line("done_event.wait()")) is None  # an Event: blocking_call's
    assert source_waits.request_wait(src, _line("reqs[0].wait(timeout=timedelta_s)")) is None


def test_idle_at_the_line_reads_as_a_p2p_wait(src):
    frames = (Frame("main", src, 30), Frame("rotate", src, _line("req.wait()")))
    w = classify_stack(frames, "idle")
    assert (w.category, w.op) == ("p2p", "batch_isend_irecv") and "req.wait()" in w.detail


def test_a_relative_name_is_found_under_the_scripts_directory(tmp_path, monkeypatch):
    (tmp_path / "ring.py").write_text(SOURCE)
    monkeypatch.chdir(tmp_path.parent)  # not where the script is
    line = _line("req.wait()")
    procs = [Process(host="n", pid=10 + r, rank=r, command=f"/usr/bin/python3 -u {tmp_path}/ring.py --x 1",
                     threads=[Thread("1", "MainThread", (Frame("rotate", "ring.py", line),), state="idle", is_main=True)])
             for r in range(2)]
    try:
        [f] = diagnose(Report(job=Job(processes=procs)))
        assert f.kind == "p2p-stall", f.summary
        source_waits.set_source_roots([])  # without the roots the name is not found
        assert source_waits.request_wait("ring.py", line) is None
    finally:
        source_waits.set_source_roots([])


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="abc_.[]()=0 \t#wait", max_size=120))
def test_request_pattern_on_any_line(text):
    # total on any text: a match or not, never an error
    assert source_waits._REQUEST_WAIT.search(text) is None or ".wait(" in text
