"""A rank that died in native code inside a collective the others were not making.

gloo checks what it receives: a rank that issues a collective its peers do not (an extra
``all_reduce`` of a logged metric) is paired with their next one, and the rank whose buffer is too
small aborts (``terminate called after throwing gloo::EnforceNotMet``, SIGABRT). No Python runs
after that, so the rank leaves no records of that call; what it leaves is its faulthandler dump
(:mod:`hangdoc.runtime.fatal`: ``Fatal Python error: Aborted`` and its stack). The other ranks'
records say which collective they were in.

This rule compares the two: a rank whose fatal stack is in a collective at a call site where none of
the other ranks' in-flight records is, while those agree on one call, is the culprit of a
**collective-mismatch**. Ranks that aborted at the very call the others wait in (a size or dtype
mismatch: the side whose buffers are too small aborts) are judged by the sides' sizes, the smaller
side the odd one (equal sides: candidates only). A rank that has records of its own is left to the
record rules.

    >>> from hangdoc.model import CollectiveRecord as R, Frame, Job, Process, Report, Thread
    >>> recs = [R(rank=r, seq=7, op="all_reduce", call_site="train.py:38:main", state="failed") for r in (0, 2, 3)]
    >>> stack = (Frame("main", "train.py", 37), Frame("log_loss", "train.py", 27),
    ...          Frame("all_reduce", "torch/distributed/distributed_c10d.py", 3252))
    >>> p = Process(host="n1", pid=9, rank=1, threads=[Thread("1", "MainThread", stack, is_main=True)],
    ...             meta={"fatal_error": "Aborted"})
    >>> [f] = findings(Report(job=Job(processes=[p], records=recs)))
    >>> f.kind, [c.rank for c in f.culprits]
    ('collective-mismatch', [1])
    >>> f.summary
    'rank 1 died (Fatal Python error: Aborted) in all_reduce at log_loss (train.py:27), a call the other ranks were not making: ranks 0,2-3 were in all_reduce #7 at main (train.py:38)'
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

from hangdoc.analysis.sequence import site
from hangdoc.analysis.signatures import wait_of
from hangdoc.model import CollectiveRecord, Culprit, Finding, Report
from hangdoc.ranges import describe_ranks_capped as describe_ranks

#: above the stacks' verdicts (the call site is exact on both sides), below the records' own
CONFIDENCE = 0.9


def _site(call_site: str) -> Optional[Tuple[str, int, str]]:
    """``file:line:function`` of a record as (file, line, function)."""
    parts = call_site.rsplit(":", 2)
    if len(parts) != 3 or not parts[1].isdigit() or len(parts[1]) > 9:
        return None
    return parts[0], int(parts[1]), parts[2]


def _same_file(a: str, b: str) -> bool:
    return a == b or os.path.basename(a) == os.path.basename(b) and (a.endswith(b) or b.endswith(a))


def _in_flight(records: List[CollectiveRecord]) -> Dict[int, CollectiveRecord]:
    """Each rank's last record, where that one never completed (the call it was in)."""
    last: Dict[int, CollectiveRecord] = {}
    for r in records:
        t = r.time_issued if isinstance(r.time_issued, (int, float)) else float("-inf")
        cur = last.get(r.rank)
        ct = cur.time_issued if cur is not None and isinstance(cur.time_issued, (int, float)) else float("-inf")
        if cur is None or (t, r.seq) >= (ct, cur.seq):
            last[r.rank] = r
    return {k: r for k, r in last.items() if r.state != "completed"}


def findings(report: Report) -> List[Finding]:
    job = report.job
    fatal = [p for p in job.processes if p.meta.get("fatal_error") and p.rank is not None]
    if not fatal or not job.records:
        return []
    recorded = {r.rank for r in job.records}
    flight = _in_flight([r for r in job.records if r.origin == "hangdoc"] or job.records)
    out: List[Finding] = []
    same: Dict[tuple, list] = {}  # the call the others are in -> [(aborted rank's process, the others' records)]
    for p in fatal:
        if p.rank in recorded:
            continue
        w = wait_of(p)
        if w.category not in ("collective", "p2p") or w.call_site is None:
            continue
        others = {k: r for k, r in flight.items() if k != p.rank}
        sites = {(r.op, _site(r.call_site)) for r in others.values()}
        if len(sites) != 1:
            if len(others) >= 2 and all(r.state == "failed" for r in others.values()):
                out.append(_first_to_fail(p, w, others))  # they stopped where each call failed
            continue
        (op, site), = sites
        if site is None:
            continue
        cs = w.call_site
        if op == w.op and site[1] == cs.line and _same_file(site[0], cs.file):
            same.setdefault((op, site, tuple(sorted({r.seq for r in others.values()}))), []).append((p, others))
            continue  # aborted at the call the others were in: a mismatch of sizes or types (below)
        if len(others) < 2:
            continue  # one other rank is no agreement on where the job was
        ranks = sorted(others)
        seqs = sorted({r.seq for r in others.values()})
        num = f" #{seqs[0]}" if len(seqs) == 1 else ""
        where = f"{site[2]} ({site[0]}:{site[1]})"
        summary = (f"rank {p.rank} died (Fatal Python error: {p.meta['fatal_error']}) in {w.describe()}, a call the other "
                   f"ranks were not making: {describe_ranks(ranks)} were in {op}{num} at {where}")
        evidence = [
            f"rank {p.rank}: its faulthandler dump at the fatal signal shows it in {w.describe()}; it left no records of that call",
            f"{describe_ranks(ranks)}: their records end in {op}{num} at {where}, never completed",
        ]
        advice = [f"Look at the branch that leads rank {p.rank} to {os.path.basename(cs.file)}:{cs.line} "
                  f"(`if rank == ...`, a condition on its own data): the other ranks never make that call, so the "
                  f"backend paired it with their {op} and aborted (gloo: `Received data size doesn't match expected size`)."]
        out.append(Finding("collective-mismatch", summary, [p.culprit()], evidence, advice, confidence=CONFIDENCE,
                           detail=[f"rank {p.rank}'s stack, outermost first: " + " → ".join(f.label() for f in p.main_thread.frames[-6:])]
                           if p.main_thread is not None else []))
    for (op, site, seqs), died in same.items():
        out.extend(_aborted_in_the_same_call(op, site, seqs, died))
    return out


