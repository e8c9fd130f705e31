"""The stack rules cost per distinct stack, not per process (speed itself is measured in benchmarks/)."""

from __future__ import annotations

import hangdoc.analysis.stack_rules as stack_rules
from hangdoc.analysis.grouping import build_report
from hangdoc.model import Frame, Job, Process, Thread

_AR = (Frame("<module>", "train.py", 30), Frame("step", "train.py", 12),
       Frame("all_reduce", "torch/distributed/distributed_c10d.py", 2501))
_DL = (Frame("<module>", "train.py", 30), Frame("__next__", "torch/utils/data/dataloader.py", 530),
       Frame("_next_data", "torch/utils/data/dataloader.py", 1207),
       Frame("_get_data", "torch/utils/data/dataloader.py", 1163),
       Frame("_try_get_data", "torch/utils/data/dataloader.py", 1011),
       Frame("get", "queue.py", 179), Frame("wait", "threading.py", 306))


def _job(n: int, stalled: int) -> Job:
    procs = [Process(host=f"n{r // 8}", pid=1000 + r, rank=r,
                     threads=[Thread("1", "MainThread", _DL if r == stalled else _AR, state="idle", is_main=True)])
             for r in range(n)]
    return Job(processes=procs, world_size=n)


def test_rules_classify_each_distinct_stack_once(monkeypatch):
    calls = []
    real = stack_rules.wait_of
    monkeypatch.setattr(stack_rules, "wait_of", lambda p: calls.append(p) or real(p))
    report = build_report(_job(4000, stalled=1234))
    found = stack_rules.findings(report)
    assert found[0].kind == "dataloader-stall"
    assert [c.rank for c in found[0].culprits] == [1234]
    assert "ranks 0-1233,1235-3999 wait in collectives" in found[0].summary
    # two distinct stacks: one classification each, not one per process
    assert len(calls) <= 4, len(calls)


def test_verdict_same_whatever_the_process_order():
    job = _job(300, stalled=7)
    a = stack_rules.findings(build_report(job))
    job.processes.reverse()
    b = stack_rules.findings(build_report(job))
    assert [f.to_json() for f in a] == [f.to_json() for f in b]
