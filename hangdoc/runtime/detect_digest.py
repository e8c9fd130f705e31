"""What the divergence detector keeps and publishes, and how two ranks' publications compare.

Per process group, a rolling digest of the signatures (op, shapes, dtypes, root) of the collectives
a rank issued (:class:`Digests`, updated by the recorder's hot path), the JSON a rank publishes
(:func:`snapshot`: counts, digests, checkpoints, a window of per-collective detail), the first index
where two publications part (:func:`first_difference`), which side is the minority
(:func:`decide`), and whom a rank reads (:func:`partners`). Pure: no store, no thread; the daemon
that publishes and reads is :mod:`hangdoc.runtime.detect`.
"""

from __future__ import annotations

import collections
import hashlib
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

#: per-collective detail kept per group (a ring; a power of two), and the part of it published
#: every time (older stretches are published when a checker asks: see Node)
RING = 4096
WINDOW = 64
#: a checkpoint digest every CHECKPOINT collectives, the last CHECKPOINTS of them published: ranks
#: up to CHECKPOINT * CHECKPOINTS collectives apart can still be compared
CHECKPOINT = 64
CHECKPOINTS = RING // CHECKPOINT

#: a group's member list is published up to this size (larger groups: what the reader knows itself)
MAX_PUBLISHED_RANKS = 256
#: peers a quiet rank publishes its point-to-point counts with (a pipeline stage has two or four)
MAX_PEERS = 64
#: point-to-point ops that receive (the others send)
_RECEIVES = frozenset({"recv", "irecv"})

_MASK = (1 << 64) - 1
_PRIME = 0x100000001B3  # FNV-1a's: (d ^ h) * P is order-sensitive and cheap


def _dtype_name(dt: Any) -> str:
    return dt if isinstance(dt, str) else str(dt).replace("torch.", "")


#: ops whose recorded input shapes legitimately differ by rank (uneven splits; an object that is a
#: list of any length on each rank): digested without shapes
SHAPELESS = frozenset({"all_to_all", "all_to_all_single", "gather_object", "all_gather_object", "scatter_object_list"})


def sig_hash(sig: Tuple[Any, ...]) -> int:
    """A 64-bit hash of (op, shapes, dtypes, root) that is the same in every process (``hash()``
    of a string is not: it is salted per process)."""
    op, shapes, dtypes, root = sig
    if op in SHAPELESS:
        shapes = ()
    text = f"{op}|{[list(map(int, s)) for s in shapes]}|{[_dtype_name(d) for d in dtypes]}|{root}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def combine(d: int, h: int) -> int:
    return ((d ^ h) * _PRIME) & _MASK


def digest_of(sigs: Iterable[Tuple[Any, ...]]) -> int:
    """The rolling digest of a sequence of signatures (what the hot path computes call by call)."""
    d = 0
    for s in sigs:
        d = combine(d, sig_hash(s))
    return d


class _Group:
    __slots__ = ("name", "ranks", "n", "d", "ring", "cps", "seen", "scanned", "names")

    def __init__(self, name: str, ranks: Tuple[int, ...]):
        self.name = name
        self.ranks = ranks
        self.n = 0  # collectives issued in this group (p2p not counted)
        self.d = 0
        # ring[i % RING] = (i, digest after i, signature hash, recorder tuple)
        self.ring: List[Any] = [None] * RING
        self.cps: collections.deque = collections.deque(maxlen=CHECKPOINTS)
        # kept by the daemon, not the hot path: (signature hash, call site) -> first index seen,
        # the index scanned up to, and the descriptions of those pairs
        self.seen: Dict[Any, int] = {}
        self.scanned = 0
        self.names: Dict[Any, Tuple[str, str]] = {}


def _pair(e: tuple) -> Any:
    """(signature hash, call site) of a ring entry, cheap to hash (a code object's hash walks its
    bytecode)."""
    site = e[3][8]
    if type(site) is tuple:
        return (e[2], id(site[0]), site[1])
    return (e[2], site)


