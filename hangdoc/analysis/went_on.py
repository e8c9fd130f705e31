"""Stacks of a stall the job got over: the records show every rank went on after them.

The in-job watchdog dumps the stacks when a rank made no progress for ``--hang-timeout`` seconds;
a slow checkpoint or evaluation looks exactly like a hang at that moment (rank 0 in
``save_checkpoint``, the others in ``all_reduce``). The records the ranks write at their exit say
what came after: when every rank whose stacks were taken completed calls after its dump, and no
rank has a call still in flight or one that failed, the stacks show a moment the job went past, and what they say
is not the job's verdict. This rule says so (``no-hang``: slow, not hung), and
:func:`hangdoc.analysis.diagnose.diagnose` sets the stack rules' findings aside as describing that
past moment (they stay in the report as detail).

When the stacks were taken comes from their tag line: ``time=`` (the watchdog writes it), else
``last_progress=`` plus the ``reason=no_progress_for_8.2s`` it gives.

    >>> from hangdoc.model import CollectiveRecord as R, Job, Process, Report
    >>> p = Process(host="n1", pid=7, rank=0, meta={"time": "100.0"})
    >>> recs = [R(rank=0, seq=i, op="all_reduce", time_issued=90.0 + 10 * i, time_completed=91.0 + 10 * i,
    ...           state="completed") for i in range(3)]
    >>> [f] = findings(Report(job=Job(processes=[p], records=recs)))
    >>> f.kind, f.summary
    ('no-hang', 'the job went on after its stacks were taken: rank 0 completed 2 calls after its dump (the last at +11.0 s), and no call is left in flight: the stall the stacks show was slow, not hung')
    >>> recs[-1].state = "issued"
    >>> findings(Report(job=Job(processes=[p], records=recs)))
    []
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional

from hangdoc.model import Finding, Process, Report
from hangdoc.ranges import describe_ranks_capped as describe_ranks

#: the origin diagnose() gives this rule's findings (it sets the stack findings aside beside one)
ORIGIN = "records after the stacks"
_NO_PROGRESS = re.compile(r"no_progress_for_(\d{1,9}(?:\.\d{1,6})?)s")
#: a stamp beyond this is not a wall-clock time of this era (bounded input)
_MAX_TIME = 1e11


def dump_time(p: Process) -> Optional[float]:
    """Wall-clock time the stacks of ``p`` were taken, from its tag line; None when it does not say."""
    meta = p.meta
    t = _number(meta.get("time"))
    if t is not None:
        return t
    last = _number(meta.get("last_progress"))
    m = _NO_PROGRESS.fullmatch(str(meta.get("reason") or ""))
    if last is not None and m:
        return last + float(m.group(1))
    return None


def _number(v: object) -> Optional[float]:
    if v is None:
        return None
    try:
        x = float(str(v)[:32])
    except ValueError:
        return None
    return x if 0 < x < _MAX_TIME else None


def findings(report: Report) -> List[Finding]:
    job = report.job
    if not job.records:
        return []
    dumped: Dict[int, float] = {}
    for p in job.processes:
        t = dump_time(p) if p.rank is not None else None
        if t is not None:
            dumped[p.rank] = max(t, dumped.get(p.rank, t))
    if not dumped:
        return []
    after: Dict[int, List[float]] = {r: [] for r in dumped}
    for r in job.records:
        if r.state in ("issued", "failed"):
            return []  # a call still in flight at the end, or one that failed: not a job that went on
        if r.rank in after and r.time_completed is not None and r.time_completed > dumped[r.rank]:
            after[r.rank].append(r.time_completed - dumped[r.rank])
    if not all(after.values()):
        return []
    ranks = sorted(after)
    n = sum(len(v) for v in after.values())
    last = max(max(v) for v in after.values())
    return [Finding(
        "no-hang",
        f"the job went on after its stacks were taken: {describe_ranks(ranks)} completed {n} "
        f"call{'s' if n != 1 else ''} after {'its dump' if len(ranks) == 1 else 'their dumps'} (the last at "
        f"+{last:.1f} s), and no call is left in flight: the stall the stacks show was slow, not hung",
        [],
        [f"rank {r}: stacks taken at {dumped[r]:.3f}, {len(after[r])} call{'s' if len(after[r]) != 1 else ''} "
         f"completed after them" for r in ranks[:8]] + ([f"... and {len(ranks) - 8} more ranks"] if len(ranks) > 8 else []),
        ["The stacks show where the job stood when it stalled; it went on, so nothing hangs. If stalls this long "
         "are normal (a checkpoint, an evaluation), raise `--hang-timeout` above them, or let the watchdog learn "
         "them (it sets its threshold from the longest pauses it saw)."],
        0.9,
    )]
