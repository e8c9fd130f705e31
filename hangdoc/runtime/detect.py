"""Catch a diverged collective while the job still runs: rolling signatures compared through the store.

Each rank keeps, per process group, a rolling digest of the signatures (op, shapes, dtypes, root)
of the collectives it issued in that group, updated by the recorder's hot path (one dict lookup,
one multiply, one list store). A daemon thread publishes the digests, with a short window of
per-collective detail, to the job's own torch.distributed store at most once a second (at once
when the rank stops issuing collectives: blocked, or about to be) and compares them with one
partner per group. At the first collective index where two ranks' digests part, it gathers a few
more opinions, decides which side is the minority (with two ranks: the side whose call site never
issued that signature before, else the higher rank, as :mod:`hangdoc.analysis.sequence` does) and
reports, once per job:

    rank 1 diverged from rank 0 in default_pg at collective #8: all_reduce([256] float32) at
    train.py:33 vs broadcast([256] float32, src=0) at train.py:32

Policies: ``warn`` (that line on stderr with the ``[host:rank]`` prefix), ``dump`` (also every
rank's stacks and records, with the watchdog's report), ``abort`` (every rank raises
:class:`DivergenceError` in its main thread at its next collective). Point-to-point ops are not
digested (a send on one rank is a recv on the other by design). Nothing here issues a collective
or a CUDA synchronisation; store operations are bounded (:mod:`hangdoc.runtime.exchange`).

    >>> d = digest_of([("all_reduce", ((8,),), ("float32",), None)] * 3)
    >>> d == digest_of([("all_reduce", ((8,),), ("float32",), None)] * 3)
    True
    >>> d == digest_of([("all_reduce", ((8,),), ("float32",), None)] * 2 + [("broadcast", ((8,),), ("float32",), 0)])
    False

In a job: ``hangdoc.wrap(main, detect="abort")`` or ``python -m hangdoc --detect train.py``.
See docs/detect.md.
"""

from __future__ import annotations

import atexit
import collections
import hashlib
import json
import os
import threading
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

__all__ = ["start", "stop", "get", "DivergenceError", "Detector", "Verdict", "POLICIES", "digest_of", "snapshot",
           "first_difference", "decide"]

POLICIES = ("warn", "dump", "abort")

#: per-collective detail kept per group (a ring; a power of two), and the part of it published
#: every time (older stretches are published when a checker asks: see Node)
RING = 4096
WINDOW = 64
#: a checkpoint digest every CHECKPOINT collectives, the last CHECKPOINTS of them published: ranks
#: up to CHECKPOINT * CHECKPOINTS collectives apart can still be compared
CHECKPOINT = 64
CHECKPOINTS = RING // CHECKPOINT
#: at most one publication per PERIOD seconds, plus one at once when the rank goes quiet for QUIET
PERIOD = 1.0
QUIET = 0.5
#: the daemon's wake-up interval; partners are read every READ seconds (every TICK while quiet)
TICK = 0.25
READ = 0.5
#: more ranks read to break a two-rank disagreement (only when one is found), and how long to
#: wait for a third opinion in a group of three or more before deciding on two
OPINIONS = 3
UNDECIDED_WAIT = 1.5
#: how long a checker waits for the older detail it asked for before reporting a bounded index
FOCUS_WAIT = 3.0
#: the most a process's exit waits for its last publication
FINAL_WAIT = 2.0

_MASK = (1 << 64) - 1
_PRIME = 0x100000001B3  # FNV-1a's: (d ^ h) * P is order-sensitive and cheap
PREFIX = "hangdoc/detect/"
STATE_KEY = PREFIX + "state"
CLAIM_KEY = PREFIX + "claim"


class DivergenceError(RuntimeError):
    """Raised in the main thread at the next collective once a divergence was found (policy ``abort``)."""


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
        self.hook = self._make_hook()

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
        groups, hashes, learn, new_group, abort = self.groups, self.hashes, self._learn, self._new_group, self.abort
        rmask, cmask, prime, mask = RING - 1, CHECKPOINT - 1, _PRIME, _MASK

        def hook(key: str, op: str, shapes: tuple, dtypes: tuple, root: Any, rec: tuple) -> None:
            if abort:  # a new exception each time: re-raising one would grow its traceback
                raise type(abort[0])(*abort[0].args)
            g = groups.get(key)
            if g is None:
                g = new_group(key, rec)
            sig = (op, shapes, dtypes, root)
            h = hashes.get(sig)
            if h is None:
                h = learn(sig)
            n = g.n
            d = ((g.d ^ h) * prime) & mask
            g.ring[n & rmask] = (n, d, h, rec)
            g.d = d
            g.n = n + 1
            if n & cmask == cmask:
                g.cps.append((n, d))

        return hook

    def total(self) -> int:
        return sum(g.n for g in self.groups.values())


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
    out: Dict[str, Any] = {"rank": rank, "t": round(time.time(), 3), "quiet": quiet, "g": {}}
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