class Digests:
    """Per-group rolling digests and the hot-path hook that updates them."""

    def __init__(self) -> None:
        self.groups: Dict[str, _Group] = {}
        self.hashes: Dict[Tuple[Any, ...], int] = {}
        #: non-empty once an abort is due: the exception the hook raises
        self.abort: List[BaseException] = []
        #: [the group of the latest collective issued] (a list: the hook stores into it)
        self.last: List[Optional[str]] = [None]
        #: point-to-point calls: sends and receives issued per global peer rank, their count, and
        #: [the latest one's record when it is the latest call of all, else None]
        self.sent: Dict[int, int] = {}
        self.received: Dict[int, int] = {}
        self.p2p_n: List[int] = [0]
        self.last_p2p: List[Optional[tuple]] = [None]
        #: the latest RING point-to-point calls, (record, its number among this rank's calls in that
        #: direction with that peer) at [call count & (RING - 1)]: which message of the pair a call is
        #: (hangdoc.runtime.detect_queue reads it; NCCL pairs a pair's k-th send with its k-th receive)
        self.p2p_ring: List[Optional[Tuple[tuple, int]]] = [None] * RING
        #: [called (in the calling thread) after a collective whose signature this rank had never
        #: issued was recorded, or None] (see hangdoc.runtime.detect.Detector._early)
        self.on_new: List[Optional[Callable[[], None]]] = [None]
        self.hook = self._make_hook()
        self.hook_p2p = self._make_hook_p2p()

    def _learn(self, sig: Tuple[Any, ...]) -> int:
        if len(self.hashes) > 65536:  # dynamic shapes: keep the cache bounded
            self.hashes.clear()
        h = self.hashes[sig] = sig_hash(sig)
        return h

    def _new_group(self, key: str, rec: tuple) -> _Group:
        info = rec[2]
        g = self.groups[key] = _Group(key, tuple(info[1]) if info and info[1] else ())
        return g

    def _make_hook(self) -> Callable[..., None]:
        groups, hashes, learn, new_group, abort, last = (self.groups, self.hashes, self._learn, self._new_group,
                                                         self.abort, self.last)
        last_p2p, on_new = self.last_p2p, self.on_new
        rmask, cmask, prime, mask = RING - 1, CHECKPOINT - 1, _PRIME, _MASK

        def hook(key: str, op: str, shapes: tuple, dtypes: tuple, root: Any, rec: tuple) -> None:
            if abort:  # a new exception each time: re-raising one would grow its traceback
                raise type(abort[0])(*abort[0].args)
            g = groups.get(key)
            if g is None:
                g = new_group(key, rec)
            sig = (op, shapes, dtypes, root)
            h = hashes.get(sig)
            fresh = h is None
            if fresh:
                h = learn(sig)
            n = g.n
            d = ((g.d ^ h) * prime) & mask
            g.ring[n & rmask] = (n, d, h, rec)
            g.d = d
            g.n = n + 1
            last[0] = key
            last_p2p[0] = None
            if n & cmask == cmask:
                g.cps.append((n, d))
            if fresh and on_new[0] is not None:
                on_new[0]()

        return hook

    def _make_hook_p2p(self) -> Callable[..., None]:
        sent, received, count, last_p2p, ring = self.sent, self.received, self.p2p_n, self.last_p2p, self.p2p_ring
        rmask = RING - 1

        def hook_p2p(op: str, peer: Any, rec: tuple) -> None:
            if type(peer) is not int:
                return
            counts = received if op in _RECEIVES else sent
            k = counts.get(peer, 0)
            counts[peer] = k + 1
            n = count[0]
            ring[n & rmask] = (rec, k)
            count[0] = n + 1
            last_p2p[0] = rec

        return hook_p2p

    def total(self) -> int:
        """Calls issued so far (point-to-point ones too: a pipeline stage that only sends and
        receives is making progress)."""
        return sum(g.n for g in self.groups.values()) + self.p2p_n[0]


# -- what a rank publishes -------------------------------------------------------------------------
def _describe(rec: tuple, cache: Dict[int, Tuple[str, str]]) -> Tuple[str, str]:
    """(``broadcast([256] float32, src=0)``, ``train.py:32``) of a recorder tuple."""
    hit = cache.get(id(rec))
    if hit is not None and hit[2] is rec:
        return hit[0], hit[1]
    from hangdoc.analysis.sequence import site
    from hangdoc.runtime import recorder

    r = recorder.get() or recorder.Recorder(capacity=1)
    cr = r._materialise(rec)
    out = (cr.describe(), site(cr))
    if len(cache) > 4 * RING:
        cache.clear()
    cache[id(rec)] = (out[0], out[1], rec)
    return out


