"""Findings from stacks alone: name the hang, name the culprits, say what to do next.

:func:`findings` reads every process's main-thread :class:`~hangdoc.analysis.signatures.Wait` and
returns the verdicts that stacks can support. Stacks show *where* each rank waits, never *which
call* it waits in (a line inside a loop looks the same in every iteration) and never who the
collective's other members are, so every verdict here has a confidence of at most 0.8; the rules
over collective records (``record_rules``) know the exact call and win when records exist.

The rules, in the order they look at a job:

* ``unresponsive-process``: a process whose stack could not be taken, that is stopped, or whose
  dump is cut off; ``missing-rank``: ranks the world size implies but no dump mentions;
* ``rank-failed``: a rank whose main thread ended (Python exiting, held by its other threads)
  while others wait in collectives for it (``ended_stacks``);
* ``dataloader-stall``: a rank waits for a batch while others wait in collectives (for it);
* ``p2p-cycle`` (peers known from ``--locals`` and waiting on each other in a cycle) and
  ``p2p-stall`` (a chain of waits that ends at a rank not sending/receiving, or peers unknown);
  ranks in a collective beside ranks in send/recv with peers unknown (``mixed_stacks``);
* ``collective-mismatch``: ranks in different collectives, the same collective from different
  call sites, or blocked outside any collective while the others wait in one;
* ``collective-wait``: every rank in the same collective at the same place (the hang is below
  Python); ``no-hang``: nobody is waiting on anybody, so nobody is blamed.

Example (a rank that sleeps while the others wait in ``all_reduce``)::

    >>> from hangdoc.model import Frame, Job, Process, Report, Thread
    >>> ar = (Frame("<module>", "train.py", 30), Frame("step", "train.py", 12),
    ...       Frame("all_reduce", "torch/distributed/distributed_c10d.py", 2501))
    >>> sl = (Frame("<module>", "train.py", 30), Frame("step", "train.py", 10),
    ...       Frame("sleep", "", native=True))
    >>> procs = [Process(host="n1", pid=10 + r, rank=r, threads=[Thread("1", "MainThread", sl if r == 2 else ar, is_main=True)])
    ...          for r in range(4)]
    >>> f = findings(Report(job=Job(processes=procs, world_size=4)))[0]
    >>> f.kind, [c.rank for c in f.culprits]
    ('collective-mismatch', [2])
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from hangdoc.analysis.signature_table import ONE_TO_MANY
from hangdoc.analysis.signatures import (
    DISTRIBUTED,
    PLAIN_WAITS,
    Wait,
    in_loop,
    is_launcher_stack,
    wait_of,
)
from hangdoc.model import (
    ROLE_LAUNCHER,
    ROLE_WORKER,
    STATUS_OK,
    STATUS_EXITED,
    STATUS_LOG,
    STATUS_STOPPED,
    STATUS_TRUNCATED,
    Culprit,
    Finding,
    Process,
    Report,
)
from hangdoc.analysis import creation_wait, thread_collectives
from hangdoc.analysis.ended_stacks import EndedRules
from hangdoc.analysis.mixed_stacks import MixedRules
from hangdoc.analysis.normalize import is_pool_worker_stack
from hangdoc.analysis.orphan_waits import OrphanRules
from hangdoc.analysis.p2p_stacks import P2PRules
from hangdoc.analysis.stack_words import _RECORDS_ADVICE, _cap, _culprits, _procs, _s, _sorted, who
from hangdoc.ranges import MAX_LISTED, RankSet
# finding text: long rank lists end in "… and N more" (the culprits keep every rank)
from hangdoc.ranges import describe_ranks_capped as describe_ranks
from hangdoc.tags import DIED_IN_JOB

#: dump formats whose frames say where an exception was raised, not where a live process stands
_NOT_LIVE = frozenset({"traceback", "c10-backtrace"})

#: Stack-only verdicts never claim more than this (record-based rules use 0.9 and more).
MAX_CONFIDENCE = 0.8


def findings(report: Report) -> List[Finding]:
    """Every verdict the stacks of ``report`` support, highest confidence first.

    >>> from hangdoc.model import Job, Report
    >>> findings(Report(job=Job()))
    []
    """
    if report.job.processes and all(p.status == STATUS_LOG for p in report.job.processes):
        return []  # logs alone: no stack to judge
    return _Analysis(report).run()


# --- kinds of process (how they are named: hangdoc.analysis.stack_words) ---------------------------


def _is_launcher(p: Process) -> bool:
    if p.role == ROLE_LAUNCHER:
        return True
    t = p.main_thread
    return p.role == "unknown" and t is not None and is_launcher_stack(t.frames)


def _is_worker(p: Process, w: Optional[Wait]) -> bool:
    return p.role == ROLE_WORKER or (w is not None and w.category == "dataloader-worker")


# --- the analysis --------------------------------------------------------------------------------


class _Bucket:
    """Processes that share one :class:`Wait`: the same interned stack, thread state, status and role.

    The rules work on buckets, not processes: a job of 131,072 ranks has a few dozen buckets, so
    classifying, grouping by place and naming ranks costs per distinct stack, not per process.
    """

    __slots__ = ("wait", "procs", "ok", "worker", "launcher", "_ranks")

    def __init__(self, wait: Wait, ok: bool, worker: bool, launcher: bool) -> None:
        self.wait = wait
        self.procs: List[Process] = []
        self.ok = ok
        self.worker = worker
        self.launcher = launcher
        self._ranks: Optional[List[int]] = None

    @property
    def ranks(self) -> List[int]:
        if self._ranks is None:
            self._ranks = [p.rank for p in self.procs if p.rank is not None]
        return self._ranks


def _buckets(processes: Iterable[Process]) -> List[_Bucket]:
    """Every process in its bucket; :func:`wait_of` runs once per distinct (stack, state, status, role)."""
    by_key: Dict[Tuple, _Bucket] = {}
    for p in processes:
        t = p.main_thread
        frames = t.frames if t is not None else ()
        # Interned stacks: equal raw dumps (locals included) share one tuple, so its id is the stack.
        key: Tuple = (id(frames), t.state if t is not None else None, p.status, p.role)
        b = by_key.get(key)
        if b is None:
            w = wait_of(p) if p.status == STATUS_OK else Wait("unknown")
            # a launcher, or a multiprocessing pool's worker of no rank: they wait for ranks, not with them
            launcher = p.role == ROLE_LAUNCHER or (p.role == "unknown" and t is not None and is_launcher_stack(frames)) \
                or (p.rank is None and t is not None and is_pool_worker_stack(frames))
            # gdb and pystack read a stopped process without noticing; a main thread that sent
            # itself SIGSTOP (os.kill(os.getpid(), SIGSTOP)) says it: the process is stopped
            ok = p.status == STATUS_OK and not _stopped_itself(w)
            b = by_key[key] = _Bucket(w, ok, _is_worker(p, w), launcher)
        if len(p.threads) > 1 and _reads_other_threads(b.wait):
            # wait_of looks at the other threads here (gloo's run loop names the op; a comm thread's
            # collective is what a main thread waiting on its queue waits in): per set of other
            # threads' stacks, so a rank whose comm thread is in another collective is told apart
            # from the ranks that share its main thread's stack.
            k2 = key + tuple(id(o.frames) for o in p.threads if o is not t)
            b2 = by_key.get(k2)
            if b2 is None:
                w = wait_of(p)
                b2 = by_key[k2] = b if w == b.wait else _Bucket(w, b.ok, b.worker, b.launcher)
            b2.procs.append(p)
            continue
        b.procs.append(p)
    # keep the buckets whose only members moved to a per-process bucket out; a bucket may sit under
    # several keys (processes whose other threads differ but read the same): once
    seen = set()
    return [b for b in by_key.values() if b.procs and not (id(b) in seen or seen.add(id(b)))]


def _reads_other_threads(w: Wait) -> bool:
    """Whether :func:`wait_of` may have read (or may read) threads other than the main one."""
    return ((w.category == "host-sync" and w.op == "wait") or w.category in PLAIN_WAITS
            or w.detail.startswith(("on its ", "from the gloo worker thread")))


def _stopped_itself(w: Wait) -> bool:
    return w.category == "sleep" and w.op == "stopped by a signal"


def _status(p: Process, b: _Bucket) -> Tuple[str, str]:
    """A process's status and its detail, with a stack that shows it stopped counted as stopped."""
    if p.status == STATUS_OK and _stopped_itself(b.wait):
        site = b.wait.call_site or b.wait.frame
        where = f" at {site.label()}" if site is not None else ""
        return STATUS_STOPPED, f"its stack shows it sent itself a stop signal{where}"
    return p.status, p.status_detail


