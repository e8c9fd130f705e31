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
import json
import os
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from hangdoc.runtime.detect_groups import FIRST_GAP as FIRST_CROSS_GAP

# the digests, publications and their comparison (pure); re-exported here, where they always were
from hangdoc.runtime.detect_digest import (  # noqa: F401
    CHECKPOINT, CHECKPOINTS, RING, SHAPELESS, WINDOW, Digests, Verdict, _describe, combine, decide, digest_of,
    entry_at, first_difference, known_digests, partners, rotating, sig_hash, snapshot,
)

__all__ = ["start", "stop", "get", "DivergenceError", "Detector", "Verdict", "POLICIES", "digest_of", "snapshot",
           "first_difference", "decide"]

POLICIES = ("warn", "dump", "abort")

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
#: the most a process's exit waits for its last publication
FINAL_WAIT = 2.0
#: publications at once when a rank issues a collective of a signature it never issued before (the
#: first iteration's, a new phase's, an extra call's), and how long the call waits for one (s)
EARLY = 64
EARLY_WAIT = 0.05

PREFIX = "hangdoc/detect/"
STATE_KEY = PREFIX + "state"
CLAIM_KEY = PREFIX + "claim"


class DivergenceError(RuntimeError):
    """Raised in the main thread at the next collective once a divergence was found (policy ``abort``)."""


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
        #: looks at the partners so far (whom a look reads rotates: detect_digest.rotating)
        self._turn = 0
        #: when to look for a cross-group wait next while quiet, and the gap after that
        self._cross_at, self._cross_gap = 0.0, FIRST_CROSS_GAP
        #: this process's host (its publications say it): members on it can be looked up in /proc
        self.host: Optional[str] = None

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
                read = sum(1 for q in cache if q in members)
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

    def _cross_group(self, mine: Dict[str, Any], pub_of: Callable[[int], Optional[Dict[str, Any]]], now: float,
                     final: bool) -> Optional[Verdict]:
        """Two groups entered in opposite orders (:mod:`hangdoc.runtime.detect_groups`), a receive
        that cannot end (:mod:`hangdoc.runtime.detect_p2p`), or a member the others wait for whose
        process is dead or stopped (:mod:`hangdoc.runtime.detect_gone`), once it has stood for
        PERSIST seconds (at once on the way out)."""
        from hangdoc.runtime import detect_gone, detect_groups, detect_p2p, detect_pattern

        if not mine.get("quiet") or (not final and now < self._cross_at):
            return None
        v = detect_groups.cross_group_wait(self.rank, mine, pub_of, self.ranks_of)
        if v is None:
            v = detect_p2p.p2p_wait(self.rank, mine, pub_of, self.ranks_of("default_pg"))
        if v is None and self.host:
            v = detect_gone.gone_member(self.rank, mine, pub_of, self.ranks_of, self.host, final=final)
        if v is None:
            v = detect_pattern.broken_loop_in_wait(self.rank, mine, pub_of, self.ranks_of("default_pg"), self.ranks_of)
        if v is None:
            self._cross_at = now + self._cross_gap
            self._cross_gap = min(detect_groups.LAST_GAP, 2 * self._cross_gap)
            return None
        since = self._undecided.setdefault((v.basis, v.kind, v.group, v.other_group, v.index, tuple(v.deviants)), now)
        return v if final or now - since >= detect_groups.PERSIST else None


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
        #: publications at a new signature left, the one asked for, and the daemon's wake-up
        self._early_left = EARLY
        self._early_req: Optional[threading.Event] = None
        self._wake = threading.Event()
        #: when this rank's main thread was last looked at for a lock it holds itself (_own_lock)
        self._lock_at = 0.0
        #: (calls issued when it was computed, this rank's loop break) (see _own_break)
        self._brk: Tuple[int, Optional[Dict[str, Any]]] = (-1, None)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._errors = 0
        self._tick_lock = threading.Lock()
        #: set on the way out (exit, exception, SIGTERM): publications say ``end``
        self._ending = False

    def start(self) -> "Detector":
        from hangdoc import atomic  # noqa: F401  (imported now: a verdict on the way out writes with it)
        from hangdoc.runtime import recorder

        if recorder.enable(out_dir=self.out_dir) is None:
            raise RuntimeError("the collective recorder could not be enabled (no torch.distributed)")
        recorder._PASS_THROUGH = (DivergenceError,)
        recorder._detect = self.digests.hook
        self.digests.on_new[0] = self._early
        recorder._detect_p2p = self.digests.hook_p2p
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
        if recorder._detect_p2p is self.digests.hook_p2p:
            recorder._detect_p2p = None
        self.digests.on_new[0] = None
        self._stop.set()
        self._wake.set()
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

    def _early(self) -> None:
        """A collective with a signature this rank never issued was just recorded (the calling
        thread, before the call): publish now and wait for it a little, within a budget. A call that
        gets the rank aborted inside it (gloo's enforce on a size mismatch: ``terminate called``, no
        Python on the way out) is then in the store for the others' last checks; a rank that issued
        an extra all_reduce would otherwise leave only its state of the last second."""
        if self._early_left <= 0 or threading.current_thread() is self._thread:
            return
        done = threading.Event()
        self._early_req = done
        self._wake.set()
        done.wait(EARLY_WAIT)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.tick_s)
            self._wake.clear()
            if self._stop.is_set():
                return
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
            ident = self._ident()
            world = tuple(range(max(1, min(int(ident.world_size or 1), 1 << 20))))

            def ranks_of(name: str) -> Sequence[int]:
                # the default group's members are the job's, whether or not this rank used it yet (a
                # pipeline stage that only sends and receives)
                return groups[name].ranks if name in groups else (world if name == "default_pg" else ())

            self.node = Node(ident.rank, _StoreOps(), ranks_of)
            self.node.host = ident.host
        return exchange.connected()

    def _make(self, quiet: bool, focus: Optional[Sequence[Any]] = None) -> Dict[str, Any]:
        out = snapshot(self.digests, self.node.rank if self.node else 0, self._describe, quiet, focus)
        # who publishes (hangdoc.runtime.detect_gone looks a member on its own host up in /proc), and
        # whether this is its last word on its way out through Python (then its end is no mystery)
        out["host"], out["pid"] = self.node.host if self.node else None, os.getpid()
        if quiet:  # where this rank's own calls broke its loop (hangdoc.runtime.detect_pattern)
            brk = self._own_break()
            if brk is not None:
                out["brk"] = brk
        if self._ending:
            out["end"] = True
        return out

    def _own_lock(self, node: Node) -> Optional[Verdict]:
        """While this rank is quiet, once a second: its main thread waiting for a lock it holds
        itself (hangdoc.runtime.detect_lock) is the verdict, certain at once."""
        from hangdoc.runtime import detect_lock

        now = time.monotonic()
        if now - node.last_change < QUIET or now - self._lock_at < 1.0:
            return None
        self._lock_at = now
        found = detect_lock.main_thread_deadlock()
        if found is None:
            return None
        return node.claim(detect_lock.verdict(node.rank, found, self.digests, self._describe), now)

    def _own_break(self) -> Optional[Dict[str, Any]]:
        from hangdoc.runtime import detect_pattern, recorder

        total = self.digests.total()
        if self._brk[0] != total:
            r = recorder.get()
            records = list(r._buf) if r is not None else []  # one C-level copy: consistent
            self._brk = (total, detect_pattern.own_break(records, self._describe))
        return self._brk[1]

    def _describe(self, rec: tuple) -> Tuple[str, str]:
        return _describe(rec, self._describe_cache)

    def _tick(self, final: bool = False) -> None:
        with self._tick_lock:
            self._tick_locked(final)

    def _tick_locked(self, final: bool) -> None:
        early, self._early_req = self._early_req, None
        try:
            if self.verdict is not None or not self._ready():
                return
            if early is not None and self._early_left > 0:
                self._early_left -= 1  # only publications count: before the store is ready, none is made
                self.node.publish(time.monotonic(), self.digests.total(), self._make)
        finally:
            if early is not None:
                early.set()
        node = self.node
        v = node.tick(time.monotonic(), self.digests.total(), self._make, final=final)
        if v is None and not final:
            v = self._own_lock(node)
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
        self._ending = True

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
            # the file first: on the way out (a rank's last check while its process exits) the
            # process may end right after, and the file is what stays
            try:
                from hangdoc.atomic import write_atomic

                os.makedirs(self.out_dir, exist_ok=True)
                write_atomic(os.path.join(self.out_dir, "divergence.json"), json.dumps(v.to_json(), indent=1) + "\n")
            except Exception as e:
                self._say(f"hangdoc detect: divergence.json not written: {type(e).__name__}: {e}")
            self._say(f"hangdoc: DIVERGENCE: {v.summary}")
        if self.policy == "abort":
            self.digests.abort.append(DivergenceError(f"hangdoc: {v.summary}"))
        elif self.policy == "dump":
            self._dump(v)

    def raised(self, e: BaseException) -> None:
        """The script raised out of its main function: the others will wait for this rank at its
        next collective, so this is the verdict (``rank-failed``), reported at once. Not when the
        exception came out of a torch.distributed call: that is how a rank learns that another one
        failed (gloo's ``Connection closed by peer``), a consequence, not the cause. Reported from a
        thread of its own, waited for FINAL_WAIT seconds at most: a store that stopped answering
        (or the detector's thread holding the lock in a store call) cannot hold the exit up."""
        from hangdoc.runtime import detect_failed

        if self.verdict is not None:
            return
        try:
            ident = self._ident()
            v = detect_failed.verdict(e, ident.rank, self.digests, self._describe)
        except Exception as err:  # the detector must never take the job down
            self._say(f"hangdoc detect: {type(err).__name__}: {err}")
            return
        if v is None:
            return

        def report() -> None:
            try:
                with self._tick_lock:
                    if self.verdict is not None:
                        return
                    mine = True
                    if self._ready() and self.node is not None:
                        found = self.node.claim(v, time.monotonic())
                        mine = self.node.claimed
                    else:
                        found = v
                        found.reporter = ident.rank
                    self._act(found, mine=mine)
            except Exception as err:  # the detector must never take the job down
                self._say(f"hangdoc detect: {type(err).__name__}: {err}")

        t = threading.Thread(target=report, name="hangdoc-detect-raised", daemon=True)
        t.start()
        t.join(FINAL_WAIT)

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