def _window(g: _Group, lo: int, hi: int, describe: Callable[[tuple], Tuple[str, str]],
            first_seen: Dict[Any, int]) -> Optional[Dict[str, Any]]:
    """Per-collective detail of indexes [lo, hi) of a group, as far as the ring still holds them:
    the digest before ``lo`` and, per index, a reference into a table of distinct signatures
    (hash, description, call site, first index that pair was seen at: the history tie-break)."""
    ring, rmask = g.ring, RING - 1
    entries = []
    for i in range(max(lo, g.n - RING + 1), hi):
        e = ring[i & rmask]
        if e is None or e[0] != i:
            entries = []  # overwritten while we read: keep what follows only
            continue
        entries.append(e)
    if not entries:
        return None
    start = entries[0][0]
    if start == 0:
        base: Optional[int] = 0
    else:
        prev = ring[(start - 1) & rmask]
        base = prev[1] if prev is not None and prev[0] == start - 1 else dict(g.cps).get(start - 1)
    if base is None:
        entries = entries[1:]
        if not entries:
            return None
        start, base = entries[0][0], ring[(entries[0][0] - 1) & rmask][1]
    table: Dict[Tuple[int, Any], List[Any]] = {}
    sig: List[int] = []
    for e in entries:
        k = _pair(e)
        t = table.get(k)
        if t is None:
            named = g.names.get(k)
            if named is None:
                if len(g.names) > 4096:
                    g.names.clear()
                named = g.names[k] = describe(e[3])
            t = table[k] = [format(e[2], "x"), named[0], named[1], first_seen.get(k, e[0]), len(table)]
        sig.append(t[4])
    return {"start": start, "base": format(base, "x"), "sig": sig,
            "tab": [v[:4] for v in sorted(table.values(), key=lambda v: v[4])]}


def snapshot(digests: Digests, rank: int, describe: Callable[[tuple], Tuple[str, str]], quiet: bool = False,
             focus: Optional[Sequence[Any]] = None) -> Dict[str, Any]:
    """The JSON-able state one rank publishes: per group its count, digest, checkpoints and the
    detail of its last WINDOW collectives, plus that of ``focus`` = (group, lo, hi) when a checker
    asked for an older stretch (see :class:`Node`)."""
    out: Dict[str, Any] = {"rank": rank, "t": round(time.time(), 3), "quiet": quiet, "g": {}, "last": digests.last[0]}
    if quiet and digests.p2p_n[0]:
        out["p"] = _p2p_state(digests, describe)
    for name, g in list(digests.groups.items()):
        n = g.n
        first_seen = g.seen
        if len(first_seen) > 65536:  # dynamic shapes: keep it bounded
            first_seen.clear()
        ring = g.ring
        for i in range(max(g.scanned, n - RING + 1), n):  # only what came since the last look
            e = ring[i & (RING - 1)]
            if e is not None and e[0] == i:
                first_seen.setdefault(_pair(e), i)
        g.scanned = n
        wins = []
        if focus and focus[0] == name:
            lo, hi = int(focus[1]), min(int(focus[2]), int(focus[1]) + 2 * CHECKPOINT, n)
            if lo < max(0, n - WINDOW):
                w = _window(g, lo, hi, describe, first_seen)
                if w:
                    wins.append(w)
        w = _window(g, max(0, n - WINDOW), n, describe, first_seen)
        if w:
            wins.append(w)
        out["g"][name] = {"n": n, "d": format(g.d, "x"), "w": wins,
                          "cp": [[i, format(d, "x")] for i, d in list(g.cps)]}
        if quiet and 0 < len(g.ranks) <= MAX_PUBLISHED_RANKS:
            # who must issue its calls: only the cross-group check reads it, and only in a quiet
            # rank's publication (the once-a-second ones while the job runs stay as small as before)
            out["g"][name]["r"] = list(g.ranks)
    return out


def _p2p_state(digests: Digests, describe: Callable[[tuple], Tuple[str, str]]) -> Dict[str, Any]:
    """A quiet rank's point-to-point counts per peer (``s`` sent, ``r`` received; at most
    MAX_PEERS each, the largest) and ``w``, the call it sits in when its latest call of all was a
    point-to-point one: [op, peer, call, site] (read by :mod:`hangdoc.runtime.detect_p2p`)."""
    def top(counts: Dict[int, int]) -> Dict[str, int]:
        items = sorted(list(counts.items()), key=lambda kv: -kv[1])[:MAX_PEERS]
        return {str(k): v for k, v in items}

    out: Dict[str, Any] = {"s": top(digests.sent), "r": top(digests.received), "w": None}
    rec = digests.last_p2p[0]
    if rec is not None:
        call, site = describe(rec)
        out["w"] = [rec[1], rec[6], call, site]
    return out