class Verdict:
    """One divergence: who, where, and both sides' collectives."""

    def __init__(self, group: str, index: int, exact: bool, deviants: List[int], agreeing: List[int],
                 deviant_entry: Optional[List[Any]], agreeing_entry: Optional[List[Any]], basis: str) -> None:
        self.group, self.index, self.exact = group, index, exact
        self.deviants, self.agreeing = deviants, agreeing
        self.deviant_entry, self.agreeing_entry = deviant_entry, agreeing_entry
        self.basis = basis
        #: the last index both sides were seen to agree on (for a bounded ``index``)
        self.last_good = index - 1
        self.time = time.time()
        self.reporter: Optional[int] = None

    @property
    def summary(self) -> str:
        from hangdoc.ranges import describe_ranks

        def side(e: Optional[List[Any]]) -> str:
            return f"{e[1]} at {e[2]}" if e else "(not in its recent window)"

        where = f"collective #{self.index}" if self.exact else f"collective #{self.index} or earlier"
        s = (f"{describe_ranks(self.deviants)} diverged from {describe_ranks(self.agreeing)} in {self.group} at "
             f"{where}: {side(self.deviant_entry)} vs {side(self.agreeing_entry)}")
        if self.basis == "tie":
            s += " (two sides, no majority: the higher rank is named)"
        elif self.basis == "pattern":
            s += f" ({describe_ranks(self.deviants)} broke what the loop issued after the previous call)"
        return s

    def to_json(self) -> Dict[str, Any]:
        return {"hangdoc": "divergence", "version": 1, "group": self.group, "index": self.index, "exact": self.exact,
                "deviants": self.deviants, "agreeing": self.agreeing, "deviant": self.deviant_entry,
                "expected": self.agreeing_entry, "basis": self.basis, "time": self.time, "reporter": self.reporter,
                "summary": self.summary}

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "Verdict":
        v = cls(d["group"], int(d["index"]), bool(d.get("exact", True)), list(d["deviants"]), list(d["agreeing"]),
                d.get("deviant"), d.get("expected"), d.get("basis", "majority"))
        v.time = float(d.get("time") or time.time())
        v.reporter = d.get("reporter")
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
        if len(cont) == 1:
            winner, basis = cont[0], "pattern"
        elif len(fam) == 1:
            winner, basis = fam[0], "history"
        else:
            winner, basis = min(tied, key=lambda kv: min(kv[1])), "tie"
    agreeing = sorted(winner[1])
    deviants = sorted(r for d, rs in sides.items() if d != winner[0] for r in rs)
    return Verdict(group, index, exact, deviants, agreeing, entry_at(pubs[deviants[0]], index),
                   entry_at(pubs[agreeing[0]], index), basis)


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