#: a side told by its size alone (the backend's check, not the records) is less sure than a record
CONFIDENCE_SIDES = 0.8
#: the first to fail, where every other rank's call failed after it: above the stacks' view of where
#: each rank stopped (a consequence), below a divergence of the records (which say whose call differed)
CONFIDENCE_FIRST = 0.85


def _first_to_fail(p, w, others: Dict[int, CollectiveRecord]) -> Finding:
    """A rank that died in native code inside a collective, every other rank's last call failed
    (``Connection reset by peer``: the backend tore the group down) at calls that disagree: none of
    them still waits, so where each stopped is a consequence, and the abort the cause (the backend's check of a call that
    does not match its peers': ``examples/bugs/moe_capacity_alltoall_splits.py``, an
    ``all_to_all_single`` whose receive split is smaller than a peer sends)."""
    ranks = sorted(others)
    summary = (f"rank {p.rank} died (Fatal Python error: {p.meta['fatal_error']}) in {w.describe()}; then every other "
               f"rank's call failed ({describe_ranks(ranks)}): the backend aborted it on a call that does not match "
               f"its peers' (sizes, split sizes, dtypes)")
    evidence = [f"rank {p.rank}: its faulthandler dump at the fatal signal shows it in {w.describe()}; it left no records of that call",
                "their last calls, each failed: " + "; ".join(
                    f"rank {k}: {r.op} #{r.seq} at {site(r)}" for k, r in sorted(others.items())[:8])]
    advice = [f"Compare what rank {p.rank} and its peers pass to {w.op} at {w.call_site.file}:{w.call_site.line} "
              f"(sizes, split sizes, dtypes): the backend's check failed on rank {p.rank}'s side of that call."]
    return Finding("collective-mismatch", summary, [p.culprit()], evidence, advice, confidence=CONFIDENCE_FIRST)


def _aborted_in_the_same_call(op: str, site: Tuple[str, int, str], seqs: tuple, died: list) -> List[Finding]:
    """Ranks that aborted in the very call the others wait in, their records lost with them. gloo
    checks the size of what each rank receives: the side whose buffers are too small aborts, the
    other waits. With the records of the aborted side gone, the sides' sizes tell: the smaller side
    is the odd one out (one rank passed a size or type the others did not); of equal sides,
    neither is named (``examples/bugs/ragged_eval_allgather.py``: an uneven last eval batch)."""
    aborted = sorted(p.rank for p, _ in died)
    waiting = sorted(set(died[0][1]) - set(aborted))
    if not waiting:
        return []
    num = f" #{seqs[0]}" if len(seqs) == 1 else ""
    where = f"{site[2]} ({site[0]}:{site[1]})"
    kind_of = "a size or type mismatch: the side whose buffers are too small aborts (gloo: `Received data size doesn't match expected size`)"
    summary = (f"{describe_ranks(aborted)} died (Fatal Python error: {died[0][0].meta['fatal_error']}) in {op}{num} at "
               f"{where}, the call {describe_ranks(waiting)} {'waits' if len(waiting) == 1 else 'wait'} in: {kind_of}")
    if len(aborted) < len(waiting):
        culprits, candidates = [p.culprit() for p, _ in died], []
        summary += f"; {describe_ranks(aborted)}, the smaller side, passed what the others did not"
    elif len(waiting) < len(aborted):
        culprits = [Culprit(host=r.host, pid=r.pid, rank=r.rank) for k, r in sorted(died[0][1].items()) if k in waiting]
        candidates = []
        summary += f"; {describe_ranks(waiting)}, the smaller side, passed what the others did not"
    else:
        culprits, candidates = [], [p.culprit() for p, _ in died]
        summary += "; the sides are as large, so which one passed another size is not known"
    records = died[0][1]
    shapes = sorted({f"{r.op}{list(r.shapes[0]) if r.shapes else ''} {' '.join(r.dtypes)}".strip() for r in records.values()})
    evidence = [f"{describe_ranks(aborted)}: the faulthandler dump at the fatal signal shows {'it' if len(aborted) == 1 else 'them'} in "
                f"{op} at {where}; no records of {'its' if len(aborted) == 1 else 'their'} own survived the abort",
                f"{describe_ranks(waiting)}: their records end in {op}{num} at {where} ({'; '.join(shapes)}), never completed"]
    advice = [f"Compare what {describe_ranks(aborted)} and {describe_ranks(waiting)} pass to {op} at {site[0]}:{site[1]} "
              "(the last batch of an uneven split, a dtype cast on one path): every rank must pass the same sizes and types."]
    return [Finding("collective-mismatch", summary, culprits, evidence, advice, confidence=CONFIDENCE_SIDES,
                    candidates=candidates)]
