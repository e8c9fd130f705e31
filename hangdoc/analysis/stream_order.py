"""Calls queued on GPU streams in orders no execution can satisfy, from the collective records.

With NCCL a rank's synchronous collectives, sends and receives return at once on the host and run
on its GPU stream in the order it issued them; a collective (a send with its receive) completes on
all its ranks together. When the records of the ranks, taken together, order some of those calls in
a cycle, none of them can ever complete (:mod:`hangdoc.order_cycles`). That holds whatever the
recorder saw completed: it sees a call on a GPU completed only at an event or an idle stream, and on
2 x H200 its states for sends and receives between collectives were not even in stream order
(``examples/bugs/pp_skip_pair.py``: a receive read completed after an all_reduce issued before it
read pending), which left the older rules blind ("collective-wait"). So each rank's list is every
synchronous call on its stream from its first one not seen completed on, completed or not.

Each call is named as NCCL pairs it: a collective by its group and its number among that rank's
collectives there, a send or receive by the pair's direction and the message's number. Those
numbers need a rank's records from its first call on (the recorder keeps the newest 100,000); a
rank whose records start later is left out.

Who is named: a cycle of sends and receives only is a ``p2p-cycle`` of every rank on it; two
collectives of two groups in opposite orders name both sides (or the smaller one); a longer cycle,
or one through collectives and sends or receives, names the ranks on it whose own history
broke its loop (:func:`hangdoc.analysis.history.period_breaks`, read up to the cycle's calls, since
the host ran on past the break), else every rank on it.

    >>> from hangdoc.model import CollectiveRecord as R
    >>> def recs(rank, ops):  # each in a group of its own, numbered from 0 there
    ...     return [R(rank=rank, seq=0, op=op, group=op if op == "all_reduce" else "pair", peer=peer, stream="s",
    ...               time_issued=float(i), call_site=f"x.py:{i}:main") for i, (op, peer) in enumerate(ops)]
    >>> a = recs(0, [("all_reduce", None), ("send", 1)])  # rank 0: the all_reduce, then the send
    >>> b = recs(1, [("recv", 0), ("all_reduce", None)])  # rank 1: the receive of it, then the all_reduce
    >>> cycle_of(a + b)[0]
    [(('all_reduce', 0), 0), (('p2p:0>1', 0), 1)]
"""

from __future__ import annotations

from typing import Dict, Hashable, List, Optional, Tuple

from hangdoc import order_cycles
from hangdoc.analysis.history import period_breaks
from hangdoc.analysis.sequence import P2P_OPS, _SENDS, one_origin, site
from hangdoc.model import CollectiveRecord, Culprit, Finding, Report
from hangdoc.ranges import describe_ranks

#: below the record rules' own exact verdicts (0.92-0.95), above their "every rank waits" (0.6)
CONFIDENCE = 0.91
#: calls of a rank's list (from its first not seen completed), at most
LIST = 256
#: blocking point-to-point calls (isend/irecv are the caller's to wait for)
_P2P_SYNC = frozenset({"send", "recv", "send_object_list", "recv_object_list"})

Key = Tuple[str, int]


def _lists(records: List[CollectiveRecord]) -> Tuple[Dict[int, List[Key]], Dict[Tuple[int, Key], CollectiveRecord]]:
    """Per rank, its list of calls (see the module) on the stream of its newest call, and each
    (rank, call)'s record."""
    by_rank: Dict[int, List[CollectiveRecord]] = {}
    for r in records:
        by_rank.setdefault(r.rank, []).append(r)
    lists: Dict[int, List[Key]] = {}
    where: Dict[Tuple[int, Key], CollectiveRecord] = {}
    for rank, mine in by_rank.items():
        mine.sort(key=lambda r: (r.time_issued if r.time_issued is not None else float("inf"), r.seq))
        firsts: Dict[str, int] = {}
        for r in mine:
            firsts[r.group] = min(firsts.get(r.group, r.seq), r.seq)
        if any(v != 0 for v in firsts.values()):
            continue  # the records do not start at the rank's first call: numbers unknown
        coll: Dict[str, int] = {}
        p2p: Dict[Tuple[bool, int], int] = {}
        keyed: List[Tuple[Key, CollectiveRecord]] = []
        for r in mine:
            if r.op in P2P_OPS:
                if r.peer is None:
                    continue
                send = r.op in _SENDS
                k = p2p.get((send, r.peer), 0)
                p2p[(send, r.peer)] = k + 1
                name = order_cycles.p2p_key(rank, r.peer) if send else order_cycles.p2p_key(r.peer, rank)
                if r.op in _P2P_SYNC:
                    keyed.append(((name, k), r))
            else:
                k = coll.get(r.group, 0)
                coll[r.group] = k + 1
                if not r.async_op:
                    keyed.append(((r.group, k), r))
        keyed = [(k, r) for k, r in keyed if r.stream and not r.async_op]
        if not keyed:
            continue
        stream = keyed[-1][1].stream
        keyed = [(k, r) for k, r in keyed if r.stream == stream]
        first = next((i for i, (_, r) in enumerate(keyed) if r.state != "completed"), None)
        if first is None:
            continue
        keyed = keyed[first:first + LIST]
        if len(keyed) < 2:
            continue
        lists[rank] = [k for k, _ in keyed]
        for k, r in keyed:
            where[(rank, k)] = r
    return lists, where


