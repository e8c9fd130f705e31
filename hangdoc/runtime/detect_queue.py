"""Calls queued behind each other on GPU streams: deadlocks that NCCL leaves to the GPUs.

With NCCL no synchronous collective, send or receive blocks the host: a rank issues its calls and
they wait on its GPU, each behind the one before it on the stream (torch makes the caller's stream
wait for each synchronous call, and the next one start after that stream). So a deadlock leaves
every rank having issued every call, the per-group digests agreeing, and no rank waiting in a call
on the host. Two forms, on 2 x H200:

* two groups entered in opposite orders (``examples/bugs/opposite_groups_pair.py``): rank 0 issued
  group 1's all_reduce then group 2's, rank 1 the other way round; each GPU's first waits for the
  other GPU's second (:mod:`hangdoc.runtime.detect_groups` finds it on gloo, where the second call
  is never issued);
* a skipped collective in a pipeline (``examples/bugs/pp_skip_pair.py``): rank 1 skipped an
  all_reduce and went on to receive the next activation, which rank 0 sends only after that
  all_reduce (:mod:`hangdoc.runtime.detect_pattern` on gloo).

A quiet rank publishes ``h``: the calls on its GPU stream that the recorder has not seen completed,
in the order it issued them (the newest :data:`QUEUED`), each named the way NCCL pairs it with its
peers' calls: a collective by its group and its number there, a send or receive by the pair's
direction and the message's number (``p2p:0>1`` #4: rank 0's fifth send to rank 1, rank 1's fifth
receive from rank 0). Every rank runs its list in order, and a call completes on all its ranks
together; so when the lists of the ranks read, taken together, order some calls in a cycle, none of
them can ever complete. The recorder sees a call completed only at an event or an idle stream, so a
list may hold calls that did complete: they cannot be on such a cycle (a call on it would have to
complete before itself). Calls made with ``async_op=True`` (the caller decides when to wait) and
calls on the CPU are never listed.

Who is named: a cycle of two collectives of two groups is two groups entered in opposite orders, and
both sides are named (or the smaller one); a cycle of sends and receives only is a ``p2p-cycle`` of
every rank on it; on a longer cycle through collectives and sends or receives, the ranks of it that
broke their loop (``qbrk``: as :mod:`hangdoc.runtime.detect_pattern`'s ``brk``, over
the last :data:`QUEUED` calls, since the host ran on past the break), else every rank of the cycle.

    >>> h = lambda *calls: {"q": [[g, i, "all_reduce([8] float32)", f"x.py:{30 + i}"] for g, i in calls]}
    >>> pubs = {0: {"quiet": True, "h": h(("1", 3), ("2", 3))},
    ...         1: {"quiet": True, "h": h(("2", 1), ("1", 2), ("2", 2), ("2", 3), ("1", 3))}}
    >>> v = queued_cycle(0, pubs[0], pubs.get, lambda name: (0, 1))
    >>> v.deviants, v.sides
    ([0, 1], {'1': [0], '2': [1]})
    >>> same_order = {0: pubs[0], 1: {"quiet": True, "h": h(("1", 3), ("2", 3))}}
    >>> queued_cycle(0, same_order[0], same_order.get, lambda name: (0, 1)) is None
    True
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from hangdoc import order_cycles
from hangdoc.runtime.detect_digest import RING, Verdict, partners
from hangdoc.runtime.detect_groups import READ_FOR_SIDES

#: calls a publication lists at most (the newest not seen completed)
QUEUED = 16
#: records of the recorder's buffer looked at (the newest; older ones are past the digests' rings)
TAIL = RING
#: calls of each group's ring looked at for a listed call (its newest): a job with hundreds of
#: groups costs hundreds of short scans, not hundreds of whole rings, once a second while quiet
SCAN = 512
#: publications read at most to follow a cycle
READ = 64
#: point-to-point calls named in a list (blocking ones; isend/irecv are async)
P2P = ("send", "recv")
P2P_PREFIX = order_cycles.P2P_PREFIX

Call = Tuple[str, int]


def head(records: Sequence[tuple], groups: Dict[str, Any], describe: Callable[[tuple], Tuple[str, str]],
         rank: Optional[int] = None, p2p_ring: Sequence[Any] = ()) -> Optional[Dict[str, Any]]:
    """``h`` for a quiet rank, from the recorder's resolved buffer (oldest first), the digests' groups
    (whose rings hold each collective's record by identity) and their point-to-point ring (record,
    message number); None with fewer than two such calls on the newest call's stream."""
    from hangdoc.runtime.recorder import _ASYNC, _OP, _PEER, _STATE, _STREAM

    pending = [r for r in records[-TAIL:] if r[_STATE] == "issued" and r[_STREAM] is not None and not r[_ASYNC]]
    if len(pending) < 2:
        return None
    stream = pending[-1][_STREAM]
    mine = [r for r in pending if r[_STREAM] == stream][-QUEUED:]
    if len(mine) < 2:
        return None
    wanted = {id(r): r for r in mine}
    where: Dict[int, Call] = {}
    mask = RING - 1
    for name, g in list(groups.items()):
        ring, n = g.ring, g.n
        for i in range(n - 1, max(-1, n - 1 - SCAN), -1):  # the group's newest calls only
            e = ring[i & mask]
            if e is not None and id(e[3]) in wanted and e[3] is wanted[id(e[3])]:
                where[id(e[3])] = (name, e[0])
    if rank is not None:
        for e in list(p2p_ring):
            if e is None or id(e[0]) not in wanted or e[0] is not wanted[id(e[0])]:
                continue
            r, k = e
            if r[_OP] in P2P and type(r[_PEER]) is int:
                src, dst = (r[_PEER], rank) if r[_OP] == "recv" else (rank, r[_PEER])
                where[id(r)] = (order_cycles.p2p_key(src, dst), k)
    queued = [[*where[id(r)], *describe(r)] for r in mine if id(r) in where]
    return {"q": queued} if len(queued) >= 2 else None