class Node:
    """One rank's side of the protocol, over a store given as bounded operations.

    ``ops`` has ``set(key, value)``, ``get(key) -> bytes | None`` (None when absent),
    ``add(key, n) -> int`` and ``compare_set(key, expected, desired) -> bytes``. Keys: one per rank
    (``hangdoc/detect/r{rank}``: its publication), one per job (``hangdoc/detect/state``: a
    request for older detail, then the verdict) and the claim counter. The benchmark drives many
    Nodes against one TCPStore.

    When the first difference two ranks show is only bounded (it happened further back than the
    published windows reach), the checker asks every rank, through the state key, to publish the
    stretch in question too, and decides once that detail has come (or FOCUS_WAIT has passed).
    """

    def __init__(self, rank: int, ops: Any, ranks_of: Callable[[str], Sequence[int]], period: float = PERIOD,
                 quiet_after: float = QUIET, read_every: float = READ) -> None:
        self.rank = rank
        self.ops = ops
        self.ranks_of = ranks_of
        self.period, self.quiet_after, self.read_every = period, quiet_after, read_every
        self.last_pub = -1e9
        self.pub_total = -1
        self.last_read = -1e9
        self.last_change = time.monotonic()
        self.seen_total = -1
        self.quiet_published = False
        self.last_state = -1e9
        #: (group, lo, hi) this rank publishes detail of, when asked
        self.focus: Optional[List[Any]] = None
        self._focus_pub = False
        self._focus_asked: Optional[float] = None
        #: the verdict, once known; ``claimed``: this rank found it and reports it
        self.verdict: Optional[Verdict] = None
        self.claimed = False
        self.writes = self.reads = 0
        self._undecided: Dict[Tuple[str, int], float] = {}

    def key(self, rank: int) -> str:
        return f"{PREFIX}r{rank}"

    def read(self, rank: int) -> Optional[Dict[str, Any]]:
        self.reads += 1
        raw = self.ops.get(self.key(rank))
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return None

    def _read_state(self, now: float) -> None:
        self.last_state = now
        self.reads += 1
        raw = self.ops.get(STATE_KEY)
        if not raw:
            return
        try:
            state = json.loads(raw)
        except ValueError:
            return
        if "verdict" in state:
            self.verdict = Verdict.from_json(state["verdict"])
        elif "focus" in state and self.focus != state["focus"]:
            self.focus = list(state["focus"])
            self._focus_pub = False

    def tick(self, now: float, total: int, make: Callable[..., Dict[str, Any]], final: bool = False) -> Optional[Verdict]:
        """Publish when due, read partners when due; returns the verdict once there is one."""
        if self.verdict is not None:
            return self.verdict
        if total != self.seen_total:
            self.seen_total, self.last_change = total, now
            self.quiet_published = False
        quiet = now - self.last_change >= self.quiet_after
        if final or now - self.last_state >= (self.read_every if (quiet or self.focus) else 2 * self.read_every):
            self._read_state(now)
            if self.verdict is not None:
                return self.verdict
        changed = total != self.pub_total
        mine = None
        due = changed and (now - self.last_pub >= self.period or (quiet and not self.quiet_published))
        if due or final or (self.focus is not None and not self._focus_pub):
            mine = make(quiet, self.focus)
            self.ops.set(self.key(self.rank), json.dumps(mine, separators=(",", ":")))
            self.writes += 1
            self.last_pub, self.pub_total = now, total
            self.quiet_published = quiet
            self._focus_pub = self.focus is not None
        if not final and now - self.last_read < (TICK if (quiet or self._focus_asked) else self.read_every):
            return None
        self.last_read = now
        if mine is None:
            mine = make(quiet, self.focus)
        v = self.check(mine, now, final=final)
        if v is None:
            return None
        if not v.exact and not final:
            if self._focus_asked is None:
                # ask every rank for the detail of the stretch in question, then look again
                lo = max(0, v.last_good + 1)
                focus = [v.group, lo, v.index + 1]
                self.ops.compare_set(STATE_KEY, "", json.dumps({"focus": focus}))
                self.writes += 1
                self._focus_asked = now
                self.last_state = -1e9  # read the state (ours, or an earlier request) at once
                return None
            if now - self._focus_asked < FOCUS_WAIT:
                return None
        v.reporter = self.rank
        if int(self.ops.add(CLAIM_KEY, 1)) == 1:
            self.ops.set(STATE_KEY, json.dumps({"verdict": v.to_json()}))
            self.writes += 2
            self.claimed = True
            self.verdict = v
            return v
        for _ in range(10):  # another rank claimed it: its verdict is being written
            self._read_state(now)
            if self.verdict is not None:
                return self.verdict
            time.sleep(0.05)
        self.verdict = v
        return v

    def check(self, mine: Dict[str, Any], now: Optional[float] = None, final: bool = False) -> Optional[Verdict]:
        """The first divergence between this rank's publication and its partners' (``final``: a
        rank on its way out reads a few more partners, since its pair partner may be the rank that
        died)."""
        now = time.monotonic() if now is None else now
        cache: Dict[int, Optional[Dict[str, Any]]] = {self.rank: mine}

        def pub_of(r: int) -> Optional[Dict[str, Any]]:
            if r not in cache:
                cache[r] = self.read(r)
            return cache[r]

        for name, g in sorted(mine["g"].items(), key=lambda kv: (kv[0] != "default_pg", kv[0])):
            ranks = list(self.ranks_of(name))
            base = partners(self.rank, ranks, extra=OPINIONS if final else 0)
            for p in base:
                other = pub_of(p)
                og = (other or {}).get("g", {}).get(name)
                if og is None:
                    continue
                diff = first_difference(g, og)
                if diff is None:
                    continue
                for q in partners(self.rank, ranks, extra=OPINIONS)[len(base):]:
                    pub_of(q)
                members = set(ranks)
                pubs = {q: c["g"][name] for q, c in cache.items()
                        if q in members and c is not None and name in c.get("g", {})}
                knowers = sum(1 for q in pubs.values() if diff[0] in known_digests(q))
                if knowers < min(3, len(ranks)):
                    # two opinions where a third may come: wait for it, a little
                    since = self._undecided.setdefault((name, diff[0]), now)
                    if now - since < UNDECIDED_WAIT:
                        continue
                v = decide(name, pubs, diff[0], diff[1])
                if v is not None:
                    v.last_good = diff[2]
                    return v
        return None


