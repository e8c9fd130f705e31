"""Two process groups entered in opposite orders, seen in the detector's publications while the job runs.

Each group's sequence agrees on every rank that issued it (per-group digests see no divergence), yet
the job is stuck: on a backend whose calls block on the host (gloo), ranks 0-2 wait in group A's
all_reduce for rank 3, which has not issued it and waits in group B's all_reduce for ranks 0-2, which
have not issued that one. Torch numbers groups by creation order, so creating two groups in another
order on one rank does exactly this (``examples/bugs/group_order.py``), as does using two groups in
opposite orders (``examples/bugs/opposite_groups.py``).

The check, on a rank that went quiet: its latest call is in group G at count n; a member q of G,
quiet too, has issued fewer than n calls in G, and q waits in another group H at count m (its
latest call is there, or another of its threads sits in a call there: ``pend``, a checkpoint
thread's barrier on a group of its own, ``examples/bugs/async_ckpt_side_barrier.py``), of which
this rank is a member and has issued fewer than m. Then each waits for the other: a cycle. The
sides are the ranks waiting in G and those waiting in H (among the publications read); the
smaller side is named, or both when they are as large.

    >>> pub = lambda last, g, quiet=True: {"quiet": quiet, "last": last, "g": g}
    >>> side_g = {"1": {"n": 3, "r": [0, 1, 2, 3]}, "2": {"n": 2, "r": [0, 1, 2, 3]}}
    >>> side_h = {"1": {"n": 2, "r": [0, 1, 2, 3]}, "2": {"n": 3, "r": [0, 1, 2, 3]}}
    >>> pubs = {0: pub("1", side_g), 1: pub("1", side_g), 2: pub("1", side_g), 3: pub("2", side_h)}
    >>> v = cross_group_wait(3, pubs[3], pubs.get, lambda name: (0, 1, 2, 3))
    >>> v.deviants, v.agreeing, sorted((v.group, v.other_group))
    ([3], [0, 1, 2], ['1', '2'])
    >>> busy = {**pubs, **{r: pub("1", side_g, quiet=False) for r in (0, 1, 2)}}  # still issuing calls
    >>> cross_group_wait(3, pubs[3], busy.get, lambda name: (0, 1, 2, 3)) is None
    True
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

from hangdoc.runtime.detect_digest import Verdict, entry_at, partners

#: publications read at most to count the sides of a cross-group wait once one is found
READ_FOR_SIDES = 64
#: seconds between two looks while quiet, doubling from the first to the last (a real deadlock is
#: found within seconds; a long quiet phase, a checkpoint or an eval, costs a few looks)
FIRST_GAP, LAST_GAP = 1.0, 30.0
#: seconds the same cross-group wait must stand before it is reported (an async call may be what a
#: rank left pending in the other group while it computes, and a slow rank gets there after all)
PERSIST = 2.0


def count(pub: Dict[str, Any], group: str) -> int:
    """How many calls a publication says its rank issued in ``group``."""
    try:
        return int((pub.get("g") or {}).get(group, {}).get("n", 0))
    except (TypeError, ValueError, AttributeError):
        return 0


def _members(pub: Dict[str, Any], group: str, known: Sequence[int]) -> Sequence[int]:
    """A group's members: what this rank knows, else what the publication says."""
    if known:
        return known
    r = (pub.get("g") or {}).get(group, {}).get("r") or ()
    return [int(x) for x in r if isinstance(x, int)]


def cross_group_wait(me: int, mine: Dict[str, Any], pub_of: Callable[[int], Optional[Dict[str, Any]]],
                     ranks_of: Callable[[str], Sequence[int]]) -> Optional[Verdict]:
    """The cross-group wait this quiet rank is in (see the module), as a verdict; None if none."""
    g_name = mine.get("last")
    if not mine.get("quiet") or not isinstance(g_name, str):
        return None
    n = count(mine, g_name)
    g_ranks = list(_members(mine, g_name, ranks_of(g_name)))
    if not n or me not in g_ranks:
        return None
    for q in hypercube(me, g_ranks):
        other = pub_of(q)
        if not other or not other.get("quiet") or count(other, g_name) >= n:
            continue
        for h_name in waits_in(other):
            if h_name == g_name:
                continue
            m = count(other, h_name)
            if me not in _members(other, h_name, ranks_of(h_name)) or count(mine, h_name) >= m:
                continue
            return _verdict(me, mine, q, other, g_name, h_name, pub_of, ranks_of)
    return None


def waits_in(pub: Dict[str, Any]) -> List[str]:
    """The groups a quiet rank waits in: those where another of its threads sits in a call
    (``pend``: a checkpoint thread's barrier on a group of its own), then that of its latest call."""
    pend = pub.get("pend")
    out = [g for g in pend if isinstance(g, str)][:8] if isinstance(pend, list) else []
    last = pub.get("last")
    return out + ([last] if isinstance(last, str) and last not in out else [])