def known_digests(pub: Dict[str, Any]) -> Dict[int, int]:
    """Index -> digest after that collective, for every index a group's publication pins down."""
    known = {int(i): int(d, 16) for i, d in pub.get("cp") or ()}
    n = int(pub.get("n", 0))
    if n:
        known[n - 1] = int(pub["d"], 16)
    for w in pub.get("w") or ():
        tab = w.get("tab") or []
        d = int(w["base"], 16)
        start = int(w["start"])
        for j, k in enumerate(w.get("sig") or ()):
            d = combine(d, int(tab[k][0], 16))
            known[start + j] = d
    return known


def entry_at(pub: Dict[str, Any], i: int) -> Optional[List[Any]]:
    """[hash, description, call site, first index seen] of collective ``i``, when published."""
    for w in pub.get("w") or ():
        start, sig = int(w.get("start", 0)), w.get("sig") or []
        if start <= i < start + len(sig):
            tab = w.get("tab") or []
            k = sig[i - start]
            if 0 <= k < len(tab):
                return tab[k]
    return None


def _key(entry: List[Any]) -> Tuple[Any, Any]:
    """What makes two published collectives the same call: signature hash and call site."""
    return (entry[0], entry[2])


def _successions(pub: Dict[str, Any], upto: int) -> set:
    """(call, next call) pairs a group's publication shows before index ``upto``: the loop's pattern."""
    pairs = set()
    for w in pub.get("w") or ():
        start, sig, tab = int(w.get("start", 0)), w.get("sig") or [], w.get("tab") or []
        for j in range(1, min(len(sig), upto - start)):
            a, b = sig[j - 1], sig[j]
            if 0 <= a < len(tab) and 0 <= b < len(tab):
                pairs.add((_key(tab[a]), _key(tab[b])))
    return pairs


def first_difference(a: Dict[str, Any], b: Dict[str, Any]) -> Optional[Tuple[int, bool, int]]:
    """(index, exact, last agreeing index) of the first collective where two ranks' publications
    of one group part; None while they agree on everything both have issued. ``exact`` is False
    when the index is only bounded: the divergence lies after the last agreeing index."""
    ka, kb = known_digests(a), known_digests(b)
    common = sorted(set(ka) & set(kb))
    first_bad = next((i for i in common if ka[i] != kb[i]), None)
    if first_bad is None:
        return None
    agree = [i for i in common if i < first_bad]
    last_good = agree[-1] if agree else -1
    return first_bad, last_good == first_bad - 1, last_good


#: the kinds of finding (docs/findings) a detector verdict may have
KINDS = ("collective-mismatch", "p2p-stall", "p2p-cycle", "rank-failed", "unresponsive-process", "dataloader-stall")


