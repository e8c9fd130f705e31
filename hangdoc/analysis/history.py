"""A rank's own history of calls: where it broke the pattern its loop kept before.

A training loop issues the same calls in the same order every step, across all its process groups
(a tensor-parallel all_reduce, a pipeline send, a recv ...). A rank that skips one of them in one
step breaks that period; the ranks it leaves waiting keep theirs. In a wait-for cycle through
several groups (tensor-parallel and pipeline groups, say) every rank waits for the next, so the
cycle alone blames everybody; the rank whose own history broke its period is the one whose code
took another path.

    >>> from hangdoc.model import CollectiveRecord as R
    >>> def calls(rank, sites):
    ...     return [R(rank=rank, seq=i, op=op, call_site=f"train.py:{line}:main", time_issued=float(i))
    ...             for i, (op, line) in enumerate(sites)]
    >>> step = [("recv", 46), ("all_reduce", 48), ("send", 50)]
    >>> kept = calls(2, step * 3 + step[:2])
    >>> broke = calls(3, step * 3 + [("recv", 46), ("send", 50), ("recv", 46)])
    >>> breaks = period_breaks(kept + broke, [2, 3])
    >>> sorted(breaks), breaks[3].expected, breaks[3].actual.op
    ([3], ('all_reduce', 'train.py:48'), 'send')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

from hangdoc.analysis.sequence import MAX_PERIOD, periodic_next, site
from hangdoc.model import CollectiveRecord

#: calls of a rank's history looked at (its newest); a loop of up to sequence.MAX_PERIOD calls repeated twice fits
WINDOW = 512
#: how far from the end of a rank's history a break may lie (the skip comes shortly before the hang)
TAIL = 8


@dataclass
class Break:
    """``rank`` issued ``actual`` where its loop's period says ``expected`` (op, call site) came next."""

    rank: int
    expected: Tuple[str, str]
    actual: CollectiveRecord
    #: the calls of one period, as (op, call site), for the evidence
    period: List[Tuple[str, str]]

    @property
    def summary(self) -> str:
        return (f"rank {self.rank} issued {self.actual.op} at {site(self.actual)} where every earlier iteration of "
                f"its loop issued {self.expected[0]} at {self.expected[1]} "
                f"(its loop: {', '.join(f'{op} {where}' for op, where in self.period)})")


def _key(r: CollectiveRecord) -> Tuple[str, str]:
    return (r.op, site(r))


def _history(mine: List[CollectiveRecord]) -> List[CollectiveRecord]:
    if all(r.time_issued is not None for r in mine):
        mine.sort(key=lambda r: r.time_issued)  # across groups: the order the rank issued them
    lanes = {r.stream for r in mine}
    if len(lanes) > 1 and any(lanes):
        # host calls (another backend's group, another thread) beside a CUDA stream: the host runs
        # ahead of the stream, so their times interleave in no order the program has; the loop is
        # the lane most of its calls are on
        counts = {lane: sum(1 for r in mine if r.stream == lane) for lane in lanes}
        lane = max(counts, key=lambda k: (counts[k], k is not None))
        mine = [r for r in mine if r.stream == lane]
    return mine[-WINDOW:]


def _period(keys: List[Tuple[str, str]], nxt: Tuple[str, str]) -> List[Tuple[str, str]]:
    for p in range(1, min(len(keys) // 2, MAX_PERIOD) + 1):
        if keys[len(keys) - p] == nxt and keys[-p:] == keys[-2 * p:-p]:
            return keys[-p:]
    return [nxt]


def period_breaks(records: Iterable[CollectiveRecord], ranks: Iterable[int]) -> Dict[int, Break]:
    """The ranks among ``ranks`` whose newest calls broke the period their history kept before."""
    wanted = set(ranks)
    by_rank: Dict[int, List[CollectiveRecord]] = {r: [] for r in wanted}
    for r in records:  # one pass, however many ranks the cycle holds
        if r.rank in wanted:
            by_rank[r.rank].append(r)
    out: Dict[int, Break] = {}
    for rank in sorted(wanted):
        hist = _history(by_rank[rank])
        keys = [_key(r) for r in hist]
        beside = _beside(hist)
        for k in _looked_at(hist, beside):
            if k in beside:
                continue
            expected: Optional[Tuple[str, str]] = periodic_next(keys[:k])
            if expected is not None and keys[k] != expected:
                out[rank] = Break(rank, expected, hist[k], _period(keys[:k], expected))
                break
    return out


def _beside(hist: List[CollectiveRecord]) -> set:
    """Positions of calls never seen completed while calls the rank issued after them completed:
    made beside its loop, not in its place (a checkpoint thread's barrier on a group of its own,
    ``examples/bugs/async_ckpt_side_barrier.py``), so neither where it stopped nor a break."""
    out, later_done = set(), False
    for i in range(len(hist) - 1, -1, -1):
        if hist[i].state == "completed":
            later_done = True
        elif later_done and not hist[i].stream:
            out.add(i)  # (on a CUDA stream calls complete in order: states that say otherwise are wrong)
    return out


def _looked_at(hist: List[CollectiveRecord], beside: set = frozenset()) -> List[int]:
    """Where a break is looked for, in order: around the rank's first synchronous call not seen
    completed (where it stopped), then the end of its history. With NCCL the host issues every
    call of the next steps before the GPU stops at the skipped one: there the end of the history
    lies well past the break, and a window straddling it reads a longer "period" that the calls
    after it break (``examples/bugs/pp_skip_pair.py`` on 2 x H200: a period of five, and the wrong
    call named)."""
    n = len(hist)
    stop = next((i for i, r in enumerate(hist) if r.state == "issued" and not r.async_op and i not in beside), n)
    if not any(r.state == "completed" for r in hist[:stop]):
        stop = n  # no completion known before it: no stopping point to go by
    near = range(max(2, stop - TAIL), min(n, stop + TAIL + 1))
    return list(near) + [k for k in range(max(2, n - TAIL), n) if k not in near]
