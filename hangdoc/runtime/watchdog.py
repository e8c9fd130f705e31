"""The no-progress watchdog: when a rank stops making progress, it dumps its own stacks.

Progress is a completed collective (the recorder's ``progress`` counter), a :func:`step` marker or
a :func:`heartbeat`. A daemon thread looks at it a few times a second; after ``hang_timeout``
seconds without any, it writes ``stacks-{host}-r{rank}-{pid}.txt`` (a ``hangdoc.tags`` line, then
``faulthandler`` output of every thread) and the recorder's records into the output directory, and
(``report=True``) shares them with the other ranks through the job's store so that the lowest live
rank prints the verdict (see :mod:`hangdoc.runtime.exchange`). Once per stall, and again when the
stall has lasted 4x, 16x, ... as long if it persists. Nothing is ever killed. Until the first
progress the deadline is ``max(hang_timeout, 60 s)``: importing torch and meeting the other ranks
is not a hang.

faulthandler is used because it is written in C: it reads the other threads' frames without
taking the GIL-dependent locks a Python-level ``traceback`` would need, so it works while the main
thread sits inside a C++ collective. For the same reason a signal dump (``SIGUSR1`` by default)
goes through ``faulthandler.register``: a Python signal handler would only run once the main
thread returned from C++, that is never. faulthandler writes into a file the daemon thread
watches; when it grows, the daemon adds the tag line and the records.

    >>> import tempfile, hangdoc.runtime.watchdog as wd
    >>> dog = wd.start(hang_timeout=60, out_dir=tempfile.mkdtemp(), record=False, report=False)
    >>> wd.step()          # progress: a training step ended
    >>> paths = wd.dump_now("example")   # the stacks file first, then the records file if any
    >>> open(paths[0]).readline().startswith("# hangdoc process host=")
    True
    >>> wd.stop()

In a job, ``hangdoc.wrap(main, hang_timeout=300)`` or ``python -m hangdoc --hang-timeout 300``
starts it for you.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional, Tuple, Union

from hangdoc.runtime import dump_files, signal_file
from hangdoc.runtime.dump_files import faulthandler_text as _faulthandler_text, write_file as _write_file
from hangdoc.runtime.options import signal_number
from hangdoc.runtime.signal_file import SIGNAL_ENV

# Bumped by step()/heartbeat(); a bare int increment so that calling them costs nothing measurable
# (and nothing at all beyond that when no watchdog runs).
_beats = 0
_steps = 0

_lock = threading.Lock()
_current: Optional["Watchdog"] = None

#: environment variable set while a watchdog runs: the name of its dump signal (children and
#: ``hangdoc dump`` use it).


def step() -> None:
    """Mark the end of a training step: progress for the watchdog.

    >>> step()
    """
    global _beats, _steps
    _beats += 1
    _steps += 1


def heartbeat() -> None:
    """Tell the watchdog this rank is alive and progressing (a long phase without collectives).

    >>> heartbeat()
    """
    global _beats
    _beats += 1


def get() -> Optional["Watchdog"]:
    """The running watchdog, or None."""
    return _current


#: with ``--hang-timeout auto``: a stall is this many times the longest pause seen so far (the
#: safety factor nvidia-resiliency-ext's estimated timeouts use is of this order)
AUTO_FACTOR = 3.0
#: with ``--hang-timeout auto`` and no floor given
AUTO_FLOOR = 60.0


def parse_hang_timeout(value: Union[float, str]) -> Tuple[bool, float]:
    """``(auto, seconds)`` from ``300``, ``"300"``, ``"auto"`` or ``"auto:30"`` (the floor).

    >>> parse_hang_timeout("auto:8"), parse_hang_timeout("auto"), parse_hang_timeout(300)
    ((True, 8.0), (True, 60.0), (False, 300.0))
    """
    auto = isinstance(value, str) and value.strip().lower().startswith("auto")
    if auto:
        rest = str(value).strip()[4:].lstrip(":") or str(AUTO_FLOOR)
    else:
        rest = value
    try:
        seconds = float(rest)
    except (TypeError, ValueError):
        raise ValueError(f"hang_timeout must be seconds, 'auto' or 'auto:SECONDS', got {value!r}") from None
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"hang_timeout must be > 0, got {value!r}")
    return auto, seconds


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


def thread_id_hex(ident: int) -> str:
    """A thread id the way faulthandler prints it (``0x00007f...``), for the ``main_thread`` tag."""
    return "0x%0*x" % (2 * 8 if sys.maxsize > 2**32 else 2 * 4, ident)


class Watchdog:
    """One per process; use :func:`start` / :func:`stop` rather than this class."""

    def __init__(
        self,
        hang_timeout: Union[float, str],
        out_dir: Optional[str] = None,
        signum: Union[int, str, None] = signal.SIGUSR1,
        report: bool = True,
        record: bool = True,
        redump_factor: float = 4.0,
        startup_grace: float = 60.0,
    ) -> None:
        #: ``hang_timeout="auto"`` (or ``"auto:FLOOR"``): the limit is learnt from the job's own pauses
        self.auto, floor = parse_hang_timeout(hang_timeout)
        self.hang_timeout = floor
        #: the longest time between two progress events seen so far (a checkpoint, an evaluation)
        self.longest_gap = 0.0
        #: what the last stall report said, until progress retracts it (hangdoc.runtime.retract)
        self.reported: Optional[Dict[str, Any]] = None
        from hangdoc.runtime.options import output_dir

        self.out_dir = output_dir(out_dir, create=False)
        self.signum = signal_number(signum)
        self.report = report
        self.record = record
        self.redump_factor = redump_factor
        # Until the first progress the process is still importing torch and meeting the other
        # ranks: that can take longer than a short timeout without being a hang.
        self.startup_grace = max(self.hang_timeout, startup_grace)
        self._peer_look = 0.0  # when _others_stalled may look at the store again
        self._armed = False
        # Often enough that the dump comes well within the 5 s budget after the timeout, rarely
        # enough that the thread costs nothing: at most 4 wake-ups a second.
        self.poll = min(0.25, max(0.02, self.hang_timeout / 20))
        #: number of stalls seen so far (a stall ends with the next progress).
        self.stalls = 0
        #: paths written by the last dump.
        self.last_paths: Tuple[str, ...] = ()
        #: the last dump's files by name, written or not (what the exchange shares)
        self.last_files: Dict[str, str] = {}
        #: why the output directory could not be made at start (the dumps then live in memory)
        self.no_files = ""
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._seen: Any = None
        self.last_progress = time.monotonic()
        self.last_progress_wall = self.started_wall = time.time()
        self._stalled = False
        self._next_dump = 0.0
        self._sig_file: Any = None
        self._sig_offset = 0
        #: the Python-level handler of the dump signal when faulthandler took it over; another one
        #: later means the job installed its own (see _check_displaced)
        self._sig_before: Any = None
        self._displaced = False
        self._recorder: Any = None
        self._errors = 0
        self._store_ready = False

    # -- life cycle -------------------------------------------------------------------------
    def start(self) -> "Watchdog":
        try:
            os.makedirs(self.out_dir, exist_ok=True)
        except OSError as e:
            # read-only, or a file where the directory should be: no files, but the watchdog, the
            # recorder and the exchange still work, and the verdict is still printed
            self.no_files = f"{self.out_dir}: {e.strerror or e}"
        if self.record:
            self._recorder = _enable_recorder(self.out_dir)
        if self.signum is not None:
            self._register_signal()
        self.thread_errors: List[str] = []
        self._excepthook = dump_files.keep_thread_errors(self.thread_errors)
        if self.report and not self.no_files:
            from hangdoc.runtime import fatal
            from hangdoc.runtime.identity import identity

            ident = identity()
            # the Python stack of a native abort (gloo's mismatch checks, a segfault) into the output directory
            fatal.arm(self.out_dir, ident.host, ident.rank)
        if self.report:
            from hangdoc.runtime import on_term

            on_term.install(self._on_term)  # rank 0's verdict of a job failing before any stall
            # what the exit paths import, imported now in this thread: a raising main thread and
            # the SIGTERM thread importing the same modules at once got "cannot import name
            # 'defang' from partially initialized module 'hangdoc.tags'" and no verdict (and a
            # SIGTERM inside the raising thread's import of hangdoc.runtime.exchange, for _say, once
            # deadlocked it with the SIGTERM thread importing it too: see hangdoc.runtime.on_term)
            import traceback  # noqa: F401

            import hangdoc.atomic  # noqa: F401
            import hangdoc.collect  # noqa: F401
            import hangdoc.proctree  # noqa: F401
            import hangdoc.runtime.exchange  # noqa: F401
            import hangdoc.runtime.exit_verdict  # noqa: F401
            import hangdoc.runtime.siblings  # noqa: F401
            import hangdoc.tags  # noqa: F401
        self._seen = self._progress()
        self._thread = threading.Thread(target=self._run, name="hangdoc-watchdog", daemon=True)
        self._thread.start()
        return self

    def _on_term(self) -> None:
        from hangdoc.runtime import exit_verdict, fatal

        try:
            exit_verdict.at_exit(self, "SIGTERM from the launcher")
        finally:
            fatal.disarm()  # SIGTERM ends the process with no atexit: no empty fatal file left behind

    def stop(self) -> None:
        self._stop.set()
        dump_files.release_thread_errors(getattr(self, "_excepthook", None))
        if self.report:
            from hangdoc.runtime import fatal, on_term

            on_term.uninstall(self._on_term)
            fatal.disarm()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=2 * self.poll + 1)
        if self._stalled and self._progress() != self._seen:
            # the job went on and ended between two looks: the stall resolved all the same
            self._stalled = False
            waited = time.monotonic() - self.last_progress
            _say("hangdoc watchdog: progress again after %.1fs; the stall is over" % waited)
            self._recovered(waited)
        if self._sig_file is not None:
            if not self._displaced:
                # (once the job has its own handler, unregistering would put SIG_DFL back over it)
                try:
                    faulthandler.unregister(self.signum)
                except Exception:
                    pass
            name = self._sig_file.name
            try:
                self._sig_file.close()
                os.unlink(name)
            except OSError:
                pass
            self._sig_file = None
            if os.environ.get(SIGNAL_ENV) == _signal_name(self.signum):
                os.environ.pop(SIGNAL_ENV, None)

    def _register_signal(self) -> None:
        name = _signal_name(self.signum)
        # Chain only to a real handler: faulthandler "chains" by restoring the previous action and
        # re-raising, which for SIG_DFL of SIGUSR1 would terminate the job.
        previous = signal.getsignal(self.signum)
        chain = previous not in (signal.SIG_DFL, signal.SIG_IGN, None)
        # A signal the job handles itself (SLURM's SIGUSR1 before preemption, say) still dumps when
        # someone sends it, and the job's handler still runs; but ``hangdoc dump`` must not send it
        # just to read stacks: the file's name ("-shared-") keeps it from finding this process.
        self._sig_file = signal_file.create(name, shared=chain)
        faulthandler.register(self.signum, file=self._sig_file, all_threads=True, chain=chain)
        self._sig_before = previous
        os.environ[SIGNAL_ENV] = name

    def _check_displaced(self) -> None:
        """The job installed its own handler for the dump signal after us (``signal.signal``):
        faulthandler no longer sees the signal. Step aside: rename the file so ``hangdoc dump``
        does not send the job's signal for stacks, and leave the handler alone at stop."""
        if self._sig_file is None or self._displaced:
            return
        now = signal.getsignal(self.signum)
        if now is self._sig_before or now == self._sig_before:
            return
        self._displaced = True
        signal_file.step_aside(self._sig_file)
        if os.environ.get(SIGNAL_ENV) == _signal_name(self.signum):
            os.environ.pop(SIGNAL_ENV, None)
        _say(f"hangdoc watchdog: the job set its own {_signal_name(self.signum)} handler; "
             f"no signal dumps from now on (choose another signal with --dump-signal)")

    # -- progress ---------------------------------------------------------------------------
    def _progress(self) -> Tuple[int, int]:
        rec = self._recorder
        progress = 0
        if rec is not None:
            try:
                progress = int(rec.progress)
            except Exception:
                progress = 0
        return (_beats, progress)

    def _run(self) -> None:
        if self._sig_file is not None:
            # here, not in start(): a crowded /tmp must not delay the job
            try:
                signal_file.remove_stale()
            except Exception:
                pass
        while not self._stop.wait(self.poll):
            try:
                self._tick()
            except Exception as e:  # the watchdog must never take the job down
                self._errors += 1
                if self._errors <= 3:
                    _say(f"hangdoc watchdog: {type(e).__name__}: {e}")

    def _tick(self) -> None:
        now = time.monotonic()
        seen = self._progress()
        if seen != self._seen:
            self._seen = seen
            previous = self.last_progress
            self.last_progress = now
            self.last_progress_wall = time.time()
            rec_last = getattr(self._recorder, "last_progress", None)
            if isinstance(rec_last, float) and now - self.poll <= rec_last <= now:
                # the recorder knows the completion time more precisely than our polling does
                self.last_progress_wall -= now - rec_last
                self.last_progress = rec_last
            if self._armed:
                self.longest_gap = max(self.longest_gap, self.last_progress - previous)
            self._armed = True
            if self._stalled:
                self._stalled = False
                _say("hangdoc watchdog: progress again after %.1fs; the stall is over" % (now - previous))
                self._recovered(now - previous)
        for step in (self._check_signal_file, self._check_displaced):
            try:  # a signal-file problem must never keep the stall check below from running
                step()
            except Exception as e:
                self._errors += 1
                if self._errors <= 3:
                    _say(f"hangdoc watchdog: {type(e).__name__}: {e}")
        if self.report and not self._stalled and not self._store_ready:
            from hangdoc.runtime import exchange

            exchange.prepare()
            self._store_ready = exchange.prepared()
        limit = self.limit() if self._armed else self.startup_grace
        if not self._armed and not self._stalled and now - self.last_progress >= self.hang_timeout \
                and now >= self._peer_look and self._others_stalled():
            # no call of this rank ever completed (still its startup grace), and another rank has
            # reported a stall: the job is past its start, this rank is stuck in its first call
            # (a broadcast from a root nobody else names); its stacks belong in that report
            limit = self.hang_timeout
        if not self._stalled and now - self.last_progress >= limit:
            self._stalled = True
            self.stalls += 1
            # again when the stall has lasted 4x as long, then 16x, ...: a job left hung overnight
            # logs a handful of reports, not thousands
            self._next_dump = self.last_progress + self.redump_factor * (now - self.last_progress)
            self._on_stall("no progress for %.1fs" % (now - self.last_progress))
        elif self._stalled and now >= self._next_dump:
            waited = now - self.last_progress
            self._next_dump = self.last_progress + self.redump_factor * waited
            self._on_stall("still no progress after %.1fs" % waited)

    def _others_stalled(self) -> bool:
        """Whether rank 0, or a rank that took the report over, has posted a stall to the job's
        store (looked at once a second at most, only while this rank has never made progress)."""
        self._peer_look = time.monotonic() + 1.0
        if not self.report or not self._store_ready:
            return False
        try:
            from hangdoc.runtime import exchange
            from hangdoc.runtime.identity import identity

            store = exchange.job_store()
            if store is None:
                return False
            keys = [exchange.CLAIM] + ([exchange.KEY.format(rank=0)] if identity().rank != 0 else [])
            return any(exchange.has_key(store, k) for k in keys)
        except Exception:
            return False

    def limit(self) -> float:
        """Seconds without progress that make a stall: ``hang_timeout``, or with ``auto``
        ``AUTO_FACTOR`` times the longest pause the job made so far, never below the floor."""
        if self.auto:
            return max(self.hang_timeout, AUTO_FACTOR * self.longest_gap)
        return self.hang_timeout

    def _on_stall(self, reason: str) -> None:
        paths = self.dump_now(reason)
        if self.report:  # written or not: the dump is in last_files
            from hangdoc.runtime import exchange

            exchange.share(self, paths, reason)

    def _recovered(self, waited: float) -> None:
        if self.report:
            try:
                from hangdoc.runtime import exchange, retract

                exchange.withdraw(self)
                retract.retract(self, waited, exchange.say)
            except Exception:
                pass

    # -- signal dumps -----------------------------------------------------------------------
    def _check_signal_file(self) -> None:
        f = self._sig_file
        if f is None:
            return
        size = os.fstat(f.fileno()).st_size
        if size <= self._sig_offset:
            return
        # faulthandler writes from inside the signal handler; give it a moment to finish
        for _ in range(20):
            time.sleep(0.01)
            again = os.fstat(f.fileno()).st_size
            if again == size:
                break
            size = again
        # through the open descriptor, not the name: a tmp cleaner (or another namespace's
        # watchdog) may have removed the name, faulthandler still writes into the file
        text = os.pread(f.fileno(), size - self._sig_offset, self._sig_offset).decode("utf-8", "replace")
        self._sig_offset = size
        self._write_dump(f"signal {_signal_name(self.signum)}", text)

    # -- dumps ------------------------------------------------------------------------------
    def dump_now(self, reason: str = "requested") -> Optional[Tuple[str, ...]]:
        """Write this process's stacks and records now; returns the paths written.

        Safe from any thread; the stacks come from faulthandler (all threads).
        """
        return self._write_dump(reason, None)

    def raised(self, exc: BaseException) -> None:
        """The job's main function raised: dump the traceback with the records and post it to the
        job's store, so that the report of the stall this leaves the other ranks in names this rank
        and its exception (a non-daemon thread may keep the process alive, or it may never post
        again). Never raises."""
        import traceback

        from hangdoc.runtime import on_term

        if self._stalled:
            # Raised while the stall it dumped still holds: the job's teardown, most likely (the
            # launcher's SIGTERM killed a DataLoader worker the rank waited for; a timeout; NCCL's
            # abort). The stall's dump is the evidence: a raise dump over it made the teardown's
            # error the headline (`dataloader_getitem` read as rank-failed).
            _say(f"hangdoc watchdog: raised {type(exc).__name__} during the stall it reported (the job's teardown, "
                 f"most likely); the stall's dump stands")
            return
        # the launcher's SIGTERM to every rank, sent as soon as one fails, waits for this dump
        with on_term.holding():
            try:
                text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
                reason = f"raised {type(exc).__name__}"
                from hangdoc.runtime.identity import identity

                # the traceback, then the threads as a block of their own under the same tag line (a
                # traceback and a thread dump run together read as two processes)
                self._write_dump(reason, text + "\n" + _tag_line(identity(), reason, self) + "\n" + _faulthandler_text())
                if self.report:
                    from hangdoc.runtime import exchange

                    exchange.post(self, reason)
            except Exception as e:
                _say(f"hangdoc watchdog: could not post the exception: {type(e).__name__}: {e}")
            if self.report:
                from hangdoc.runtime import exit_verdict

                exit_verdict.at_exit(self, f"this rank raised {type(exc).__name__}", raised=True)

    def _write_dump(self, reason: str, traceback_text: Optional[str]) -> Tuple[str, ...]:
        """Take the dump (stacks, records) into :attr:`last_files`, then write it; returns the paths
        written. A file that cannot be written (a full disk, an output directory that is read-only
        or no directory) is said once and kept in memory: the exchange shares it from there."""
        from hangdoc.runtime.identity import identity
        from hangdoc.runtime.options import file_name

        ident = identity()
        tag = _tag_line(ident, reason, self)
        if traceback_text is None:
            traceback_text = _faulthandler_text()
            errors = list(getattr(self, "thread_errors", ()))
            if errors:  # the tracebacks, then the threads as a block of their own under the tag line
                traceback_text = "\n".join(errors) + "\n" + tag + "\n" + traceback_text
        files = {file_name("stacks", ident): tag + "\n" + traceback_text}
        rec = self._recorder
        if rec is not None:
            try:
                files[os.path.basename(rec.default_path())] = rec.dump_text()
            except Exception as e:
                _say(f"hangdoc watchdog: could not dump records: {type(e).__name__}: {e}")
        self.last_files = files
        paths, failed = [], []
        for name, text in files.items():
            path = os.path.join(self.out_dir, name)
            try:
                _write_file(self.out_dir, path, text)
            except OSError as e:
                failed.append(f"{name} ({e.strerror or e})")
                continue
            paths.append(path)
            if name.startswith("collectives-") and rec is not None:
                rec.dumped_to = path  # the exit dump rewrites it whole
        self.last_paths = tuple(paths)
        if failed:
            _say(f"hangdoc watchdog: {reason}; cannot write {', '.join(failed)} in {self.out_dir}: "
                 "kept in memory for the report" + (f"; wrote {', '.join(paths)}" if paths else ""))
        else:
            _say(f"hangdoc watchdog: {reason}; wrote {', '.join(self.last_paths)}")
        return self.last_paths