def hypercube(me: int, ranks: Sequence[int]) -> List[int]:
    """The members at index ``i ^ 1``, ``i ^ 2``, ``i ^ 4``, ... of this rank's index ``i``: log2(n)
    reads. However the members split in two sides, some member and one of these of its own are on
    different sides (walk from one side to the other clearing, then setting, one bit at a time: every
    step stays within the group), so some rank of either side finds the wait.

        >>> hypercube(0, list(range(8))), hypercube(5, list(range(6)))
        ([1, 2, 4], [4, 1])
    """
    if me not in ranks:
        return []
    i, n = list(ranks).index(me), len(ranks)
    out, bit = [], 1
    while bit < n:
        if i ^ bit < n:
            out.append(ranks[i ^ bit])
        bit <<= 1
    return out


def _verdict(me: int, mine: Dict[str, Any], q: int, other: Dict[str, Any], g_name: str, h_name: str,
             pub_of: Callable[[int], Optional[Dict[str, Any]]], ranks_of: Callable[[str], Sequence[int]]) -> Verdict:
    sides: Dict[str, List[int]] = {g_name: [me], h_name: [q]}
    pubs = {me: mine, q: other}
    union = sorted(set(_members(mine, g_name, ranks_of(g_name))) | set(_members(other, h_name, ranks_of(h_name))))
    for r in partners(me, union, extra=READ_FOR_SIDES):
        if r in pubs:
            continue
        p = pub_of(r)
        side = next((g for g in waits_in(p) if g in sides), None) if p and p.get("quiet") else None
        if side is not None:
            pubs[r] = p
            sides[side].append(r)
    a, b = sorted(sides[g_name]), sorted(sides[h_name])
    if len(a) == len(b):
        deviants, agreeing, dev_group, agree_group = sorted(a + b), [], h_name, g_name
    elif len(a) < len(b):
        deviants, agreeing, dev_group, agree_group = a, b, g_name, h_name
    else:
        deviants, agreeing, dev_group, agree_group = b, a, h_name, g_name
    dev_pub = pubs[(b if dev_group == h_name else a)[0]]
    agree_pub = pubs[(a if agree_group == g_name else b)[0]]

    def last_entry(pub: Dict[str, Any], group: str) -> Optional[List[Any]]:
        gp = (pub.get("g") or {}).get(group) or {}
        return entry_at(gp, count(pub, group) - 1)

    v = Verdict(agree_group, count(agree_pub, agree_group) - 1, True, deviants, agreeing,
                last_entry(dev_pub, dev_group), last_entry(agree_pub, agree_group), "groups")
    v.other_group = dev_group
    if not agreeing:  # as large: the summary names each side with its call
        v.sides = {g_name: a, h_name: b}
    v.text = summary(v)
    return v


def summary(v: Verdict) -> str:
    """``ranks 0-2 wait in all_reduce(...) at x.py:47 of group 1 while rank 3 waits in ... of group 2:
    the ranks entered the two groups in opposite orders; rank 3, the smaller side, is the odd one``."""
    from hangdoc.ranges import describe_ranks

    def call(e: Optional[List[Any]]) -> str:
        return f"{e[1]} at {e[2]}" if e else "its latest call"

    if v.agreeing:
        dev = f"{describe_ranks(v.deviants)} {'waits' if len(v.deviants) == 1 else 'wait'}"
        return (f"{describe_ranks(v.agreeing)} wait in {call(v.agreeing_entry)} of group {v.group} while {dev} in "
                f"{call(v.deviant_entry)} of group {v.other_group}, which the others have not issued: the ranks entered "
                f"the two groups in opposite orders; {describe_ranks(v.deviants)}, the smaller side, "
                f"{'is' if len(v.deviants) == 1 else 'are'} the odd one")
    sides = v.sides or {}
    a, b = sides.get(v.group) or [], sides.get(v.other_group or "") or []
    if not a or not b:
        return (f"{describe_ranks(v.deviants)} wait in two groups ({v.group}: {call(v.agreeing_entry)}; {v.other_group}: "
                f"{call(v.deviant_entry)}), each side for a call the other has not issued: the ranks entered the two "
                f"groups in opposite orders, half of them each way")
    return (f"{describe_ranks(a)} wait in {call(v.agreeing_entry)} of group {v.group} while {describe_ranks(b)} wait in "
            f"{call(v.deviant_entry)} of group {v.other_group}, each side for a call the other has not issued: the two "
            f"halves entered the groups in opposite orders")