# -- the daemon --------------------------------------------------------------------------------
class _StoreOps:
    """Store operations through :mod:`hangdoc.runtime.exchange` (bounded, abandoned on a hang)."""

    def __init__(self) -> None:
        from hangdoc.runtime import exchange

        self.x = exchange

    def _store(self) -> Any:
        store = self.x.job_store()
        if store is None:
            raise ConnectionError("no torch.distributed store")
        return store

    def set(self, key: str, value: str) -> None:
        self.x.bounded_op(self._store(), "set", key, value)

    def get(self, key: str) -> Optional[bytes]:
        store = self._store()
        if not self.x.has_key(store, key):
            return None
        return self.x.bounded_op(store, "get", key)

    def add(self, key: str, n: int) -> int:
        return int(self.x.bounded_op(self._store(), "add", key, n))

    def compare_set(self, key: str, expected: str, desired: str) -> Any:
        return self.x.bounded_op(self._store(), "compare_set", key, expected, desired)


class Detector:
    """The running detector of this process; use :func:`start` / :func:`stop`."""

    def __init__(self, policy: str = "warn", out_dir: Optional[str] = None, tick: float = TICK) -> None:
        if policy not in POLICIES:
            raise ValueError(f"detect policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        from hangdoc.runtime.options import output_dir

        self.policy = policy
        self.out_dir = output_dir(out_dir, create=False)
        self.tick_s = tick
        self.digests = Digests()
        self.verdict: Optional[Verdict] = None
        #: time.time() when this process learned of the verdict
        self.fired_at: Optional[float] = None
        self.node: Optional[Node] = None
        self._describe_cache: Dict[int, Any] = {}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._errors = 0
        self._tick_lock = threading.Lock()

    def start(self) -> "Detector":
        from hangdoc.runtime import recorder

        if recorder.enable(out_dir=self.out_dir) is None:
            raise RuntimeError("the collective recorder could not be enabled (no torch.distributed)")
        recorder._PASS_THROUGH = (DivergenceError,)
        recorder._detect = self.digests.hook
        self._thread = threading.Thread(target=self._run, name="hangdoc-detect", daemon=True)
        self._thread.start()
        atexit.register(self._final)
        if threading.current_thread() is threading.main_thread():
            from hangdoc.runtime import on_term

            # a launcher's SIGTERM (sent to every rank as soon as one fails: gloo aborting a rank on a
            # dtype mismatch) ends a process with no atexit: the last state is published from there too
            on_term.install(self._final)
        return self

    def stop(self) -> None:
        from hangdoc.runtime import recorder

        self._final()
        from hangdoc.runtime import on_term

        on_term.uninstall(self._final)
        if recorder._detect is self.digests.hook:
            recorder._detect = None
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=2 * self.tick_s + 1)
        try:
            atexit.unregister(self._final)
        except Exception:
            pass

    # -- the loop --------------------------------------------------------------------------
    def _ident(self) -> Any:
        from hangdoc.runtime.identity import identity

        return identity()

    def _run(self) -> None:
        while not self._stop.wait(self.tick_s):
            try:
                self._tick()
            except Exception as e:  # the detector must never take the job down
                self._errors += 1
                if self._errors <= 3:
                    self._say(f"hangdoc detect: {type(e).__name__}: {e}")

    def _ready(self) -> bool:
        from hangdoc.runtime import exchange

        if not exchange.dist_initialized():
            return False
        exchange.prepare()
        if not exchange.prepared():
            return False
        if self.node is None:
            groups = self.digests.groups
            self.node = Node(self._ident().rank, _StoreOps(), lambda name: groups[name].ranks if name in groups else ())
        return exchange.connected()

    def _make(self, quiet: bool, focus: Optional[Sequence[Any]] = None) -> Dict[str, Any]:
        return snapshot(self.digests, self.node.rank if self.node else 0, self._describe, quiet, focus)

    def _describe(self, rec: tuple) -> Tuple[str, str]:
        return _describe(rec, self._describe_cache)

    def _tick(self, final: bool = False) -> None:
        with self._tick_lock:
            self._tick_locked(final)

    def _tick_locked(self, final: bool) -> None:
        if self.verdict is not None or not self._ready():
            return
        node = self.node
        v = node.tick(time.monotonic(), self.digests.total(), self._make, final=final)
        if v is not None:
            self._act(v, mine=node.claimed)

    def _final(self) -> None:
        # A rank that exits (or fails, or gets its launcher's SIGTERM) right after diverging still
        # leaves its last state behind, and reads its partners' until they are there too: a job that
        # dies within a second of a divergence (gloo aborting a rank on a dtype mismatch) may never
        # have published at all. Bounded, so that a store that stopped answering cannot delay the
        # exit for long.
        if self.verdict is not None or not self.digests.total():
            return

        def last() -> None:
            end = time.monotonic() + FINAL_WAIT - 0.2
            while self.verdict is None and time.monotonic() < end:
                try:
                    self._tick(final=True)
                except Exception:
                    return
                time.sleep(0.1)

        t = threading.Thread(target=last, name="hangdoc-detect-final", daemon=True)
        t.start()
        t.join(FINAL_WAIT)

    def _act(self, v: Verdict, mine: bool) -> None:
        if self.verdict is not None:
            return
        self.verdict = v
        self.fired_at = time.time()
        if mine:
            self._say(f"hangdoc: DIVERGENCE: {v.summary}")
            try:
                from hangdoc.atomic import write_atomic

                os.makedirs(self.out_dir, exist_ok=True)
                write_atomic(os.path.join(self.out_dir, "divergence.json"), json.dumps(v.to_json(), indent=1) + "\n")
            except Exception as e:
                self._say(f"hangdoc detect: divergence.json not written: {type(e).__name__}: {e}")
        if self.policy == "abort":
            self.digests.abort.append(DivergenceError(f"hangdoc: {v.summary}"))
        elif self.policy == "dump":
            self._dump(v)

    def _dump(self, v: Verdict) -> None:
        """Every rank writes its stacks and records; the watchdog's exchange makes the report."""
        from hangdoc.runtime import exchange, watchdog

        dog = watchdog.get()
        if dog is None:
            from hangdoc.runtime import recorder

            dog = watchdog.Watchdog(hang_timeout=3600, out_dir=self.out_dir, signum=None, report=True, record=False)
            dog._recorder = recorder.get()
        reason = f"divergence in {v.group} at collective #{v.index}"
        paths = dog.dump_now(reason)
        exchange.share(dog, paths or (), reason, stall=False)  # written or not: the dump is in dog.last_files

    def _say(self, message: str) -> None:
        from hangdoc.runtime import exchange

        try:
            exchange.say(message, self._ident())
        except Exception:
            pass


_current: Optional[Detector] = None
_lock = threading.Lock()


def start(policy: str = "warn", out_dir: Optional[str] = None) -> Detector:
    """Start detecting (idempotent): turns the recorder on and hooks the digests into it.

        >>> import tempfile
        >>> det = start("warn", out_dir=tempfile.mkdtemp())    # doctest: +SKIP
        >>> det.verdict is None                                  # doctest: +SKIP
        True
    """
    global _current
    with _lock:
        if _current is None:
            _current = Detector(policy, out_dir).start()
        return _current


def stop() -> None:
    """Stop the daemon and unhook the digests (the recorder stays on)."""
    global _current
    with _lock:
        det, _current = _current, None
    if det is not None:
        det.stop()


def get() -> Optional[Detector]:
    """The running detector, or None."""
    return _current