class Verdict:
    """One divergence: who, where, and both sides' collectives."""

    def __init__(self, group: str, index: int, exact: bool, deviants: List[int], agreeing: List[int],
                 deviant_entry: Optional[List[Any]], agreeing_entry: Optional[List[Any]], basis: str) -> None:
        self.group, self.index, self.exact = group, index, exact
        self.deviants, self.agreeing = deviants, agreeing
        self.deviant_entry, self.agreeing_entry = deviant_entry, agreeing_entry
        self.basis = basis
        #: with basis "groups": the group the deviants wait in (``group`` is the agreeing side's)
        self.other_group: Optional[str] = None
        #: with basis "groups" and two sides as large: group -> the ranks waiting in it
        self.sides: Optional[Dict[str, List[int]]] = None
        #: the summary, where the rule that made the verdict wrote its own (hangdoc.runtime.detect_groups)
        self.text: Optional[str] = None
        #: the finding's kind (one of KINDS): a point-to-point rule's are p2p-stall and p2p-cycle, a
        #: rank that raised or died is rank-failed, a stopped one unresponsive-process, one waiting
        #: for a DataLoader worker blocked on a lock held at fork dataloader-stall
        self.kind = "collective-mismatch"
        #: with kind p2p-stall: the rank whose message the deviant should receive
        self.expected_peer: Optional[int] = None
        #: the last index both sides were seen to agree on (for a bounded ``index``)
        self.last_good = index - 1
        self.time = time.time()
        self.reporter: Optional[int] = None
        #: with basis "stall": seconds after the verdict when the stalled rank went on (slow, not hung)
        self.resumed_after: Optional[float] = None

    @property
    def summary(self) -> str:
        from hangdoc.ranges import describe_ranks

        def side(e: Optional[List[Any]]) -> str:
            return f"{e[1]} at {e[2]}" if e else "(not in its recent window)"

        if self.text:
            return self.text
        where = f"collective #{self.index}" if self.exact else f"collective #{self.index} or earlier"
        s = (f"{describe_ranks(self.deviants)} diverged from {describe_ranks(self.agreeing)} in {self.group} at "
             f"{where}: {side(self.deviant_entry)} vs {side(self.agreeing_entry)}")
        if self.basis == "skipped-creation" and self.agreeing_entry:
            return (f"{describe_ranks(self.deviants)} skipped {side(self.agreeing_entry)}, which "
                    f"{describe_ranks(self.agreeing)} called (group creation #{self.index}); they called "
                    f"{side(self.deviant_entry)} instead. Every rank must call new_group for every group, "
                    f"members or not, in the same order")
        if self.basis == "tie":
            s += " (two sides, no majority: the higher rank is named)"
        elif self.basis == "pattern":
            s += f" ({describe_ranks(self.deviants)} broke what the loop issued after the previous call)"
        return s

    def to_json(self) -> Dict[str, Any]:
        return {"hangdoc": "divergence", "version": 1, "kind": self.kind, "group": self.group, "index": self.index,
                "exact": self.exact,
                "deviants": self.deviants, "agreeing": self.agreeing, "deviant": self.deviant_entry,
                "expected": self.agreeing_entry, "basis": self.basis, "time": self.time, "reporter": self.reporter,
                "summary": self.summary, **({"other_group": self.other_group} if self.other_group else {}),
                **({"sides": self.sides} if self.sides else {}),
                **({"expected_peer": self.expected_peer} if self.expected_peer is not None else {}),
                **({"resumed_after": self.resumed_after} if self.resumed_after is not None else {})}

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "Verdict":
        v = cls(d["group"], int(d["index"]), bool(d.get("exact", True)), list(d["deviants"]), list(d["agreeing"]),
                d.get("deviant"), d.get("expected"), d.get("basis", "majority"))
        v.time = float(d.get("time") or time.time())
        v.reporter = d.get("reporter")
        v.other_group = d.get("other_group")
        if v.basis in ("groups", "p2p", "raised", "process", "pattern-break", "lock", "fork", "stall") and isinstance(d.get("summary"), str):
            v.text = d["summary"][:2000]
        if d.get("kind") in KINDS:
            v.kind = d["kind"]
        if type(d.get("expected_peer")) is int:
            v.expected_peer = d["expected_peer"]
        sides = d.get("sides")
        if isinstance(sides, dict):
            v.sides = {str(k): [int(r) for r in rs if isinstance(r, int)] for k, rs in sides.items() if isinstance(rs, list)}
        return v


def decide(group: str, pubs: Dict[int, Dict[str, Any]], index: int, exact: bool) -> Optional[Verdict]:
    """Who diverged at ``index`` among the ranks whose group publications are in ``pubs``.

    The larger side wins; on a tie, the side that continues what the loop issued after the previous
    (agreed) call wins (a skipped broadcast: the other side issues all_reduce twice in a row), then
    the side whose call site issued that same signature before (its history), else the lower rank's
    side (as in :mod:`hangdoc.analysis.sequence`).
    """
    sides: Dict[int, List[int]] = {}
    for r, pub in sorted(pubs.items()):
        d = known_digests(pub).get(index)
        if d is not None:
            sides.setdefault(d, []).append(r)
    if len(sides) < 2:
        return None
    ordered = sorted(sides.items(), key=lambda kv: (-len(kv[1]), min(kv[1])))
    top = len(ordered[0][1])
    tied = [kv for kv in ordered if len(kv[1]) == top]
    basis = "majority"
    winner = ordered[0]
    if len(tied) > 1:
        def familiar(kv: Tuple[int, List[int]]) -> bool:
            e = entry_at(pubs[kv[1][0]], index)
            return e is not None and int(e[3]) < index

        def continues(kv: Tuple[int, List[int]]) -> bool:
            # the loop went on this way before: after the (agreed) previous call came this one
            pub = pubs[kv[1][0]]
            prev, here = entry_at(pub, index - 1), entry_at(pub, index)
            return prev is not None and here is not None and (_key(prev), _key(here)) in _successions(pub, index)

        cont = [kv for kv in tied if continues(kv)]
        fam = [kv for kv in tied if familiar(kv)]
        made = _made_only(group, tied, pubs, index)
        if made is not None:
            winner, basis = made, "skipped-creation"
        elif len(cont) == 1:
            winner, basis = cont[0], "pattern"
        elif len(fam) == 1:
            winner, basis = fam[0], "history"
        else:
            winner, basis = min(tied, key=lambda kv: min(kv[1])), "tie"
    agreeing = sorted(winner[1])
    deviants = sorted(r for d, rs in sides.items() if d != winner[0] for r in rs)
    return Verdict(group, index, exact, deviants, agreeing, entry_at(pubs[deviants[0]], index),
                   entry_at(pubs[agreeing[0]], index), basis)


