"""Calls queued behind each other on a GPU stream: two groups entered in opposite orders under NCCL.

With NCCL no collective blocks the host: a rank issues group A's all_reduce and then group B's,
and both wait on its GPU, B's behind A's (torch makes the caller's stream wait for each synchronous
collective, and the next one start after that stream). When another rank issued B's first, each
GPU's first call waits for the other GPU's second: a deadlock, while every rank has issued every
call, the per-group digests agree, and no rank waits in a call on the host
(``examples/bugs/opposite_groups_pair.py`` on 2 x H200; :mod:`hangdoc.runtime.detect_groups` finds
the same bug on gloo, where the second call is never issued).

A quiet rank publishes ``h``: the collectives on its GPU stream that the recorder has not seen
completed, in the order it issued them (the newest :data:`QUEUED`; the recorder sees a call completed
only at an event or an idle stream, so calls that did complete may be listed too). When two ranks
list the same two calls in opposite orders, each rank's first of them can only start once the other
rank's second ran, which waits behind its first: neither ever completes (had they completed, they
would not be in the lists either way). That pair of calls is the verdict. Calls made with
``async_op=True`` (the caller decides when to wait) and calls on the CPU are never listed.

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

from hangdoc.runtime.detect_digest import RING, Verdict, partners
from hangdoc.runtime.detect_groups import READ_FOR_SIDES, hypercube

#: calls queued behind the head that a publication lists at most
QUEUED = 16
#: records of the recorder's buffer looked at for the head (the newest; a head older than that is
#: past what the digests' rings hold anyway)
TAIL = RING


def head(records: Sequence[tuple], groups: Dict[str, Any], describe: Callable[[tuple], Tuple[str, str]]
         ) -> Optional[Dict[str, Any]]:
    """``h`` for a quiet rank, from the recorder's resolved buffer (oldest first) and the digests'
    groups (whose rings hold each collective's record by identity); None with fewer than two such calls."""
    from hangdoc.runtime.recorder import _ASYNC, _STATE, _STREAM

    pending = [r for r in records[-TAIL:] if r[_STATE] == "issued" and r[_STREAM] is not None and not r[_ASYNC]]
    if len(pending) < 2:
        return None
    stream = pending[-1][_STREAM]
    mine = [r for r in pending if r[_STREAM] == stream][-QUEUED:]
    if len(mine) < 2:
        return None
    wanted = {id(r): r for r in mine}
    where: Dict[int, Tuple[str, int]] = {}
    for name, g in list(groups.items()):
        for e in list(g.ring):
            if e is not None and id(e[3]) in wanted and e[3] is wanted[id(e[3])]:
                where[id(e[3])] = (name, e[0])
    queued = [[*where[id(r)], *describe(r)] for r in mine if id(r) in where]
    return {"q": queued} if len(queued) >= 2 else None


Call = Tuple[str, int]


def _calls(pub: Optional[Dict[str, Any]]) -> Optional[List[List[Any]]]:
    """A quiet publication's listed calls, [group, index, call, site] each, or None."""
    h = (pub or {}).get("h") if (pub or {}).get("quiet") else None
    q = h.get("q") if isinstance(h, dict) else None
    if not isinstance(q, list):
        return None
    out = [x[:4] for x in q[:QUEUED] if isinstance(x, list) and len(x) >= 4 and isinstance(x[0], str)
           and type(x[1]) is int]
    return out if len(out) >= 2 else None


def _inversion(mine: List[List[Any]], theirs: List[List[Any]]) -> Optional[Tuple[List[Any], List[Any]]]:
    """Two calls both lists hold, in opposite orders: (the first of them in ``mine``, the second)."""
    pos = {(x[0], x[1]): k for k, x in enumerate(theirs)}
    seen: List[Tuple[int, List[Any]]] = []
    for x in mine:
        k = pos.get((x[0], x[1]))
        if k is None:
            continue
        for k0, x0 in seen:
            if k0 > k:
                return x0, x
        seen.append((k, x))
    return None


def _order(calls: Optional[List[List[Any]]], a: Call, b: Call) -> Optional[bool]:
    """True when ``calls`` lists ``a`` before ``b``, False when after, None when not both."""
    keys = [(x[0], x[1]) for x in calls or ()]
    if a in keys and b in keys:
        return keys.index(a) < keys.index(b)
    return None


def queued_cycle(me: int, mine: Dict[str, Any], pub_of: Callable[[int], Optional[Dict[str, Any]]],
                 ranks_of: Callable[[str], Sequence[int]]) -> Optional[Verdict]:
    """Two calls this quiet rank and another list in opposite orders (see the module), as a verdict."""
    calls = _calls(mine)
    if calls is None:
        return None
    looked = set()
    for name in dict.fromkeys(x[0] for x in calls):
        for q in hypercube(me, list(ranks_of(name))):
            if q in looked:
                continue
            looked.add(q)
            theirs = _calls(pub_of(q))
            hit = _inversion(calls, theirs) if theirs else None
            if hit is not None:
                at = {(c[0], c[1]): c for c in theirs or ()}
                return _verdict(me, hit, (at[(hit[1][0], hit[1][1])], at[(hit[0][0], hit[0][1])]), pub_of, ranks_of)
    return None


def _verdict(me: int, hit: Tuple[List[Any], List[Any]], other: Tuple[List[Any], List[Any]],
             pub_of: Callable[[int], Optional[Dict[str, Any]]], ranks_of: Callable[[str], Sequence[int]]) -> Verdict:
    """``hit``: the two calls as this rank issued them; ``other``: the same two as the other side did
    (its own call sites), in its order."""
    x, y = hit
    a_key, b_key = (x[0], x[1]), (y[0], y[1])
    first: List[int] = [me]  # x then y, as this rank issued them
    then: List[int] = []  # y then x
    union = sorted(set(ranks_of(x[0])) | set(ranks_of(y[0])) | {me})
    for r in partners(me, union, extra=READ_FOR_SIDES):
        if r == me:
            continue
        o = _order(_calls(pub_of(r)), a_key, b_key)
        if o is True:
            first.append(r)
        elif o is False:
            then.append(r)
    a, b = sorted(first), sorted(then)
    if len(a) == len(b):
        deviants, agreeing = sorted(a + b), []
    else:
        deviants, agreeing = (a, b) if len(a) < len(b) else (b, a)
    entry_x, entry_y = [None, x[2], x[3], None], [None, y[2], y[3], None]
    odd_first = deviants == a
    v = Verdict(y[0] if odd_first else x[0], y[1] if odd_first else x[1], True, deviants, agreeing,
                entry_x if odd_first else entry_y, entry_y if odd_first else entry_x, "queued")
    v.other_group = x[0] if odd_first else y[0]
    v.sides = {x[0]: a, y[0]: b} if x[0] != y[0] else None  # group -> the ranks whose first call is in it
    v.text = summary(a, b, x, y, other, agreeing)
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