def members(name: str, ranks_of: Callable[[str], Sequence[int]]) -> List[int]:
    """The ranks of a listed call: a group's members, or a pair's two ranks."""
    if name.startswith(P2P_PREFIX):
        try:
            return [int(x) for x in name[len(P2P_PREFIX):].split(">", 1)]
        except ValueError:
            return []
    return list(ranks_of(name))


def _calls(pub: Optional[Dict[str, Any]]) -> Optional[List[List[Any]]]:
    """A quiet publication's listed calls, [name, number, call, site] each, or None."""
    h = (pub or {}).get("h") if (pub or {}).get("quiet") else None
    q = h.get("q") if isinstance(h, dict) else None
    if not isinstance(q, list):
        return None
    out = [x[:4] for x in q[:QUEUED] if isinstance(x, list) and len(x) >= 4 and isinstance(x[0], str)
           and type(x[1]) is int]
    return out if len(out) >= 2 else None


def _cycle(lists: Dict[int, List[List[Any]]], start: List[Call]) -> Optional[List[Tuple[Call, int]]]:
    """:func:`hangdoc.order_cycles.cycle` over the calls' keys (name, number)."""
    return order_cycles.cycle({r: [(x[0], x[1]) for x in calls] for r, calls in lists.items()}, start)  # type: ignore[return-value]


