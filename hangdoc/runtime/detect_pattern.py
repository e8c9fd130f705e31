"""A wait cycle through collectives and point-to-point calls, and the rank that broke its loop.

A skipped collective in a pipeline (``examples/bugs/tp_pp_skip.py``: tensor-parallel groups {0, 1},
{2, 3}, pipeline pairs 0-2, 1-3; rank 3 skips its TP all_reduce at step 3) leaves no digest
difference (rank 3 is only *behind* in its group) and no receive cycle (the waits run through
collectives and receives alike): rank 2 waits in the all_reduce for rank 3, rank 3 in a receive
from rank 1, rank 1 in its TP all_reduce for rank 0, rank 0 in a receive from rank 2.

Each quiet rank publishes (``brk``) the latest place among its last few calls where its own
sequence of calls (collectives, sends and receives, by call site) broke what its loop always did
there: after the receive at line 46 came the all_reduce at line 48 every time before, this time the
send at line 49. The check follows who waits for whom among quiet ranks:

* a rank whose latest call is collective #k of a group waits for the members that have not issued
  #k (self-checking: had they issued it, the call could have completed);
* a rank in a receive from (a send to) a peer waits for that peer when the peer, quiet too, has
  sent it (received from it) fewer messages than this rank has counted.

On a cycle of such waits, the ranks of the cycle that broke their loop are named
(``collective-mismatch``, basis ``pattern-break``); a cycle where none or every rank broke its
loop is left alone (the other rules, or the watchdog).

    >>> loop = [("recv", 46), ("all_reduce", 48), ("send", 49)] * 3
    >>> pattern_break(loop + [("recv", 46), ("send", 49), ("recv", 46)])  # the send, where the all_reduce came
    (10, 1)
    >>> pattern_break(loop + [("recv", 46), ("all_reduce", 48)]) is None
    True
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from hangdoc.runtime.detect_digest import Verdict, partners
from hangdoc.runtime.detect_groups import count
from hangdoc.runtime.detect_p2p import RECEIVES

#: calls of a rank's own sequence looked at for its loop, and the last transitions a break may be in
HISTORY = 2048
RECENT = 4
#: a call is a loop's when it was followed by the same call at least this often before
SEEN = 2
#: publications read at most to follow the waits
READ = 64


def pattern_break(keys: Sequence[Any], recent: int = RECENT) -> Optional[Tuple[int, int]]:
    """(index in ``keys`` of the call that broke the loop, index of the call that always followed
    its predecessor before) for the latest break among the last ``recent`` transitions; None if none."""
    n = len(keys)
    first_at: Dict[Tuple[Any, Any], int] = {}
    for i in range(1, n):
        first_at.setdefault((keys[i - 1], keys[i]), i)
    found = None
    for i in range(max(1, n - recent), n):
        a, b = keys[i - 1], keys[i]
        if first_at.get((a, b)) != i:
            continue  # this succession happened before: not a break
        before: Dict[Any, int] = {}
        for j in range(1, i):
            if keys[j - 1] == a:
                before[keys[j]] = before.get(keys[j], 0) + 1
        if len(before) == 1 and next(iter(before.values())) >= SEEN:
            usual = next(iter(before))
            found = (i, next(j for j in range(1, i) if keys[j - 1] == a and keys[j] == usual))
    return found


def _key(rec: tuple) -> Any:
    """(op, call site) of a recorder tuple, cheap to hash (a code object's hash walks its bytecode)."""
    site = rec[8]
    if type(site) is tuple:
        return (rec[1], id(site[0]), site[1])
    try:
        hash(site)
    except TypeError:
        return (rec[1], id(site))
    return (rec[1], site)


def own_break(records: Sequence[tuple], describe: Callable[[tuple], Tuple[str, str]],
              recent: int = RECENT) -> Optional[Dict[str, Any]]:
    """What a quiet rank publishes as ``brk`` from the tail of its recorder's records: the call that
    broke its loop, the call before it and the one that always came there ([call, site] each), among
    its last ``recent`` calls (``qbrk``, further back: hangdoc.runtime.detect_queue)."""
    recs = [r for r in records[-HISTORY:] if r[8] is not None]
    hit = pattern_break([_key(r) for r in recs], recent)
    if hit is None:
        return None
    i, usual = hit
    return {"at": list(describe(recs[i])), "after": list(describe(recs[i - 1])), "usual": list(describe(recs[usual])),
            "ago": len(recs) - 1 - i}


def _waits_for(r: int, pub: Dict[str, Any], pubs: Dict[int, Dict[str, Any]],
               ranks_of: Callable[[str], Sequence[int]]) -> List[int]:
    """The quiet ranks read that quiet rank ``r`` waits for (see the module)."""
    p = pub.get("p") or {}
    w = p.get("w")
    if isinstance(w, list) and len(w) >= 2 and type(w[1]) is int:
        peer = w[1]
        other = pubs.get(peer)
        if other is None:
            return []
        mine_key, theirs_key = ("r", "s") if w[0] in RECEIVES else ("s", "r")
        try:
            mine_n = int((p.get(mine_key) or {}).get(str(peer), 0))
            theirs_n = int(((other.get("p") or {}).get(theirs_key) or {}).get(str(r), 0))
        except (TypeError, ValueError, AttributeError):
            return []
        return [peer] if theirs_n < mine_n else []
    g = pub.get("last")
    if not isinstance(g, str):
        return []
    n = count(pub, g)
    members = ranks_of(g) or [int(x) for x in ((pub.get("g") or {}).get(g, {}).get("r") or ()) if type(x) is int]
    return [q for q in members if q != r and q in pubs and count(pubs[q], g) < n]


def _cycle(start: int, edges: Dict[int, List[int]]) -> Optional[List[int]]:
    """A cycle of ``edges`` reachable from ``start`` (depth first, bounded by the ranks read)."""
    path: List[int] = []
    on_path: Dict[int, int] = {}
    done: set = set()

    def walk(r: int) -> Optional[List[int]]:
        if r in on_path:
            return path[on_path[r]:]
        if r in done:
            return None
        on_path[r] = len(path)
        path.append(r)
        for q in edges.get(r, ()):
            c = walk(q)
            if c is not None:
                return c
        path.pop()
        del on_path[r]
        done.add(r)
        return None

    return walk(start)


def broken_loop_in_wait(me: int, mine: Dict[str, Any], pub_of: Callable[[int], Optional[Dict[str, Any]]],
                        ranks: Sequence[int], ranks_of: Callable[[str], Sequence[int]]) -> Optional[Verdict]:
    """The wait cycle this quiet rank is on and the ranks of it that broke their loops, as a verdict."""
    if not mine.get("quiet"):
        return None
    pubs: Dict[int, Dict[str, Any]] = {me: mine}
    for r in partners(me, list(ranks), extra=READ):
        p = pub_of(r)
        if p and p.get("quiet"):
            pubs[r] = p
    edges = {r: _waits_for(r, p, pubs, ranks_of) for r, p in pubs.items()}
    cycle = _cycle(me, edges)
    if not cycle or len(cycle) < 2:
        return None
    broke = sorted(r for r in cycle if isinstance(pubs[r].get("brk"), dict))
    if not broke or len(broke) == len(cycle):
        return None
    brk = pubs[broke[0]]["brk"]
    try:
        at, after, usual = ([str(x) for x in brk[k][:2]] for k in ("at", "after", "usual"))
    except (KeyError, TypeError, IndexError):
        return None
    v = Verdict("default_pg", 0, True, broke, sorted(r for r in cycle if r not in broke), [None] + at + [None],
                [None] + usual + [None], "pattern-break")
    from hangdoc.ranges import describe_ranks

    who = describe_ranks(broke)
    v.text = (f"{who} broke {'its loop' if len(broke) == 1 else 'their loops'}: after {after[0]} at {after[1]} came "
              f"{at[0]} at {at[1]} where every earlier iteration issued {usual[0]} at {usual[1]} (a skipped call); "
              f"the wait cycle through {describe_ranks(sorted(cycle))} that follows is its consequence: "
              + " \u2192 ".join(f"rank {r}" for r in cycle + cycle[:1]))
    return v
