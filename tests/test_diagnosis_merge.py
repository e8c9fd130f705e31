"""Stack and record rules that find the same kind of hang give one finding, not two."""

from __future__ import annotations

import os

from hangdoc.analysis import analyse
from hangdoc.readers import read_paths
from tests.procs import ROOT

FIXTURES = os.path.join(ROOT, "tests", "fixtures", "records")


def test_one_collective_mismatch_with_the_records_culprit_and_the_stacks_evidence():
    report = analyse(read_paths([os.path.join(FIXTURES, "skip_broadcast")]))
    mismatches = [f for f in report.findings if f.kind == "collective-mismatch"]
    assert len(mismatches) == 1
    [f] = mismatches
    assert f is report.findings[0]
    assert [c.rank for c in f.culprits] == [2]  # the records are exact; the stacks could only say "one of 1-3"
    note = [e for e in f.detail if e.startswith("the stacks alone said: ")]  # -v only: the records prove it
    assert len(note) == 1 and "(one of ranks 1-3, without saying which)" in note[0]
    assert f.confidence >= 0.9


def test_the_records_cycle_and_the_stacks_receive_deadlock_are_one_finding():
    # hangdoc demo pipeline, captured: the records see the cycle with its peers; the stacks alone
    # (every rank of the job in recv, none sending) say a receive deadlock of the same ranks: one
    # finding, the records' (a stall of the same ranks "with unknown peers" must not stand beside
    # the cycle either: test_a_p2p_stall_outside_the_cycle_stays)
    report = analyse(read_paths([os.path.join(FIXTURES, "pipeline_demo")]))
    assert [f.kind for f in report.findings] == ["p2p-cycle"]
    [f] = report.findings
    assert sorted(c.rank for c in f.culprits) == [0, 1, 2]
    assert f.summary.startswith("send/recv cycle between ranks 0-2")
    assert any(e.startswith("the stacks alone said: ranks 0-2 all wait in recv and none sends") for e in f.detail)


def test_a_p2p_stall_outside_the_cycle_stays():
    from hangdoc.analysis.diagnose import _drop_explained_p2p
    from hangdoc.model import Culprit, Finding, Frame, Job, Process, Report, Thread

    def proc(rank, fn):
        stack = (Frame("main", "t.py", 1), Frame(fn, "torch/distributed/distributed_c10d.py", 2))
        return Process(rank=rank, pid=rank + 1, role="rank", threads=[Thread("1", "MainThread", stack, is_main=True)])

    report = Report(job=Job(processes=[proc(0, "recv"), proc(1, "recv"), proc(2, "recv"), proc(3, "recv")]))
    cycle = Finding("p2p-cycle", "cycle 0-1", [Culprit(rank=0), Culprit(rank=1)])
    stall = Finding("p2p-stall", "ranks 2-3 wait on rank 4", [Culprit(rank=4)])
    assert _drop_explained_p2p(report, [cycle, stall]) == [cycle, stall]  # ranks 2-3 wait outside the cycle
    report.job.processes = report.job.processes[:2]
    inside = Finding("p2p-stall", "ranks 0-1 wait in send/recv with unknown peers", [])
    assert _drop_explained_p2p(report, [cycle, inside]) == [cycle]
    assert cycle.detail == ["the stacks alone said: ranks 0-1 wait in send/recv with unknown peers (the cycle explains these waits)"]