def queued_cycle(me: int, mine: Dict[str, Any], pub_of: Callable[[int], Optional[Dict[str, Any]]],
                 ranks_of: Callable[[str], Sequence[int]]) -> Optional[Verdict]:
    """The cycle of queued calls this quiet rank's calls are on (see the module), as a verdict."""
    calls = _calls(mine)
    if calls is None:
        return None
    lists: Dict[int, List[List[Any]]] = {me: calls}
    pubs: Dict[int, Dict[str, Any]] = {me: mine}
    todo = [me]
    while todo and len(pubs) < READ:  # the ranks of the calls listed, and of theirs, breadth first
        r = todo.pop(0)
        for name in dict.fromkeys(x[0] for x in lists[r]):
            for q in members(name, ranks_of):
                if q in pubs or len(pubs) >= READ:
                    continue
                p = pub_of(q)
                pubs[q] = p or {}
                got = _calls(p)
                if got is not None:
                    lists[q] = got
                    todo.append(q)
    mine_c = _collectives(calls)
    for q, theirs in sorted(lists.items()):
        hit = _inversion(mine_c, _collectives(theirs)) if q != me else None
        if hit is not None:  # two groups' collectives in opposite orders: the two sides
            return _sides(me, q, hit, lists, pub_of, ranks_of)
    cycle = _cycle(lists, [(x[0], x[1]) for x in calls])
    if cycle is None:
        return None
    return _verdict(cycle, lists, pubs)


def _collectives(calls: List[List[Any]]) -> List[List[Any]]:
    return [x for x in calls if not x[0].startswith(P2P_PREFIX)]


def _inversion(mine: List[List[Any]], theirs: List[List[Any]]) -> Optional[Tuple[List[Any], List[Any]]]:
    """Two calls both lists hold, in opposite orders: (the first of them in ``mine``, the second)."""
    hit = order_cycles.inversion([(x[0], x[1]) for x in mine], [(x[0], x[1]) for x in theirs])
    if hit is None:
        return None
    at = {(x[0], x[1]): x for x in mine}
    return at[hit[0]], at[hit[1]]


def _entry(lists: Dict[int, List[List[Any]]], r: int, c: Call) -> List[Any]:
    return next(x for x in lists[r] if (x[0], x[1]) == c)


def _verdict(cycle: List[Tuple[Call, int]], lists: Dict[int, List[List[Any]]], pubs: Dict[int, Dict[str, Any]]) -> Verdict:
    """A cycle through sends and receives, or through more than two calls: the ranks on it that broke
    their loop, else all of them."""
    from hangdoc.ranges import describe_ranks

    ranks = sorted({r for _, r in cycle})
    steps = "; ".join(f"rank {r}: {_entry(lists, r, c)[2]} at {_entry(lists, r, c)[3]} ({_name(c)}) before "
                      f"{_entry(lists, r, n)[2]} at {_entry(lists, r, n)[3]} ({_name(n)})"
                      for (c, r), (n, _) in zip(cycle, cycle[1:] + cycle[:1]))
    broke = sorted(r for r in ranks if isinstance(pubs.get(r, {}).get("qbrk"), dict))
    first = _entry(lists, cycle[0][1], cycle[0][0])
    if all(c[0].startswith(P2P_PREFIX) for c, _ in cycle):
        # sends and receives only: a receive cycle of the pipeline's schedule, every rank on it
        v = Verdict(first[0], first[1], True, ranks, [], [None, first[2], first[3], None], None, "queued")
        v.kind = "p2p-cycle"
        v.text = (f"the sends and receives queued on the GPUs of {describe_ranks(ranks)} wait on each other in a "
                  f"cycle that none can leave: {steps}")
        return v
    if broke and len(broke) < len(ranks):
        brk = pubs[broke[0]]["qbrk"]
        try:
            at, after, usual = ([str(x) for x in brk[k][:2]] for k in ("at", "after", "usual"))
        except (KeyError, TypeError, IndexError):
            at = after = usual = None
        if at is not None:
            v = Verdict("default_pg", 0, True, broke, [r for r in ranks if r not in broke], [None] + at + [None],
                        [None] + usual + [None], "pattern-break")
            v.text = (f"{describe_ranks(broke)} broke {'its loop' if len(broke) == 1 else 'their loops'}: after "
                      f"{after[0]} at {after[1]} came {at[0]} at {at[1]} where every earlier iteration issued "
                      f"{usual[0]} at {usual[1]} (a skipped call); the calls queued on the GPUs of "
                      f"{describe_ranks(ranks)} now wait on each other in a cycle that none can leave: {steps}")
            return v
    v = Verdict(first[0], first[1], True, ranks, [], [None, first[2], first[3], None], None, "queued")
    v.text = (f"the calls queued on the GPUs of {describe_ranks(ranks)} wait on each other in a cycle that none can "
              f"leave: {steps}")
    return v