def cycle_of(records: List[CollectiveRecord]) -> Optional[Tuple[List[Tuple[Hashable, int]], Dict[int, List[Key]],
                                                                 Dict[Tuple[int, Key], CollectiveRecord]]]:
    """The first cycle of the ranks' lists (from the lowest rank's earliest call on one), the lists
    and their records; None if none."""
    lists, where = _lists(records)
    start = list(dict.fromkeys(k for rank in sorted(lists) for k in lists[rank]))
    found = order_cycles.cycle(lists, start)  # type: ignore[arg-type]
    return (found, lists, where) if found is not None else None


def findings(report: Report) -> List[Finding]:
    records = [r for r in one_origin(report.job.records) if r.origin == "hangdoc" and r.stream]
    if not records:
        return []
    got = cycle_of(records)
    if got is None:
        return []
    cyc, lists, where = got
    ranks = sorted({r for _, r in cyc})
    calls = [k for k, _ in cyc]

    def rec(rank: int, k: Key) -> CollectiveRecord:
        return where[(rank, k)]

    steps = [f"rank {r}: {rec(r, k).describe()} at {site(rec(r, k))} ({_name(k)}) before "
             f"{rec(r, n).describe()} at {site(rec(r, n))} ({_name(n)})"
             for (k, r), (n, _) in zip(cyc, cyc[1:] + cyc[:1])]
    evidence = steps + ["on a GPU stream each call starts after the one before it, and a collective (a send with "
                        "its receive) completes on all its ranks together: calls ordered in a cycle never complete"]
    advice = ["With NCCL the hosts issue every call at once and hang later, at a sync or at exit: the calls "
              "named here are where the GPUs stopped, not where the stacks are."]
    kind = "collective-mismatch"
    if all(order_cycles.is_p2p(k[0]) for k in calls):
        # sends and receives only: a receive cycle of the pipeline's schedule, every rank on it
        kind, culprits = "p2p-cycle", ranks
        cut = {r: max(rec(r, k).seq for k, rr in cyc if rr == r) for r in ranks}
        breaks = period_breaks([x for x in records if x.rank in cut and x.seq <= cut[x.rank] + 2], ranks)
        summary = (f"the sends and receives queued on the GPUs of {describe_ranks(ranks)} wait on each other in a "
                   f"cycle: {steps[0]} …")
        evidence += [breaks[r].summary for r in sorted(breaks)]
        advice.append("Order each pair's sends and receives the same way on both sides (one sends first, the other "
                      "receives first), or post them together with batch_isend_irecv.")
    elif len(cyc) == 2 and not any(order_cycles.is_p2p(k[0]) for k in calls):
        (c1, r1), (c2, r2) = cyc
        first = sorted(q for q, lst in lists.items() if c1 in lst and c2 in lst and lst.index(c1) < lst.index(c2))
        then = sorted(q for q, lst in lists.items() if c1 in lst and c2 in lst and lst.index(c2) < lst.index(c1))
        culprits = sorted(first + then) if len(first) == len(then) else min(first, then, key=len)
        summary = (f"{describe_ranks(first)} issued {rec(r1, c1).describe()} at {site(rec(r1, c1))} ({_name(c1)}), "
                   f"then {rec(r1, c2).describe()} at {site(rec(r1, c2))} ({_name(c2)}); {describe_ranks(then)} "
                   f"issued them in the opposite order ({site(rec(r2, c2))}, then {site(rec(r2, c1))}): on each GPU "
                   "the second waits behind the first, which waits for the other side's second (groups entered in "
                   "opposite orders)")
        advice.append("Enter the two groups in one order on every rank (or give the calls async_op=True and wait "
                      "for both).")
    else:
        cut = {r: max(rec(r, k).seq for k, rr in cyc if rr == r) for r in ranks}
        upto = [x for x in records if x.rank in cut and x.seq <= cut[x.rank] + 2]
        breaks = period_breaks(upto, ranks)
        broke = sorted(breaks)
        if broke and len(broke) < len(ranks):
            culprits = broke
            summary = (f"{describe_ranks(broke)} broke {'its loop' if len(broke) == 1 else 'their loops'}: "
                       + "; ".join(breaks[r].summary for r in broke) +
                       f"; the calls queued on the GPUs of {describe_ranks(ranks)} then wait on each other in a "
                       "cycle that none can leave")
            advice.append(f"Look at {site(breaks[broke[0]].actual)} on {describe_ranks(broke)}: a rank-dependent "
                          "branch skipped the call its loop always made there.")
        else:
            culprits = ranks
            summary = (f"the calls queued on the GPUs of {describe_ranks(ranks)} wait on each other in a cycle that "
                       f"none can leave: {steps[0]} …")
    ident = {x.rank: (x.host, x.pid) for x in records}
    return [Finding(kind, summary, [Culprit(host=ident[r][0], pid=ident[r][1], rank=r) for r in culprits], evidence,
                    advice, CONFIDENCE)]


_name = order_cycles.call_name
