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
from typing import Any, Dict, List, Optional, Sequence, Tuple

# the digests, publications and their comparison (pure); re-exported here, where they always were
from hangdoc.runtime.detect_digest import (  # noqa: F401
    CHECKPOINT, CHECKPOINTS, RING, SHAPELESS, WINDOW, Digests, Verdict, _describe, combine, decide, digest_of,
    entry_at, first_difference, known_digests, partners, rotating, sig_hash, snapshot,
)
# one rank's side of the protocol; re-exported here, where it always was
from hangdoc.runtime.detect_node import (  # noqa: F401
    CLAIM_KEY, FOCUS_WAIT, NAME_ALL, OPINIONS, PERIOD, PREFIX, QUIET, READ, STATE_KEY, TICK, UNDECIDED_WAIT, Node,
)

__all__ = ["start", "stop", "get", "DivergenceError", "Detector", "Verdict", "POLICIES", "digest_of", "snapshot",
           "first_difference", "decide"]

POLICIES = ("warn", "dump", "abort")

#: the most a process's exit waits for its last publication
FINAL_WAIT = 2.0
#: publications at once when a rank issues a collective of a signature it never issued before (the
#: first iteration's, a new phase's, an extra call's), and how long the call waits for one (s)
EARLY = 64
EARLY_WAIT = 0.05