def _after_fork_in_child() -> None:
    # A forked child (a DataLoader worker) has no watchdog thread; without this it would still
    # answer the dump signal by writing into its parent's signal file.
    global _current
    dog, _current = _current, None
    if dog is not None and dog._sig_file is not None:
        try:
            if not dog._displaced:
                faulthandler.unregister(dog.signum)
        except Exception:
            pass
        dog._sig_file = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _tag_line(ident: Any, reason: str, dog: Optional[Watchdog]) -> str:
    from hangdoc.tags import format_tag

    fields = dict(
        host=ident.host,
        pid=ident.pid,
        rank=ident.rank,
        local_rank=ident.local_rank,
        world_size=ident.world_size,
        ppid=os.getppid(),
        main_thread=thread_id_hex(threading.main_thread().ident or 0),
        source="watchdog",
        reason=reason.replace(" ", "_"),
        step=_steps,
    )
    if dog is not None:
        fields["last_progress"] = "%.3f" % dog.last_progress_wall
    fields["time"] = "%.3f" % time.time()  # when the stacks were taken: records after it show the job went on
    return format_tag(**fields)


def _enable_recorder(out_dir: str) -> Any:
    try:
        from hangdoc.runtime import recorder
    except ImportError:
        return None
    try:
        return recorder.enable(out_dir=out_dir)
    except Exception as e:
        _say(f"hangdoc watchdog: recorder not enabled: {type(e).__name__}: {e}")
        return None


