"""Point-to-point waits that cannot end, seen in the detector's publications while the job runs.

A quiet rank publishes, per peer, how many sends and receives it has issued, and the receive it sits
in when that was its latest call (``p`` in :func:`hangdoc.runtime.detect_digest.snapshot`). Counts
are exact, so a receiver whose count from its peer is past the sends that peer issued to it waits
for a message that has not been sent. When that peer is quiet too, the wait is followed from
receiver to sender:

* it comes back to a rank already on the way: a **receive cycle** (``p2p-cycle``), every rank of it
  waiting for the next, none sending (``examples/bugs/p2p_cycle.py``);
* and some rank has sent a rank on the way more than that rank received from it, while that rank
  waits for another peer: that rank **receives from the wrong peer** (``p2p-stall``): the
  message meant for it is there, from the rank it should have named
  (``examples/bugs/wrong_peer.py``: rank 1 receives from rank 3, rank 0's send to it is unmatched).

A wait that leads nowhere of the two (a peer busy elsewhere, a skipped send) is left to the
watchdog: it is not named here.

    >>> pub = lambda s, r, w: {"quiet": True, "p": {"s": s, "r": r, "w": w}}
    >>> ring = {r: pub({}, {str((r - 1) % 4): 1}, ["recv", (r - 1) % 4, "recv([16] float32)", "x.py:9"])
    ...         for r in range(4)}
    >>> v = p2p_wait(0, ring[0], ring.get, range(4))
    >>> v.kind, v.deviants
    ('p2p-cycle', [0, 1, 2, 3])
    >>> ring[0]["p"]["s"] = {"1": 1}  # rank 0 sent to rank 1, which waits for rank 3 instead
    >>> ring[1]["p"]["w"][1], ring[1]["p"]["r"] = 3, {"3": 1}
    >>> ring[3]["p"]["w"][1], ring[3]["p"]["r"] = 2, {"2": 1}
    >>> ring[2]["p"]["w"][1], ring[2]["p"]["r"] = 1, {"1": 1}
    >>> v = p2p_wait(1, ring[1], ring.get, range(4))
    >>> v.kind, v.deviants, v.expected_peer
    ('p2p-stall', [1], 0)
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional

from hangdoc.runtime.detect_digest import Verdict, partners

#: ranks followed from receiver to sender at most
MAX_CHAIN = 64
#: publications read at most for a send that no one received
READ_FOR_UNMATCHED = 64
RECEIVES = ("recv", "irecv")


def _waiting(pub: Optional[Dict[str, Any]]) -> Optional[List[Any]]:
    """[op, peer, call, site] of the receive a quiet rank sits in; None if it sits in none."""
    if not pub or not pub.get("quiet"):
        return None
    w = (pub.get("p") or {}).get("w")
    if not isinstance(w, list) or len(w) < 4 or w[0] not in RECEIVES or type(w[1]) is not int:
        return None
    return w


def _count(pub: Optional[Dict[str, Any]], which: str, peer: int) -> int:
    try:
        return int(((pub or {}).get("p") or {}).get(which, {}).get(str(peer), 0))
    except (TypeError, ValueError, AttributeError):
        return 0


def _stuck(receiver: int, rpub: Dict[str, Any], sender: int, spub: Optional[Dict[str, Any]]) -> bool:
    """Whether ``receiver`` waits for a message ``sender`` has not sent, ``sender`` being quiet too."""
    return bool(spub and spub.get("quiet")) and _count(rpub, "r", sender) > _count(spub, "s", receiver)


def p2p_wait(me: int, mine: Dict[str, Any], pub_of: Callable[[int], Optional[Dict[str, Any]]],
             world: Iterable[int]) -> Optional[Verdict]:
    """The receive cycle or wrong peer this quiet rank's receive is part of (see the module), as a
    verdict; None if there is none to name."""
    first = _waiting(mine)
    if first is None:
        return None
    pubs: Dict[int, Dict[str, Any]] = {me: mine}

    def get(r: int) -> Optional[Dict[str, Any]]:
        if r not in pubs:
            p = pub_of(r)
            if p is None:
                return None
            pubs[r] = p
        return pubs[r]

    chain, cycle = [me], None
    cur = me
    for _ in range(MAX_CHAIN):
        w = _waiting(pubs[cur])
        if w is None:
            break
        peer = w[1]
        if not _stuck(cur, pubs[cur], peer, get(peer)):
            if cur == me:
                return None  # the message is there or may still come
            break
        if peer in chain:
            cycle = chain[chain.index(peer):]
            break
        chain.append(peer)
        cur = peer
    ranks = [r for r in world if isinstance(r, int)]
    for s in list(dict.fromkeys(partners(me, ranks, extra=READ_FOR_UNMATCHED) + chain)):
        ps = get(s)
        if not ps:
            continue
        for x in chain:
            wx = _waiting(pubs.get(x))
            if x == s or wx is None or wx[1] == s:
                continue
            if _count(ps, "s", x) > _count(pubs[x], "r", s):
                return _wrong_peer(x, wx, s, pubs)
    if cycle is not None:
        return _cycle(cycle, pubs)
    return None


def _wrong_peer(x: int, wx: List[Any], sender: int, pubs: Dict[int, Dict[str, Any]]) -> Verdict:
    from hangdoc.ranges import describe_ranks

    peer = wx[1]
    pw = _waiting(pubs.get(peer))
    there = f"it waits to receive from rank {pw[1]} itself" if pw else "it sent none"
    v = Verdict("p2p", _count(pubs[x], "r", peer) - 1, True, [x], [], wx[:4], None, "p2p")
    v.kind = "p2p-stall"
    v.expected_peer = sender
    sent, got = _count(pubs.get(sender), "s", x), _count(pubs[x], "r", sender)
    v.text = (f"{describe_ranks([x])} waits in {wx[2]} at {wx[3]} for a message from rank {peer}, which has not sent "
              f"it one ({there}), while a send of rank {sender} to rank {x} is unmatched ({sent} sent, {got} received): "
              f"rank {x} receives from the wrong peer; its message is from rank {sender}")
    return v


def _cycle(cycle: List[int], pubs: Dict[int, Dict[str, Any]]) -> Verdict:
    from hangdoc.ranges import describe_ranks

    start = min(cycle)
    i = cycle.index(start)
    ring = cycle[i:] + cycle[:i]
    w = _waiting(pubs[start]) or [None, None, "recv", "?"]
    v = Verdict("p2p", _count(pubs[start], "r", w[1]) - 1 if w[1] is not None else 0, True, sorted(cycle), [],
                w[:4], None, "p2p")
    v.kind = "p2p-cycle"
    arrows = " <- ".join(str(r) for r in ring + [ring[0]])
    v.text = (f"{describe_ranks(sorted(cycle))} each wait to receive from the next ({arrows}) and none sends: a receive "
              f"cycle (rank {start} in {w[2]} at {w[3]}); one of them must send before it receives")
    return v