_name = order_cycles.call_name


def _order(calls: Optional[List[List[Any]]], a: Call, b: Call) -> Optional[bool]:
    """True when ``calls`` lists ``a`` before ``b``, False when after, None when not both."""
    keys = [(x[0], x[1]) for x in calls or ()]
    if a in keys and b in keys:
        return keys.index(a) < keys.index(b)
    return None


def _sides(me: int, q: int, hit: Tuple[List[Any], List[Any]], lists: Dict[int, List[List[Any]]],
           pub_of: Callable[[int], Optional[Dict[str, Any]]], ranks_of: Callable[[str], Sequence[int]]) -> Verdict:
    """Two collectives of two groups, issued in opposite orders by the two sides (``hit``: the two as
    this rank issued them; rank ``q`` issued them the other way round)."""
    (c1, c2), r1, r2 = ((hit[0][0], hit[0][1]), (hit[1][0], hit[1][1])), me, q
    first: List[int] = []  # c1 then c2
    then: List[int] = []
    union = sorted(set(ranks_of(c1[0])) | set(ranks_of(c2[0])) | {me})
    for r in partners(me, union, extra=READ_FOR_SIDES):
        o = _order(lists.get(r) if r in lists else _calls(pub_of(r)), c1, c2)
        if o is True:
            first.append(r)
        elif o is False:
            then.append(r)
    a, b = sorted(set(first) | {r1}), sorted(set(then) | {r2})
    if len(a) == len(b):
        deviants, agreeing = sorted(a + b), []
    else:
        deviants, agreeing = (a, b) if len(a) < len(b) else (b, a)
    x, y = _entry(lists, r1, c1), _entry(lists, r1, c2)
    ox, oy = _entry(lists, r2, c2), _entry(lists, r2, c1)
    odd_first = deviants == a
    v = Verdict(c2[0] if odd_first else c1[0], c2[1] if odd_first else c1[1], True, deviants, agreeing,
                [None, x[2], x[3], None] if odd_first else [None, ox[2], ox[3], None],
                [None, ox[2], ox[3], None] if odd_first else [None, x[2], x[3], None], "queued")
    v.other_group = c1[0] if odd_first else c2[0]
    v.sides = {c1[0]: a, c2[0]: b}
    v.text = summary(a, b, x, y, (ox, oy), agreeing)
    return v


def summary(a: List[int], b: List[int], x: List[Any], y: List[Any], other: Tuple[List[Any], List[Any]],
            agreeing: List[int]) -> str:
    """``rank 0 issued all_reduce(...) at x.py:38 (group 1, #3), then all_reduce(...) at x.py:39 (group
    2, #3); rank 1 issued them in the opposite order: ... at x.py:41 (group 2, #3), then ...``."""
    from hangdoc.ranges import describe_ranks

    def call(c: List[Any]) -> str:
        return f"{c[2]} at {c[3]} (group {c[0]}, #{c[1]})"

    text = (f"{describe_ranks(a)} issued {call(x)}, then {call(y)}; {describe_ranks(b)} issued them in the opposite "
            f"order: {call(other[0])}, then {call(other[1])}. On each GPU the second waits behind the first, which "
            "waits for the other side's second, so neither ever completes (groups entered in opposite orders)")
    if agreeing:
        odd = a if len(a) < len(b) else b
        text += f"; {describe_ranks(odd)}, the smaller side, {'is' if len(odd) == 1 else 'are'} the odd one"
    return text