def _count(buckets: Iterable[_Bucket]) -> int:
    return sum(len(b.procs) for b in buckets)




class _Analysis(P2PRules, EndedRules, OrphanRules, MixedRules):
    def __init__(self, report: Report) -> None:
        self.report = report
        self.out: List[Finding] = []
        # a process known only from a log has no stack: the log rules speak for it
        buckets = [b for b in _buckets(p for p in report.job.processes if p.status != STATUS_LOG) if not b.launcher]
        self.all_b = buckets
        self.worker_b = [b for b in buckets if b.worker]
        self.rank_b = [b for b in buckets if not b.worker]
        self.ok_b = [b for b in self.rank_b if b.ok]
        self.workers = _procs(self.worker_b)
        self.not_ok = _procs(b for b in buckets if not b.ok)
        self.missing = RankSet.of(report.missing_ranks or ())
        self._wait: Optional[Dict[int, Wait]] = None
        self._by_rank: Optional[Dict[Optional[int], Process]] = None
        self._evidence: Dict[Tuple[int, ...], List[str]] = {}

    @property
    def by_rank(self) -> Dict[Optional[int], Process]:
        if self._by_rank is None:
            self._by_rank = {p.rank: p for b in self.rank_b for p in b.procs if p.rank is not None}
        return self._by_rank

    def w(self, p: Process) -> Wait:
        """The wait of one process (for the rules that follow peers one process at a time)."""
        if self._wait is None:
            self._wait = {id(q): b.wait for b in self.all_b for q in b.procs}
        return self._wait[id(p)]

    def set_apart(self, these: Sequence[_Bucket]) -> Tuple[List[_Bucket], List[_Bucket]]:
        """The usable buckets other than ``these``, and those of them waiting in collectives or p2p."""
        rest = [b for b in self.ok_b if all(b is not t for t in these)]
        return rest, self.in_category(DISTRIBUTED, among=rest)

    def in_category(self, cats: Iterable[str], among: Optional[Sequence[_Bucket]] = None) -> List[_Bucket]:
        cats = set(cats)
        return [b for b in (self.ok_b if among is None else among) if b.wait.category in cats]

    def places(self, buckets: Sequence[_Bucket]) -> List[Tuple[Wait, List[Process], List[_Bucket]]]:
        """Buckets merged by place (category, op, frame, call site), largest first."""
        merged: Dict[Tuple, Tuple[Wait, List[Process], List[_Bucket]]] = {}
        for b in buckets:
            slot = merged.get(b.wait.place(with_line=False))
            if slot is None:
                slot = merged[b.wait.place(with_line=False)] = (b.wait, [], [])
            slot[1].extend(b.procs)
            slot[2].append(b)
        return sorted(merged.values(), key=lambda g: (-len(g[1]), g[0].describe()))

    def who_b(self, buckets: Sequence[_Bucket]) -> str:
        """:func:`who` of the buckets' processes, with each bucket's ranks collected once."""
        if all(len(b.ranks) == len(b.procs) for b in buckets):
            ranks = [r for b in buckets for r in b.ranks]
            return describe_ranks(ranks) if ranks else "no process"
        return who(_procs(buckets))

    def evidence_lines(self, buckets: Sequence[_Bucket]) -> List[str]:
        key = tuple(sorted(id(b) for b in buckets))
        lines = self._evidence.get(key)
        if lines is None:
            lines = self._evidence[key] = _cap([f"{self.who_b(bs)}: {w.describe()}" for w, _, bs in self.places(buckets)],
                                               "places where processes wait")
        return list(lines)

    def evidence_procs(self, procs: Sequence[Process]) -> List[str]:
        """Evidence lines for a few processes (the p2p rules follow peers one process at a time)."""
        groups: Dict[Tuple, Tuple[Wait, List[Process]]] = {}
        for p in procs:
            w = self.w(p)
            groups.setdefault(w.place(with_line=False), (w, []))[1].append(p)
        ordered = sorted(groups.values(), key=lambda g: (-len(g[1]), g[0].describe()))
        return _cap([f"{who(ps)}: {w.describe()}" for w, ps in ordered], "places where processes wait")

    # -- the rules, in order ----------------------------------------------------------------------

    def run(self) -> List[Finding]:
        waiting_dist = self.in_category(DISTRIBUTED)
        explained = self.unresponsive(waiting_dist) | self.missing_ranks(waiting_dist)
        explained |= self.ended()
        explained |= self.orphans()
        if not self.dataloader_stall():
            self.p2p()
            self.mixed()
            self.collectives(explained)
        if not self.out:
            self.no_hang()
        for f in self.out:
            f.confidence = min(f.confidence, MAX_CONFIDENCE)
        return sorted(self.out, key=lambda f: -f.confidence)

    def unresponsive(self, waiting: List[_Bucket]) -> bool:
        others = bool(waiting) and _count(waiting) == _count(self.ok_b)
        by_status: Dict[str, List[Process]] = {}
        status_of: Dict[int, Tuple[str, str]] = {}
        for b in self.all_b:
            if not b.ok:
                for p in b.procs:
                    status_of[id(p)] = st = _status(p, b)
                    by_status.setdefault(st[0], []).append(p)
        exited = _sorted(by_status.pop(STATUS_EXITED, []))
        if exited:
            # every one seen gone before the teardown with no exit dump (rank 0's exit verdict): they
            # failed (killed, aborted in native code) and the others failed after them; else gone
            # before hangdoc dump reached them: no stack, and the likeliest reason for the wait
            died = all(status_of[id(p)][1] == DIED_IN_JOB.replace("_", " ") for p in exited)
            if died:
                kind, conf = "rank-failed", 0.85
                summary = f"{who(exited)} died while the job ran (killed, or aborted in native code)"
                advice = ["Its lines in the job's log say how: `terminate called after throwing ...` (a native abort: "
                          "gloo's and NCCL's checks of sizes and types end so), the exit code or signal in torchrun's "
                          "failure table; `dmesg` on its node for the OOM killer (SIGKILL).",
                          "The other ranks' errors (`Connection closed by peer`, timeouts) are its consequence."]
            else:
                kind, conf = "missing-rank", 0.75 if others else 0.5
                summary = f"{who(exited)} exited before {'it' if len(exited) == 1 else 'they'} could be dumped"
                advice = ["Its log (the last traceback, the exit code in torchrun's failure table) and `dmesg` on its node "
                          "(OOM killer) say why it died; the other ranks wait for it in their next collective.",
                          "If it was restarted (torchrun --max-restarts), the new process has a new pid: dump the node again."]
            details = _cap([(f"{who([p])}: its process ended while the job ran, leaving no dump (no exception of its "
                             "own: killed by a signal, or aborted in native code)" if died else
                             f"{who([p])}: pid {p.pid} on {p.host or '?'} was gone when dumped ({status_of[id(p)][1] or 'exited'})")
                            + (f" [{p.source}:{p.source_line}]" if p.source else "") for p in exited],
                           "failed processes" if died else "exited processes")
            if waiting:
                details += [f"meanwhile {line}" for line in self.evidence_lines(waiting)]
            self.out.append(Finding(kind, summary, _culprits(exited), details, advice, conf))
        for status, procs in sorted(by_status.items()):
            procs = _sorted(procs)
            details = _cap([f"{who([p])}: {status}" + (f" ({status_of[id(p)][1]})" if status_of[id(p)][1] else "")
                            + (f" [{p.source}:{p.source_line}]" if p.source else "") for p in procs], f"{status} processes")
            if waiting:
                details += [f"meanwhile {line}" for line in self.evidence_lines(waiting)]
            if status == STATUS_STOPPED:
                summary = f"{who(procs)} {'is' if len(procs) == 1 else 'are'} stopped (SIGSTOP, a debugger or a frozen node)"
                advice = [f"Resume with `kill -CONT {procs[0].pid or 'PID'}` or detach the debugger; find out who stopped it (job scheduler suspend, `gdb`, a `kill -STOP`).",
                          "While a rank is stopped every collective it belongs to waits for it."]
                conf = 0.8
            elif status == STATUS_TRUNCATED:
                summary = f"the dump of {who(procs)} is cut off"
                advice = ["Take the dump again (the file was cut short: a full disk, a killed dumper, or a process that died while it was dumped).",
                          "If it died, its log and `dmesg` (OOM killer) say why."]
                conf = 0.6 if others else 0.4
            else:
                summary = f"the stack of {who(procs)} could not be taken"
                advice = ["Retry with root rights (`sudo py-spy dump --pid PID`), or `gdb -p PID -batch -ex 'thread apply all bt'`.",
                          "Check `grep State /proc/PID/status`: `D` means stuck in the kernel (driver, filesystem, GPU); `Z` means it died and was not reaped."]
                conf = 0.7 if others else 0.5
            self.out.append(Finding("unresponsive-process", summary, _culprits(procs), details, advice, conf))
        return bool(by_status) or bool(exited)

    def missing_ranks(self, waiting: List[_Bucket]) -> bool:
        if not self.missing:
            return False
        others = bool(waiting) and _count(waiting) == _count(self.ok_b)
        ws = self.report.job.world_size
        summary = f"{describe_ranks(self.missing)} left no dump" + (f" (world size {ws})" if ws else "")
        evidence = [f"dumps cover {self.who_b(self.rank_b)}"] if self.rank_b else []
        if waiting:
            evidence += [f"meanwhile {line}" for line in self.evidence_lines(waiting)]
        advice = ["Check whether it is still running: its log, exit code, `dmesg` on its node (OOM killer), `ps` for its pid.",
                  "If it runs, dump it too (`hangdoc dump` on its node) and aggregate again."]
        if len(self.missing) > MAX_LISTED:
            evidence.append(f"culprits name the first {MAX_LISTED} of the {len(self.missing)} missing ranks; the summary names them all")
        self.out.append(Finding("missing-rank", summary, [Culprit(rank=r) for r in self.missing.first(MAX_LISTED)], evidence, advice,
                                0.7 if others else 0.4))
        return True

    def dataloader_stall(self) -> bool:
        dl_b = self.in_category(["dataloader-wait"])
        if not dl_b:
            return False
        dl = _procs(dl_b)
        others_b = [b for b in self.ok_b if b not in dl_b]
        waiting_b = self.in_category(DISTRIBUTED, others_b)
        pids = {(p.host, p.pid) for p in dl}
        ranks = {p.rank for p in dl if p.rank is not None}
        own: List[Tuple[Process, Wait]] = [
            (q, b.wait) for b in self.worker_b for q in b.procs
            if (q.ppid is not None and (q.host, q.ppid) in pids) or (q.parent_rank is not None and q.parent_rank in ranks)]
        # Workers whose owner is unknown (plain py-spy prints no parent pid, no rank map): on a host
        # where ranks wait for batches they may well be those ranks' workers; shown, not dropped.
        owned = {id(q) for q, _ in own}
        dl_hosts = {p.host for p in dl}
        unowned: List[Tuple[Process, Wait]] = [
            (q, b.wait) for b in self.worker_b for q in b.procs
            if id(q) not in owned and q.ppid is None and q.parent_rank is None and q.host in dl_hosts]
        stuck = [q for q, w in own + unowned if q.status != STATUS_OK or w.detail not in ("idle", "")]
        summary = f"{who(dl)} {'waits' if len(dl) == 1 else 'wait'} for a DataLoader batch at {self._site(dl_b)}"
        if waiting_b:
            n = _count(waiting_b)
            summary += f"; {self.who_b(waiting_b)} {'waits' if n == 1 else 'wait'} in collectives for {'it' if len(dl) == 1 else 'them'}"
        evidence = self.evidence_lines(dl_b + others_b)
        worker_lines = []
        for q, w in sorted(own, key=lambda qw: qw[0].key):
            owner = f" of rank {q.parent_rank}" if q.parent_rank is not None else (f" of pid {q.ppid}" if q.ppid is not None else "")
            worker_lines.append(f"DataLoader worker{owner} ({q.host or '?'} pid {q.pid if q.pid is not None else '?'}): "
                                f"{w.describe() if q.status == STATUS_OK else q.status}")
        for q, w in sorted(unowned, key=lambda qw: qw[0].key):
            worker_lines.append(f"DataLoader worker ({q.host or '?'} pid {q.pid if q.pid is not None else '?'}; its rank is not known, "
                                f"the one waiting for batches on {q.host or 'that host'} is {self._pids([p for p in dl if p.host == q.host])}): "
                                f"{w.describe() if q.status == STATUS_OK else q.status}")
        evidence += _cap(worker_lines, "DataLoader workers")
        if not own and not unowned:
            evidence.append("no DataLoader worker process was dumped, so what the workers are stuck in is not shown")
        advice = [
            "Likely cause: a worker forked while another thread held a lock (logging, a metrics or tokenizer lock) "
            "inherits the held lock and blocks for ever in `__getitem__`; the batch never comes.",
            f"Dump the workers to see it: `py-spy dump --pid` on each child of {self._pids(dl)} (or `hangdoc dump`, which includes them).",
            "Work around: `num_workers=0` for the affected loader (e.g. the validation loader), or "
            "`multiprocessing_context=\"spawn\"` / `\"forkserver\"` so workers do not inherit held locks.",
            "Give the loader a `timeout=` so a lost batch raises instead of hanging the job.",
        ]
        conf = 0.8 if waiting_b else 0.6
        self.out.append(Finding("dataloader-stall", summary, _culprits(dl + stuck), evidence, advice, conf))
        return True

    def collectives(self, explained: bool) -> None:
        dist = self.in_category(["collective", "host-sync"])
        if not dist:
            return
        blocked = self.in_category(list(PLAIN_WAITS) + ["unknown"])
        busy = self.in_category(["compute"])
        places = self.places(dist)
        loop_notes = self._loop_notes(places)
        if len(places) == 1 and not blocked:
            (w, ps, bs), = places
            nb = _count(busy)
            live = all(p.format not in _NOT_LIVE for p in _procs(busy))
            if busy and (not live or 2 * nb >= nb + _count(bs)):
                # as many computing as waiting (a healthy job caught mid-step), or a traceback's
                # frames (where an exception was, not where a process is): nobody to blame
                self.out.append(Finding(
                    "no-hang",
                    f"{self.who_b(busy)} {'is' if nb == 1 else 'are'} computing while {self.who_b(bs)} {_s(ps, 'waits', 'wait')} in {w.describe()}",
                    [],
                    self.evidence_lines(busy + bs) + loop_notes,
                    ["A running job looks like this too: take a second dump a minute later. If the same ranks are still "
                     "computing at the same place, they are stuck there (an endless loop?) and the others wait for them."],
                    0.3,
                ))
                return
            if busy:
                # A few ranks compute while the rest wait for them: whether they loop for ever or are
                # only slow, they hold the job, and are named as such. One dump cannot tell the two
                # apart, so the confidence stays low and the advice says how to.
                self.out.append(Finding(
                    "collective-mismatch",
                    f"{self.who_b(busy)} {'is' if nb == 1 else 'are'} computing outside any collective while "
                    f"{self.who_b(bs)} {_s(ps, 'waits', 'wait')} for {'it' if nb == 1 else 'them'} in {w.describe()}",
                    _culprits(_procs(busy)),
                    self.evidence_lines(busy + bs) + loop_notes,
                    ["One dump cannot tell a loop that never ends from a slow step: take a second dump a minute later. "
                     "If the same ranks are still computing at the same place, they are stuck there (an endless loop, a "
                     "retry that never succeeds); if they moved on, the job is slow, not hung, and they are its stragglers.",
                     "Dump with `--native` (`py-spy dump --native`) to see a C-level wait that Python frames hide.",
                     _RECORDS_ADVICE],
                    0.3,
                ))
                return
            if explained or self.in_category(["p2p"]):
                return  # the unresponsive/missing or p2p findings already say what they wait for
            lines = sorted({b.wait.frame.line for b in bs if b.wait.frame is not None and b.wait.frame.line is not None})
            if len(lines) > 1:
                # Blocked ranks all sit on the one line that waits; other lines mean some are still entering.
                self.out.append(Finding(
                    "no-hang",
                    f"{self.who_b(bs)} {_s(ps, 'is', 'are')} in {w.describe()}, at different lines inside {w.frame.function}: the job looks like it is moving",
                    [],
                    [f"{self.who_b([b for b in bs if b.wait.frame is not None and b.wait.frame.line == n])}: {w.frame.function} line {n}"
                     for n in lines] + loop_notes,
                    ["Take a second dump a minute later: if every rank then sits on the same line of the collective, "
                     "read it as a collective-wait (the hang is below Python)."],
                    0.3,
                ))
                return
            # every one of them has another thread in a collective too; a group creation
            told = thread_collectives.finding(ps, self.who_b(bs)) or creation_wait.finding(self.who_b(bs), w)
            if told is not None:
                self.out.append(told)
                return
            site = w.call_site
            known = in_loop(site.file, site.line) if site and site.file and site.line else None
            looped = known is True
            self.out.append(Finding(
                "collective-wait",
                f"every rank waits in {w.describe()}: the hang is below Python" if known is False or site is None else
                f"every rank waits in {w.describe()}, a call inside a loop: below Python if they are all in the "
                "same iteration, a collective mismatch if some are in another (the stacks cannot tell which)" if looped else
                f"every rank waits in {w.describe()}: the hang is below Python, unless the ranks are in different "
                "iterations of a loop around it (the stacks cannot tell)",
                [],
                [f"{self.who_b(bs)}: {w.describe()}"] + loop_notes + ([
                    "With NCCL, collectives run asynchronously: ranks block at the first host sync after them "
                    f"({w.op}), so the stacks show where the ranks noticed the hang, not which collective hangs; "
                    "the Flight Recorder (`TORCH_NCCL_TRACE_BUFFER_SIZE`) or the collective records show the "
                    "collective each rank is in."] if w.category == "host-sync" else []),
                ([_RECORDS_ADVICE, "Dump with `py-spy dump --locals` (or `hangdoc dump`, which passes it): the group and "
                                   "the step counter in the locals tell the iterations apart."]
                 if looped else []) +
                ["Turn on `NCCL_DEBUG=INFO` (and `NCCL_DEBUG_SUBSYS=COLL,P2P`) to see which rank the collective waits for.",
                 "Run the all-ranks connectivity test in `examples/` on the same nodes to find a bad link or node.",
                 "Isolate GPUs: rerun on subsets of nodes; a slow or dead GPU holds everyone.",
                 "`CUDA_LAUNCH_BLOCKING=1` surfaces asynchronous CUDA errors at the call that caused them."] +
                ([] if looped else [_RECORDS_ADVICE]),
                0.5 if looped else 0.6,
            ))
            return
        self._mismatch(places, blocked, busy, loop_notes)

    def _mismatch(self, places, blocked: List[_Bucket], busy: List[_Bucket], loop_notes: List[str]) -> None:
        evidence = self.evidence_lines([b for _, _, bs in places for b in bs] + blocked + busy)
        detail: List[str] = []  # why the verdict reads as it does: shown with -v
        advice: List[str] = []
        waiting_b = [b for _, _, bs in places for b in bs]
        nw = _count(waiting_b)
        candidates: list = []
        if blocked:
            culprits = _procs(blocked)
            summary = (f"{self.who_b(blocked)} {'is' if len(culprits) == 1 else 'are'} blocked outside any collective "
                       f"({'; '.join(w.describe() for w, _, _ in self.places(blocked))}) while {self.who_b(waiting_b)} "
                       f"{'waits' if nw == 1 else 'wait'} in collectives")
            advice.append("Find out why the blocked ranks wait where they do (a lock held by another thread, a sleep, "
                          "a read from a file or socket): the others wait in the collective for them.")
            conf = 0.7
        else:
            rooted = [(w, ps, bs) for w, ps, bs in places if w.op in ONE_TO_MANY]
            if len(rooted) == 1:
                w, ps, bs = rooted[0]
                moved_b = [b for x, _, qs in places if x is not w for b in qs]
                moved = _procs(moved_b)
                # one of them skipped it and stacks cannot say which: named as candidates, not blamed
                culprits = moved if len(moved) == 1 else []
                candidates = moved if len(moved) > 1 else []
                summary = (f"{self.who_b(bs)} {_s(ps, 'waits', 'wait')} in {w.describe()} while {self.who_b(moved_b)} "
                           f"{_s(moved, 'is', 'are')} in other collectives: "
                           f"{'' if len(moved) == 1 else 'one of '}{self.who_b(moved_b)} never joined the {w.op}")
                detail.append(
                    f"Why not blame the ranks stuck in {w.op}: with gloo, the receivers of a {w.op} return as soon as they "
                    f"have the data while the root still waits for every receiver, so ranks that moved on include the one "
                    f"that skipped it. " + (f"Stacks cannot tell which of {self.who_b(moved_b)} that is; the collective records can."
                                            if len(moved) > 1 else f"Only {self.who_b(moved_b)} moved on, so it is that one."))
                root = w.root
                if root is not None:
                    evidence.append(f"the {w.op} root is rank {root} (from --locals)")
                conf = 0.5
            else:
                sizes = [len(ps) for _, ps, _ in places]
                biggest = max(sizes)
                culprits = [p for _, ps, _ in places if len(ps) < biggest for p in ps] if sizes.count(biggest) < len(sizes) else []
                if not culprits:  # sides of one size: one of them took another path, stacks cannot say which
                    candidates = [p for _, ps, _ in places for p in ps]
                groups = "; ".join(f"{self.who_b(bs)} in {w.describe()}" for w, _, bs in places)
                summary = f"ranks wait in different collectives: {groups}"
                detail.append("Each side waits for the other to join its collective; the side that took a different code path "
                                "is to blame" + (f", most likely the smaller one ({who(culprits)})" if culprits else
                                                 ", and the groups are the same size, so stacks cannot say which"))
                conf = 0.6 if culprits else 0.4
            detail.append("If these ranks belong to different process groups (pipeline stages, tensor-parallel groups), "
                            "different collectives at the same moment can be normal; the collective records settle it.")
            advice.append("Look for a rank-dependent branch around these call sites (`if rank == ...`, an early `continue`/"
                          "`return`, data-dependent loop counts) that lets some ranks skip or add a collective.")
        if busy:
            detail.append(f"{self.who_b(busy)} {'is' if _count(busy) == 1 else 'are'} computing (not blamed: a running rank may just be slow)")
        advice.append(_RECORDS_ADVICE)
        self.out.append(Finding("collective-mismatch", summary, _culprits(culprits), evidence + loop_notes, advice, conf,
                                detail=detail, candidates=_culprits(candidates)))

    def _loop_notes(self, places) -> List[str]:
        notes = []
        for w, ps, bs in places:
            if len(ps) < 2 or w.call_site is None:
                continue
            site = w.call_site
            known = in_loop(site.file, site.line) if site.file and site.line else None
            head = f"{self.who_b(bs)} share the line {site.label()}"
            if known is True:
                head += ", which is inside a loop"
            elif known is None:
                head += "; if it runs in a loop"
            else:
                continue
            notes.append(head + ", stacks cannot tell iterations apart: they may be in different steps. "
                         "Collective records (sequence numbers), step markers (watchdog `step()`, NicerTrace) or "
                         "`--locals` of the step counter would.")
        return notes

    def no_hang(self) -> None:
        if not self.ok_b:
            return
        busy = self.in_category(["compute"])
        local = [b for b in self.ok_b if b not in busy]
        if local:
            n = _count(local)
            summary = f"no distributed hang signature: {self.who_b(local)} {'waits' if n == 1 else 'wait'} locally, not on other ranks"
        else:
            summary = "no hang signature: every process is busy"
        self.out.append(Finding(
            "no-hang",
            summary,
            [],
            self.evidence_lines(self.ok_b),
            ["If the job is stuck anyway, take dumps again a minute later and compare: ranks that stay at the same "
             "place are the ones to look at.", "Dump with `--native` to see C-level waits (a lock, `cudaStreamSynchronize`) that Python frames hide."],
            0.3,
        ))

    @staticmethod
    def _site(buckets: Sequence[_Bucket]) -> str:
        sites = sorted({(b.wait.call_site or b.wait.frame).label() for b in buckets
                        if (b.wait.call_site or b.wait.frame) is not None})
        return ", ".join(sites) if sites else "an unknown place"

    @staticmethod
    def _pids(procs: Sequence[Process]) -> str:
        pids = [str(p.pid) for p in _sorted(procs) if p.pid is not None]
        return ("pid " + ", ".join(pids)) if pids else "the rank"
