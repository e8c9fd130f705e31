"""Finding text stays short at any scale: long rank lists and per-process lines end in "… and N more"."""

from __future__ import annotations

from hangdoc.analysis.grouping import build_report
from hangdoc.analysis.stack_rules import findings
from hangdoc.model import STATUS_STOPPED, Frame, Job, Process, Thread

_AR = (Frame("<module>", "train.py", 30), Frame("step", "train.py", 12),
       Frame("all_reduce", "torch/distributed/distributed_c10d.py", 2501))
_SLEEP = (Frame("<module>", "train.py", 30), Frame("step", "train.py", 10), Frame("sleep", "", native=True))


def test_interleaved_ranks_and_many_stopped_processes():
    procs = [Process(host=f"n{r // 8}", pid=1000 + r, rank=r,
                     threads=[Thread("1", "MainThread", _SLEEP if r % 2 else _AR, state="idle", is_main=True)])
             for r in range(2000)]
    for p in procs[1000:1040]:
        p.status = STATUS_STOPPED
    found = findings(build_report(Job(processes=procs, world_size=2000)))
    texts = [f.summary for f in found] + [e for f in found for e in f.evidence]
    assert max(len(t) for t in texts) < 1200, max(texts, key=len)[:300]
    assert any("… and " in t for t in texts)
    stopped = next(f for f in found if f.kind == "unresponsive-process")
    assert len(stopped.culprits) == 40  # the culprits keep everyone
    assert len([e for e in stopped.evidence if ": stopped" in e]) == 11
    assert "… and 29 more stopped processes" in stopped.evidence
    mismatch = next(f for f in found if f.kind == "collective-mismatch")
    assert "ranks 1,3,5,7,9,11,13,15,17,19 … and " in mismatch.summary
