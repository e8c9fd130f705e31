"""The wait-for graph of the collective records: who waits for whom, and its cycles.

Each rank's blocked call (its oldest not seen completed, per CUDA stream) waits for the ranks of
its group that have not issued the same call (a collective), or for its peer (a send or receive);
a call queued on a stream behind an older pending one waits for that one. A cycle is a deadlock:
none of its calls can complete.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

from hangdoc.analysis.sequence import _SENDS, P2P_OPS, collectives, one_origin, site
from hangdoc.model import CollectiveRecord

Node = Tuple[int, str]  # (rank, stream): "host" when the call is not on a CUDA stream


@dataclass
class Cycle:
    nodes: List[Node]
    #: the blocked record of each node, in cycle order.
    records: List[CollectiveRecord]
    summary: str


def pending(records: Iterable[CollectiveRecord]) -> Dict[int, List[CollectiveRecord]]:
    """Rank -> records issued but never seen completed, oldest first: where each rank is blocked."""
    out: Dict[int, List[CollectiveRecord]] = defaultdict(list)
    for r in one_origin(records):
        if r.state == "issued":
            out[r.rank].append(r)
    for lst in out.values():
        lst.sort(key=lambda x: (x.time_issued or 0.0, x.group, x.seq))
    return dict(out)


def _node(rec: CollectiveRecord) -> Node:
    return (rec.rank, rec.stream or "host")


def wait_for(records: Iterable[CollectiveRecord]) -> Tuple[Dict[Node, List[Node]], Dict[Node, CollectiveRecord]]:
    """Wait-for graph: each blocked (rank, stream) -> the (rank, stream) nodes it waits on.

    A blocked collective waits for every rank of its group that has not issued as many collectives
    in that group, or whose matching call is queued on a CUDA stream behind an older pending op; a
    blocked recv (send) waits for the peer that has not issued the matching send (recv) in that
    group, matched by order per (sender, receiver) pair, or whose matching half is so queued.
    """
    records = one_origin(records)
    blocked: Dict[Node, CollectiveRecord] = {}
    for rank, lst in pending(records).items():
        for rec in lst:
            blocked.setdefault(_node(rec), rec)  # the oldest pending op of each stream blocks it
    blocked_by_rank: Dict[int, List[Node]] = defaultdict(list)
    for node in blocked:
        blocked_by_rank[node[0]].append(node)

    coll = collectives(records)
    index_in_group: Dict[int, int] = {}
    for per_rank in coll.values():
        for lst in per_rank.values():
            for i, x in enumerate(lst):
                index_in_group[id(x)] = i
    # p2p: (group, sender, receiver) -> [send records], [recv records]
    sends: Dict[Tuple[str, int, int], List[CollectiveRecord]] = defaultdict(list)
    recvs: Dict[Tuple[str, int, int], List[CollectiveRecord]] = defaultdict(list)
    for x in sorted((x for x in records if x.op in P2P_OPS and x.peer is not None), key=lambda x: x.seq):
        if x.op in _SENDS:
            sends[(x.group, x.rank, x.peer)].append(x)
        else:
            recvs[(x.group, x.peer, x.rank)].append(x)

    def targets(rank: int) -> List[Node]:
        return blocked_by_rank.get(rank) or [(rank, "running")]

    edges: Dict[Node, List[Node]] = {}
    for node, rec in blocked.items():
        waits: List[Node] = []
        if rec.op in P2P_OPS and rec.peer is not None:
            if rec.op in _SENDS:
                mine, theirs = sends[(rec.group, rec.rank, rec.peer)], recvs[(rec.group, rec.rank, rec.peer)]
            else:
                mine, theirs = recvs[(rec.group, rec.peer, rec.rank)], sends[(rec.group, rec.peer, rec.rank)]
            n = next((i for i, x in enumerate(mine) if x is rec), len(mine))
            if len(theirs) <= n:  # the peer has not posted the matching half yet
                waits.extend(targets(rec.peer))
            elif _stuck_behind(theirs[n], blocked):
                # Posted, but queued behind an older op the peer is blocked in: NCCL runs a pair's
                # sends and receives in order, so it cannot start (both pipeline stages receive first).
                waits.append(_node(theirs[n]))
        elif rec.op not in P2P_OPS:
            n = index_in_group.get(id(rec), 0)
            members = rec.group_ranks or tuple(sorted(coll.get(rec.group, {})))
            for q in members:
                if q == rec.rank:
                    continue
                theirs = coll.get(rec.group, {}).get(q, ())
                if len(theirs) <= n:
                    waits.extend(targets(q))
                elif _stuck_behind(theirs[n], blocked):
                    # issued, but queued on its CUDA stream behind an older op that rank is blocked in
                    # (NCCL: collectives return at once on the host; two groups entered in opposite
                    # orders on one stream deadlock there, with every call issued everywhere)
                    waits.append(_node(theirs[n]))
        edges[node] = waits
    return edges, blocked


def _stuck_behind(rec: CollectiveRecord, blocked: Dict[Node, CollectiveRecord]) -> bool:
    """True when ``rec`` is pending on a CUDA stream (or an NCCL Flight Recorder entry) behind an
    older pending op of the same stream: in-order execution keeps it from starting."""
    if rec.state != "issued" or (rec.stream is None and rec.origin != "flight-recorder"):
        return False
    head = blocked.get(_node(rec))
    return head is not None and head is not rec


def cycles(records: Iterable[CollectiveRecord]) -> List[Cycle]:
    """Cycles of the wait-for graph (send/recv order bugs, cross-stream deadlocks), each once."""
    edges, blocked = wait_for(records)
    seen_sets = set()
    found: List[Cycle] = []
    for start in sorted(edges):
        path: List[Node] = []
        on_path: Dict[Node, int] = {}
        node: Optional[Node] = start
        visited = set()
        # Follow first edges only: enough for the simple cycles that deadlock pipelines.
        stack = [(start, iter(edges.get(start, ())))]
        path = [start]
        on_path = {start: 0}
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                stack.pop()
                path.pop()
                on_path.pop(node, None)
                continue
            if nxt in on_path:
                cyc = path[on_path[nxt]:]
                key = frozenset(cyc)
                if key not in seen_sets:
                    seen_sets.add(key)
                    k = cyc.index(min(cyc))
                    cyc = cyc[k:] + cyc[:k]
                    recs = [blocked[n] for n in cyc]
                    found.append(Cycle(cyc, recs, _cycle_summary(cyc, recs)))
                continue
            if nxt in visited or nxt not in edges:
                continue
            visited.add(nxt)
            stack.append((nxt, iter(edges.get(nxt, ()))))
            path.append(nxt)
            on_path[nxt] = len(path) - 1
    return found


def _cycle_summary(nodes: List[Node], recs: List[CollectiveRecord]) -> str:
    parts = []
    for (rank, stream), rec in zip(nodes, recs):
        where = f"rank {rank}" + (f" ({stream})" if stream != "host" else "")
        parts.append(f"{where} waits in {rec.describe()} at {site(rec)}")
    return " → ".join(parts) + f" → rank {nodes[0][0]}"