class DivergenceError(RuntimeError):
    """Raised in the main thread at the next collective once a divergence was found (policy ``abort``)."""


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
        #: when this rank's main thread was last looked at for a lock it holds itself, and the
        #: look at its children forked with a lock held (_own_lock)
        self._lock_at = 0.0
        self._lock_order: Optional[tuple] = None  # the lock-wait cycle seen at the last look
        #: (calls issued, when) at a stall this rank reported of itself (_resumed)
        self._stall_mark: Optional[Tuple[int, float, int]] = None
        self._resume_lock = threading.Lock()
        from hangdoc.runtime import detect_fork, detect_stall

        self._fork_watch = detect_fork.Watch()
        self._stall_watch = detect_stall.Watch()
        #: (calls issued when computed, {queued: this rank's loop break, over the last RECENT calls or,
        #: for detect_queue, the last QUEUED}) (see _own_break)
        self._brk: Tuple[int, Dict[bool, Optional[Dict[str, Any]]]] = (-1, {})
        #: (calls issued, when, this rank's queue head) (see _queue_head)
        self._head: Tuple[int, float, Optional[Dict[str, Any]]] = (-1, 0.0, None)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._errors = 0
        self._tick_lock = threading.Lock()
        #: set on the way out (exit, exception, SIGTERM): publications say ``end``
        self._ending = False
        #: the script raised out of its main function (raised): its end is no clean exit
        self._raised_any = False

    def start(self) -> "Detector":
        from hangdoc import atomic  # noqa: F401  (imported now: a verdict on the way out writes with it)
        from hangdoc.runtime import recorder

        if recorder.enable(out_dir=self.out_dir) is None:
            raise RuntimeError("the collective recorder could not be enabled (no torch.distributed)")
        recorder._PASS_THROUGH = (DivergenceError,)
        recorder._detect = self.digests.hook
        self.digests.on_new[0] = self._early
        from hangdoc.runtime import detect_fork, detect_stall

        detect_fork.install()
        detect_stall.install()
        self._arm_fatal()
        recorder._detect_p2p = self.digests.hook_p2p
        recorder._detect_leaving = self._leaving
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
        if recorder._detect_leaving == self._leaving:
            recorder._detect_leaving = None
        self.digests.on_new[0] = None
        from hangdoc.runtime import detect_fork, detect_stall

        detect_fork.uninstall()
        detect_stall.uninstall()
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
    def _arm_fatal(self) -> None:
        """This rank's Python stack if it dies in native code, for the others (detect_fatal): armed at
        the start where the launcher says the rank (a rank gloo aborts within its first second has no
        store connection yet), once per process (the watchdog's, when it runs)."""
        try:
            from hangdoc.runtime import fatal

            ident = self._ident()
            if ident.rank is None:
                return
            os.makedirs(self.out_dir, exist_ok=True)
            fatal.arm(self.out_dir, ident.host, ident.rank)
        except Exception:
            pass

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
        if not done.wait(EARLY_WAIT):
            self._early_left -= 1  # a daemon busy elsewhere (a store call that hangs): waits are bounded too

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
            # after destroy_process_group (a rank whose loop ended): the store connection and the node
            # made before still carry its last publication, which says how it ended (detect_gone)
            return self.node is not None and exchange.connected()
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
            self.node.out_dir = self.out_dir
            self._arm_fatal()  # (where the rank was not known at the start)
        return exchange.connected()

    def _make(self, quiet: bool, focus: Optional[Sequence[Any]] = None) -> Dict[str, Any]:
        out = snapshot(self.digests, self.node.rank if self.node else 0, self._describe, quiet, focus)
        # who publishes (hangdoc.runtime.detect_gone looks a member on its own host up in /proc), and
        # whether this is its last word on its way out through Python (then its end is no mystery)
        out["host"], out["pid"] = self.node.host if self.node else None, os.getpid()
        if quiet:
            pend = self._blocked_elsewhere(out.get("last"))
            if pend:
                out["pend"] = pend
        if quiet:  # where this rank's own calls broke its loop (hangdoc.runtime.detect_pattern)
            brk = self._own_break()
            if brk is not None:
                out["brk"] = brk
            h = self._queue_head()  # the calls still on its GPU stream, in order (detect_queue)
            if h is not None:
                out["h"] = h
                qbrk = self._own_break(queued=True)
                if qbrk is not None:
                    out["qbrk"] = qbrk
        if self._ending:  # how: "exit" (the script ended), "raised", "term" (its launcher's SIGTERM)
            from hangdoc.runtime import on_term

            out["end"] = "raised" if self._raised_any else ("term" if on_term.terminating() else "exit")
        return out

    def _own_lock(self, node: Node) -> Optional[Verdict]:
        """While this rank is quiet, once a second: its main thread waiting for a lock it holds
        itself (hangdoc.runtime.detect_lock) is the verdict, certain at once; so are its threads
        waiting for each other's locks in a cycle (hangdoc.runtime.detect_lock_order) and its main
        thread waiting for a child blocked on a lock another thread held at the fork
        (hangdoc.runtime.detect_fork), each once seen twice; and, once it stood long enough while
        another rank waits for this one, its main thread waiting for a DataLoader worker that
        stopped or for a thread that died (hangdoc.runtime.detect_stall)."""
        from hangdoc.runtime import detect_fork, detect_lock, detect_lock_order, detect_stall

        now = time.monotonic()
        if now - node.last_change < QUIET or now - self._lock_at < 1.0:
            return None
        self._lock_at = now
        found = detect_lock.main_thread_deadlock()
        if found is not None:
            return node.claim(detect_lock.verdict(node.rank, found, self.digests, self._describe), now)
        order = detect_lock_order.main_thread_cycle()
        seen, self._lock_order = self._lock_order, (detect_lock_order.key(order) if order is not None else None)
        if order is not None and seen == self._lock_order:
            return node.claim(detect_lock_order.verdict(node.rank, order, self.digests, self._describe), now)
        forked = self._fork_watch.look(now)
        if forked is not None:
            return node.claim(detect_fork.verdict(node.rank, forked, self.digests, self._describe), now)
        stall = self._stall_watch.look(now, detect_stall.wait_asked())
        if stall is not None:
            waiting = detect_stall.waiting_for(node, self.digests)
            if waiting is not None:
                return node.claim(detect_stall.verdict(node.rank, stall, waiting, self.digests, self._describe), now)
        return None

    def _blocked_elsewhere(self, last: Any) -> List[str]:
        """Groups other than that of this rank's latest call in which a call that blocks its host
        thread (synchronous, on no CUDA stream) is still in flight: another thread of the rank waits
        there (a checkpoint thread's barrier on a group of its own), read by the cross-group check
        (hangdoc.runtime.detect_groups). From the recorder's newest record per group."""
        from hangdoc.runtime import recorder

        r = recorder.get()
        if r is None:
            return []
        try:  # an extra of the publication: never the reason it is not made
            newest: Dict[str, Any] = {}
            for rec in list(r._buf)[-4096:]:  # one C-level copy: consistent
                newest[rec[recorder._GROUP][0]] = rec
            return sorted(g for g, rec in newest.items()
                          if g != last and rec[recorder._STATE] == "issued" and not rec[recorder._ASYNC]
                          and rec[recorder._STREAM] is None and not str(rec[recorder._OP]).startswith(("send", "recv")))[:8]
        except Exception:
            return []

    def _own_break(self, queued: bool = False) -> Optional[Dict[str, Any]]:
        from hangdoc.runtime import detect_pattern, detect_queue, recorder

        total = self.digests.total()
        if self._brk[0] != total:
            self._brk = (total, {})
        found = self._brk[1]
        if queued not in found:
            r = recorder.get()
            records = list(r._buf) if r is not None else []  # one C-level copy: consistent
            found[queued] = detect_pattern.own_break(records, self._describe,
                                                     detect_queue.QUEUED if queued else detect_pattern.RECENT)
        return found[queued]

    def _queue_head(self) -> Optional[Dict[str, Any]]:
        from hangdoc.runtime import detect_queue, recorder

        r = recorder.get()
        if r is None or not r._streams:  # no CUDA stream: nothing waits queued on a GPU
            return None
        now, total = time.monotonic(), self.digests.total()
        if self._head[0] != total or now - self._head[1] >= 1.0:
            r._bounded(r._sweep)  # non-blocking queries on a thread of their own, 1 s at most
            self._head = (total, now, detect_queue.head(r._resolved(), self.digests.groups, self._describe,
                                                        self.node.rank if self.node else None, self.digests.p2p_ring))
        return self._head[2]

    def _describe(self, rec: tuple) -> Tuple[str, str]:
        return _describe(rec, self._describe_cache)

    def _tick(self, final: bool = False) -> None:
        with self._tick_lock:
            self._tick_locked(final)

    def _tick_locked(self, final: bool) -> None:
        early, self._early_req = self._early_req, None
        try:
            if self.verdict is not None:
                self._resumed()
                return
            if not self._ready():
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

    def _leaving(self) -> None:
        """The script destroys the default group: its loop ended. Said at once, in one publication
        (``end`` = ``exit``), before a destroy that may block for ever (NCCL's, while other ranks wait
        in a collective this one never issued: hangdoc.runtime.detect_gone names it from that). From a
        thread of its own, waited for FINAL_WAIT seconds at most."""
        if self.verdict is not None:
            self._resumed()
            return
        if not self.digests.total():
            return
        self._ending = True

        def publish() -> None:
            try:
                with self._tick_lock:
                    # a job shorter than the detector's first look has no connection yet: made now
                    end = time.monotonic() + FINAL_WAIT - 0.5
                    while not self._ready() and time.monotonic() < end:
                        time.sleep(0.05)
                    if self.node is not None and self._ready():
                        self.node.publish(time.monotonic(), self.digests.total(), self._make)
            except Exception:
                pass

        t = threading.Thread(target=publish, name="hangdoc-detect-leaving", daemon=True)
        t.start()
        t.join(FINAL_WAIT)

    def _final(self) -> None:
        # A rank that exits (or fails, or gets its launcher's SIGTERM) right after diverging still
        # leaves its last state behind, and reads its partners' until they are there too: a job that
        # dies within a second of a divergence (gloo aborting a rank on a dtype mismatch) may never
        # have published at all. Bounded, so that a store that stopped answering cannot delay the
        # exit for long.
        if self.verdict is not None:
            self._resumed()  # a stall it reported that ended, said before the exit (a short job's last steps)
            return
        if not self.digests.total():
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

    def _resumed(self) -> None:
        """A stall this rank reported of itself (hangdoc.runtime.detect_stall) that ended: it issued a
        call since, and a call of it completed since (a job being killed also moves the main thread
        on: the child of a ``proc.wait()`` dies first, and the next collective, issued, never
        completes). Said once, and written into divergence.json (``resumed_after``): slow, not hung.
        The detector stays finished (one verdict per job), as after any verdict."""
        from hangdoc.runtime import detect_stall

        with self._resume_lock:  # (the daemon's tick and the exit may both look)
            mark, v = self._stall_mark, self.verdict
            if mark is None or v is None or self.digests.total() == mark[0] or detect_stall.completed_calls() <= mark[2]:
                return
            self._stall_mark = None
        v.resumed_after = round(time.monotonic() - mark[1], 1)
        self._write(v)
        self._say(f"hangdoc: RESUMED: {', '.join(f'rank {r}' for r in v.deviants)} went on {v.resumed_after:.0f} s "
                  f"after the stall was reported: slow, not hung (withdrawn: {v.summary})")

    def _write(self, v: Verdict) -> None:
        try:
            from hangdoc.atomic import write_atomic

            os.makedirs(self.out_dir, exist_ok=True)
            write_atomic(os.path.join(self.out_dir, "divergence.json"), json.dumps(v.to_json(), indent=1) + "\n")
        except Exception as e:
            self._say(f"hangdoc detect: divergence.json not written: {type(e).__name__}: {e}")

    def _act(self, v: Verdict, mine: bool) -> None:
        if self.verdict is not None:
            return
        self.verdict = v
        self.fired_at = time.time()
        if mine and v.basis == "stall":  # time-based: withdrawn if the rank goes on (_resumed)
            from hangdoc.runtime import detect_stall

            self._stall_mark = (self.digests.total(), time.monotonic(), detect_stall.completed_calls())
        if mine:
            # the file first: on the way out (a rank's last check while its process exits) the
            # process may end right after, and the file is what stays
            self._write(v)
            self._say(f"hangdoc: DIVERGENCE: {v.summary}")
        if self.policy == "abort" and v.basis != "stall":
            # (a stall is time-based: raising at the stalled rank's next collective would end a job
            # that only was slow, and the others' next collective comes only after that one)
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

        self._raised_any = True
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
