"""Replay recorded calls under blocking semantics: would this schedule deadlock on a real backend?

On the ``fake`` backend every call returns at once, so a pipeline whose stages both ``send``
before they ``recv`` runs to the end, while on NCCL or gloo it hangs. Replaying each rank's
records with the conservative rules that hold on every backend finds those bugs without running
anything:

* a blocking ``send``/``recv`` completes only when the peer has posted the matching call;
  messages between two ranks pair up first-in first-out, and their shapes and dtypes must agree;
* ``isend``/``irecv`` (and ``async_op=True`` calls) post and return at once;
* a blocking collective on a group completes only when every member reached its call of the
  same index in that group (which call it is, is :func:`hangdoc.analysis.sequence.divergences`'s
  business).

    >>> from hangdoc.model import CollectiveRecord as R
    >>> send = lambda r, p: R(r, 0, "send", shapes=((4,),), dtypes=("float32",), peer=p)
    >>> recv = lambda r, p: R(r, 1, "recv", shapes=((4,),), dtypes=("float32",), peer=p)
    >>> [p.kind for p in replay({0: [send(0, 1), recv(0, 1)], 1: [send(1, 0), recv(1, 0)]})]
    ['deadlock']
    >>> replay({0: [send(0, 1), recv(0, 1)], 1: [recv(1, 0), send(1, 0)]})
    []
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Deque, Dict, List, Mapping, Optional, Sequence, Tuple

from hangdoc.model import CollectiveRecord
from hangdoc.ranges import describe_ranks

SENDS = frozenset({"send", "isend", "send_object_list"})
RECVS = frozenset({"recv", "irecv", "recv_object_list"})
ASYNC_P2P = frozenset({"isend", "irecv"})
MAX_COLUMNS = 3


@dataclass
class ScheduleProblem:
    """One way the replay failed: ``deadlock``, ``unmatched`` or ``p2p-signature``."""

    kind: str
    summary: str
    ranks: List[int]
    #: rank -> index (into that rank's calls) of the call it is stuck in / the offending call.
    at: Dict[int, int] = field(default_factory=dict)
    #: for a deadlock: stuck rank -> the ranks it waits for, and the cycle among them (if any).
    waits: Dict[int, List[int]] = field(default_factory=dict)
    cycle: List[int] = field(default_factory=list)


def _site(rec: CollectiveRecord) -> str:
    parts = (rec.call_site or "").rsplit(":", 2)
    if len(parts) == 3:
        import os

        return f"{os.path.basename(parts[0])}:{parts[1]}"
    return rec.call_site or "?"


def replay(calls: Mapping[int, Sequence[CollectiveRecord]]) -> List[ScheduleProblem]:
    """Problems found replaying ``calls`` (rank -> its records in issue order); empty when fine."""
    ranks = sorted(calls)
    ops = {r: [c for c in calls[r] if not (c.group_ranks and c.rank not in c.group_ranks)] for r in ranks}
    pos = {r: 0 for r in ranks}
    # (src, dst) -> FIFO of unmatched posts: (rank's call index, record)
    sends: Dict[Tuple[int, int], Deque[Tuple[int, CollectiveRecord]]] = defaultdict(deque)
    recvs: Dict[Tuple[int, int], Deque[Tuple[int, CollectiveRecord]]] = defaultdict(deque)
    matched: Dict[Tuple[int, int], bool] = {}  # (rank, call index) -> its p2p call found a partner
    posted: Dict[Tuple[int, int], bool] = {}
    arrived: Dict[Tuple[str, int], set] = defaultdict(set)  # (group, k) -> ranks that reached it
    group_count: Dict[Tuple[int, str], int] = defaultdict(int)
    group_index: Dict[Tuple[int, int], int] = {}
    problems: List[ScheduleProblem] = []

    def post(r: int, i: int, c: CollectiveRecord) -> None:
        if (r, i) in posted:
            return
        posted[(r, i)] = True
        if c.peer is None:
            matched[(r, i)] = True  # nothing to pair with: do not invent a hang
            return
        if c.op in SENDS:
            key, other = (r, c.peer), recvs
            mine = sends
        else:
            key, other = (c.peer, r), sends
            mine = recvs
        if other[key]:
            j, partner = other[key].popleft()
            matched[(r, i)] = True
            matched[(partner.rank, j)] = True
            if (partner.shapes, partner.dtypes) != (c.shapes, c.dtypes) and c.shapes and partner.shapes:
                s, d = (c, partner) if c.op in SENDS else (partner, c)
                problems.append(ScheduleProblem(
                    "p2p-signature",
                    f"rank {s.rank} sent {s.describe()} at {_site(s)} but rank {d.rank} received it as "
                    f"{d.describe()} at {_site(d)} (shape/dtype mismatch)",
                    sorted({s.rank, d.rank}), {r: i, partner.rank: j}))
        else:
            mine[key].append((i, c))

    progress = True
    while progress:
        progress = False
        for r in ranks:
            while pos[r] < len(ops[r]):
                i = pos[r]
                c = ops[r][i]
                if c.op in SENDS or c.op in RECVS:
                    post(r, i, c)
                    if c.op in ASYNC_P2P or c.async_op or matched.get((r, i)):
                        pos[r] += 1
                        progress = True
                        continue
                    break
                # a collective: arrive once, wait for the whole group unless async
                if (r, i) not in group_index:
                    k = group_count[(r, c.group)]
                    group_count[(r, c.group)] = k + 1
                    group_index[(r, i)] = k
                    arrived[(c.group, k)].add(r)
                members = set(c.group_ranks) if c.group_ranks else set(ranks)
                if c.async_op or members <= arrived[(c.group, group_index[(r, i)])] or not members <= set(ranks):
                    pos[r] += 1
                    progress = True
                    continue
                break

    stuck = [r for r in ranks if pos[r] < len(ops[r])]
    if stuck:
        problems.insert(0, _deadlock(stuck, ops, pos, group_index, arrived, ranks))
    else:
        for queues, what, to, verb in ((sends, "send", "to", "received"), (recvs, "recv", "from", "sent")):
            for (src, dst), q in sorted(queues.items()):
                if not q:
                    continue
                i, c = q[0]
                me, other = (src, dst) if what == "send" else (dst, src)
                problems.append(ScheduleProblem(
                    "unmatched", f"rank {me} posted {len(q)} {what}{'s' if len(q) > 1 else ''} {to} rank {other} that "
                    f"rank {other} never {verb}, the first {c.describe()} at {_site(c)}", [src, dst], {me: i}))
    return problems


def _deadlock(stuck, ops, pos, group_index, arrived, ranks) -> ScheduleProblem:
    waits: Dict[int, List[int]] = {}
    lines = []
    for r in stuck:
        c = ops[r][pos[r]]
        if c.op in SENDS or c.op in RECVS:
            waits[r] = [c.peer] if c.peer is not None else []
            lines.append(f"rank {r} blocks in {c.describe()} at {_site(c)}, waiting for rank {c.peer}")
        else:
            members = set(c.group_ranks) if c.group_ranks else set(ranks)
            missing = sorted(members - arrived[(c.group, group_index[(r, pos[r])])])
            waits[r] = missing
            lines.append(f"rank {r} blocks in {c.describe()} (group {c.group}) at {_site(c)}, waiting for "
                         f"{describe_ranks(missing)}")
    cycle = _find_cycle(waits)
    head = ("the schedule deadlocks under blocking semantics"
            + (f": {' -> '.join(f'rank {r}' for r in cycle + cycle[:1])}" if cycle else "")
            + " (send/recv pairs must be posted in the same order on both sides)")
    shown = cycle + [r for r in sorted(stuck) if r not in cycle]
    return ScheduleProblem("deadlock", head + "\n" + "\n".join("  " + ln for ln in lines), shown,
                           {r: pos[r] for r in stuck}, waits, cycle)


def _find_cycle(waits: Dict[int, List[int]]) -> List[int]:
    for start in sorted(waits):
        path: List[int] = []
        seen: Dict[int, int] = {}
        node: Optional[int] = start
        while node is not None and node in waits and node not in seen:
            seen[node] = len(path)
            path.append(node)
            nxt = waits[node]
            node = nxt[0] if nxt else None
        if node is not None and node in seen:
            return path[seen[node]:]
    return []


def format_problems(calls: Mapping[int, Sequence[CollectiveRecord]], problems: Sequence[ScheduleProblem]) -> str:
    """Each problem's summary and the calls of its ranks around where they got stuck, side by side."""
    blocks = []
    for p in problems:
        cols = [r for r in p.ranks if r in calls][:MAX_COLUMNS]
        rows = []
        if cols and p.at:
            lo = max(0, min(p.at.get(r, 0) for r in cols) - 2)
            cells = {r: [c for c in calls[r] if not (c.group_ranks and c.rank not in c.group_ranks)] for r in cols}
            hi = min(max(p.at.get(r, 0) for r in cols) + 2, max(len(v) for v in cells.values()))
            width = 46
            rows.append("      " + " | ".join(f"rank {r}".ljust(width) for r in cols).rstrip())
            for i in range(lo, hi):
                line = []
                for r in cols:
                    c = cells[r][i] if i < len(cells[r]) else None
                    mark = ">" if p.at.get(r) == i else " "
                    text = f"{mark} {c.describe()}  {_site(c)}" if c is not None else ""
                    line.append(text.ljust(width))
                rows.append(f"  #{i:<3}" + " | ".join(line).rstrip())
        blocks.append(p.summary + ("\n" + "\n".join(rows) if rows else ""))
    return "\n\n".join(blocks)