def _made_only(group: str, tied: List[Tuple[int, List[int]]], pubs: Dict[int, Dict[str, Any]],
               index: int) -> Optional[Tuple[int, List[int]]]:
    """Of tied sides in the ``new_group`` sequence (:data:`hangdoc.runtime.recorder.CREATION_GROUP`),
    the one whose call at ``index`` no other side makes then or later: every rank must call new_group
    for every group, members or not, in one order, so the sides without it skipped it
    (``if rank in (0, 1): new_group([0, 1])``), whatever the count (as
    :func:`hangdoc.analysis.sequence._skipped_creation` judges records)."""
    from hangdoc.runtime.recorder import CREATION_GROUP

    if group != CREATION_GROUP:
        return None

    def later(pub: Dict[str, Any]) -> set:
        return {e[0] for e in (entry_at(pub, j) for j in range(index, int(pub.get("n", 0)))) if e}

    here = {kv[0]: entry_at(pubs[kv[1][0]], index) for kv in tied}
    rest = {kv[0]: later(pubs[kv[1][0]]) for kv in tied}
    found = [kv for kv in tied if here[kv[0]] is not None
             and not any(here[kv[0]][0] in rest[d] for d in rest if d != kv[0])]
    return found[0] if len(found) == 1 else None


def rotating(me: int, ranks: Sequence[int], turn: int) -> List[int]:
    """The rank of a group that ``me`` reads at its ``turn``-th look: index ^ 1, ^ 2, ^ 4, ... in
    turn. The pair partner alone never compared two pairs that diverged together (ranks 0, 1
    against 2, 3: a branch on ``rank < 2``); the indexes below n with the xor edges form a connected
    graph (clearing the top bit leads to 0), so two differing sides share an edge and a reader finds
    it within log2(n) looks, still one read per look.

        >>> [rotating(5, list(range(8)), t) for t in range(4)], rotating(4, list(range(5)), 0)
        ([[4], [7], [1], [4]], [3])
    """
    n = len(ranks)
    if me not in ranks or n < 2:
        return []
    i = ranks.index(me)
    k = i ^ (1 << (turn % max(1, (n - 1).bit_length())))
    if k >= n:
        k = i ^ 1 if (i ^ 1) < n else i - 1
    return [ranks[k]]


def partners(me: int, ranks: Sequence[int], extra: int = 0) -> List[int]:
    """The ranks of a group that ``me`` reads: its pair partner (index ^ 1), and with ``extra``
    more, index ^ 2, ^ 4, ... and the partner's: O(1) per period, O(log n) on a disagreement.

        >>> partners(5, list(range(8))), partners(5, list(range(8)), extra=3), partners(1, [0, 1, 2])
        ([4], [4, 7, 6, 1], [0, 2])
    """
    n = len(ranks)
    if me not in ranks or n < 2:
        return []
    i = ranks.index(me)
    j = i ^ 1 if (i ^ 1) < n else i - 1
    out = [ranks[j]]
    if n % 2 and i == n - 2:
        out.append(ranks[n - 1])  # the odd one out has no pair of its own: its reader is here
    bit = 2
    while extra and bit < 2 * n:
        for k in (i ^ bit, j ^ bit):
            if 0 <= k < n and ranks[k] != me and ranks[k] not in out and extra:
                out.append(ranks[k])
                extra -= 1
        bit <<= 1
    for k in sorted(range(n), key=lambda k: abs(k - i)):  # small or odd groups: the nearest others
        if not extra:
            break
        if ranks[k] != me and ranks[k] not in out:
            out.append(ranks[k])
            extra -= 1
    return out