def _say(message: str) -> None:
    """One line to stderr without Python's stream locks (the main thread may hold them forever),
    with the ``[host:rank]`` prefix unless hangdoc's output prefixing adds it anyway."""
    from hangdoc.runtime.exchange import say

    try:
        from hangdoc.runtime.identity import identity

        ident = identity()
    except Exception:  # no prefix rather than no message
        ident = None
    say(message, ident)


def start(
    hang_timeout: Union[float, str],
    out_dir: Optional[str] = None,
    signum: Union[int, str, None] = signal.SIGUSR1,
    report: bool = True,
    record: bool = True,
) -> Watchdog:
    """Start the watchdog of this process (idempotent: a running one is stopped and replaced).

    ``signum=None`` disables signal dumps; ``record=False`` leaves the recorder off (progress is
    then only :func:`step` / :func:`heartbeat`); ``report=False`` skips the cross-rank report.
    """
    global _current
    with _lock:
        if _current is not None:
            _current.stop()
        _current = Watchdog(hang_timeout, out_dir, signum=signum, report=report, record=record).start()
        return _current


def stop() -> None:
    """Stop the running watchdog, if any; unregisters its signal."""
    global _current
    with _lock:
        if _current is not None:
            _current.stop()
            _current = None


def dump_now(reason: str = "requested") -> Optional[Tuple[str, ...]]:
    """Dump this process's stacks (and records) now, with or without a running watchdog.

    Without one, writes into the default output directory.
    """
    dog = _current
    if dog is None:
        dog = Watchdog(1.0, None, signum=None, report=False, record=False)
        try:
            from hangdoc.runtime import recorder

            dog._recorder = recorder.get()
        except ImportError:
            pass
    return dog.dump_now(reason)
