"""One rank's side of the divergence detector's protocol over the job's store (pure of threads).

:class:`Node` publishes a rank's digests (:func:`hangdoc.runtime.detect_digest.snapshot`), reads its
partners', asks for older detail when a difference is only bounded, decides (:func:`decide`) and
claims the verdict; the cross-group rules (groups entered in opposite orders, receives that cannot
end, dead or stopped members, a wait cycle through a broken loop) run while the rank is quiet. The
daemon that drives it is :class:`hangdoc.runtime.detect.Detector`; the benchmark drives many Nodes
against one TCPStore.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from hangdoc.runtime.detect_digest import (
    Verdict, decide, first_difference, known_digests, partners, rotating,
)
from hangdoc.runtime.detect_groups import FIRST_GAP as FIRST_CROSS_GAP

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
#: members read once a difference is found, so that every deviant among them is named (two ranks
#: that skipped the same call are both culprits): store reads only on the rare difference
NAME_ALL = 64
#: how long a checker waits for the older detail it asked for before reporting a bounded index
FOCUS_WAIT = 3.0

PREFIX = "hangdoc/detect/"
STATE_KEY = PREFIX + "state"
CLAIM_KEY = PREFIX + "claim"


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
        #: of the writes, publications made at once for a call of a new signature (Detector._early)
        self.early = 0
        self._undecided: Dict[Tuple[str, int], float] = {}
        #: looks at the partners so far (whom a look reads rotates: detect_digest.rotating)
        self._turn = 0
        #: when to look for a cross-group wait next while quiet, and the gap after that
        self._cross_at, self._cross_gap = 0.0, FIRST_CROSS_GAP
        #: this process's host (its publications say it): members on it can be looked up in /proc
        self.host: Optional[str] = None
        #: the output directory, where a member that died in native code left its stack (detect_fatal)
        self.out_dir: Optional[str] = None

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
            self._cross_at, self._cross_gap = 0.0, FIRST_CROSS_GAP  # a new quiet phase: look again soon
        quiet = now - self.last_change >= self.quiet_after
        if final or now - self.last_state >= (self.read_every if (quiet or self.focus) else 2 * self.read_every):
            self._read_state(now)
            if self.verdict is not None:
                return self.verdict
        changed = total != self.pub_total
        mine = None
        # (going quiet is published once even with no new call since the last publication: a rank
        # blocked in its call says so, which the cross-group check reads)
        due = (changed and now - self.last_pub >= self.period) or (quiet and not self.quiet_published)
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
        return self.claim(v, now)

    def publish(self, now: float, total: int, make: Callable[..., Dict[str, Any]]) -> None:
        """Publish at once, whatever the period (a call with a new signature: see Detector._early)."""
        mine = make(False, self.focus)
        self.ops.set(self.key(self.rank), json.dumps(mine, separators=(",", ":")))
        self.writes += 1
        self.early += 1
        self.last_pub, self.pub_total = now, total

    def claim(self, v: Verdict, now: float) -> Verdict:
        """Report ``v`` as the job's verdict unless another rank reported one first (then that one)."""
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

        self._turn += 1
        for name, g in sorted(mine["g"].items(), key=lambda kv: (kv[0] != "default_pg", kv[0])):
            ranks = list(self.ranks_of(name))
            base = partners(self.rank, ranks, extra=OPINIONS) if final else rotating(self.rank, ranks, self._turn)
            for p in base:
                other = pub_of(p)
                og = (other or {}).get("g", {}).get(name)
                if og is None:
                    continue
                diff = first_difference(g, og)
                if diff is None:
                    continue
                for q in partners(self.rank, ranks, extra=max(OPINIONS, NAME_ALL)):
                    pub_of(q)
                members = set(ranks)
                pubs = {q: c["g"][name] for q, c in cache.items()
                        if q in members and c is not None and name in c.get("g", {})}
                knowers = sum(1 for q in pubs.values() if diff[0] in known_digests(q))
                # on the way out, a member that never published counts for nothing: it may be the one
                # that died (gloo aborts a rank within milliseconds of its mismatched call), and the
                # launcher's teardown leaves no time to wait for it
                read = sum(1 for q, c in cache.items() if q in members and (c is not None or not final))
                if knowers < min(3, len(ranks)) or knowers < read:
                    # two opinions where a third may come, or members read that have not published
                    # that call yet, or nothing yet (another deviant among them is named only once
                    # it has): wait for them, a little
                    since = self._undecided.setdefault((name, diff[0]), now)
                    if now - since < UNDECIDED_WAIT:
                        continue
                v = decide(name, pubs, diff[0], diff[1])
                if v is not None:
                    v.last_good = diff[2]
                    return v
        return self._cross_group(mine, pub_of, now, final)

    def _fatal_of(self) -> Optional[Callable[[int, int], Optional[Dict[str, Any]]]]:
        """How a dead member's stack as it died is read: its fatal file in the output directory
        (:mod:`hangdoc.runtime.detect_fatal`), named by its host and pid; None without a directory."""
        from hangdoc.runtime import detect_fatal

        out_dir, host = self.out_dir, self.host
        if not out_dir or not host:
            return None
        return lambda rank, pid: detect_fatal.read_where(out_dir, host, rank, pid)

    def _cross_group(self, mine: Dict[str, Any], pub_of: Callable[[int], Optional[Dict[str, Any]]], now: float,
                     final: bool) -> Optional[Verdict]:
        """Two groups entered in opposite orders (:mod:`hangdoc.runtime.detect_groups`; under NCCL, calls
        queued behind each other on the GPU: :mod:`hangdoc.runtime.detect_queue`), a receive
        that cannot end (:mod:`hangdoc.runtime.detect_p2p`), or a member the others wait for whose
        process is dead or stopped (:mod:`hangdoc.runtime.detect_gone`), once it has stood for
        PERSIST seconds (at once on the way out)."""
        from hangdoc.runtime import detect_gone, detect_groups, detect_p2p, detect_pattern, detect_queue

        if not mine.get("quiet") and final and self.host:
            # on its way out with its last call just issued (gloo failing it with "Connection closed
            # by peer" once a member left): only a member that is gone or ended says anything then
            return detect_gone.gone_member(self.rank, dict(mine, quiet=True), pub_of, self.ranks_of, self.host,
                                           final=True, fatal_of=self._fatal_of())
        if not mine.get("quiet") or (not final and now < self._cross_at):
            return None
        v = detect_groups.cross_group_wait(self.rank, mine, pub_of, self.ranks_of)
        if v is None:
            v = detect_queue.queued_cycle(self.rank, mine, pub_of, self.ranks_of)
        if v is None:
            v = detect_p2p.p2p_wait(self.rank, mine, pub_of, self.ranks_of("default_pg"))
        if v is None and self.host:
            v = detect_gone.gone_member(self.rank, mine, pub_of, self.ranks_of, self.host, final=final,
                                        fatal_of=self._fatal_of())
        if v is None:
            v = detect_pattern.broken_loop_in_wait(self.rank, mine, pub_of, self.ranks_of("default_pg"), self.ranks_of)
        if v is None:
            self._cross_at = now + self._cross_gap
            self._cross_gap = min(detect_groups.LAST_GAP, 2 * self._cross_gap)
            return None
        since = self._undecided.setdefault((v.basis, v.kind, v.group, v.other_group, v.index, tuple(v.deviants)), now)
        return v if final or now - since >= detect_groups.PERSIST else None
