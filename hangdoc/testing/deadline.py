"""A per-rank deadline for ranks that run one after another in this process (the ``fake`` backend).

In-process ranks run in pytest's own main thread, so a rank that never returns (a loop waiting for
data the fake group never delivers, an ``Event`` nobody sets) would hang the whole session. A
watchdog thread gives each rank ``timeout`` seconds; when they pass it

1. takes the stacks of the main thread and of every thread started since the test began,
2. kills every process started since the test began (the rank may be waiting for one of them),
3. interrupts the main thread: a signal whose handler raises :class:`RankTimeout` (a
   ``BaseException``, so the test's ``except Exception`` does not swallow it), sent again every
   fraction of a second until the rank is left,
4. and if the main thread is still in the rank ``grace`` seconds later (blocked in C code that
   never returns to the interpreter), hands the report to ``on_stuck``: the plugin prints it and
   ends the pytest process, the one way left not to hang.

    >>> import time
    >>> deadline = RankDeadline(timeout=0.2)
    >>> with deadline:
    ...     try:
    ...         with deadline.rank(3):
    ...             time.sleep(30)
    ...     except RankTimeout:
    ...         pass
    >>> deadline.hung.rank, deadline.hung.threads[0].name, deadline.hung.threads[0].frames[-1].name
    (3, 'MainThread', '<module>')
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional, Set, Tuple

#: the signal that interrupts the main thread (hangdoc's watchdog uses SIGUSR1, pytest-timeout SIGALRM).
SIGNAL = signal.SIGUSR2
#: how often the interruption is repeated while the rank does not leave.
RESEND_EVERY = 0.25

#: frames of the test runner itself, above the test function: left out of the stacks.
_RUNNER_FRAME = re.compile(r"[/\\](_pytest|pluggy|pytest)[/\\]|[/\\]hangdoc[/\\]testing[/\\]|<frozen runpy>")


class RankTimeout(BaseException):
    """Raised in the main thread when the running in-process rank outlived its deadline."""


@dataclass
class ThreadStack:
    name: str
    #: outermost first, as in a Python traceback.
    frames: List[traceback.FrameSummary]


@dataclass
class Hang:
    """What the watchdog saw when ``rank`` ran past the deadline."""

    rank: int
    timeout: float
    #: the main thread (the rank) first, then threads started since the test began.
    threads: List[ThreadStack]
    #: ``(pid, command line)`` of each process started since the test began, killed.
    killed: List[Tuple[int, str]] = field(default_factory=list)
    #: the main thread did not leave the rank after the interruption (blocked outside Python).
    stuck: bool = False
    #: set by the caller: the rank issued more calls than the recorder holds (at least this many).
    records_wrapped: int = 0


class RankDeadline:
    """Arm with ``with deadline.rank(r):`` around each rank's run, inside ``with deadline:``."""

    def __init__(self, timeout: float, grace: float = 5.0, on_stuck: Optional[Callable[[Hang], None]] = None,
                 test_code=None) -> None:
        self.timeout = float(timeout)
        self.grace = float(grace)
        self.on_stuck = on_stuck
        self.test_code = test_code
        self.hung: Optional[Hang] = None
        self._cond = threading.Condition()
        self._armed: Optional[int] = None
        self._armed_at = 0.0
        self._fired = False
        self._stop = False
        self._thread: Optional[threading.Thread] = None
        self._target = 0
        self._previous = None
        self._installed = False
        self._threads_before: Set[int] = set()
        self._children_before: Set[int] = set()

    # -- life cycle ------------------------------------------------------------------------------

    def __enter__(self) -> "RankDeadline":
        self._target = threading.get_ident()
        self._threads_before = set(sys._current_frames())
        self._children_before = set(_children())
        if threading.current_thread() is threading.main_thread():
            try:
                self._previous = signal.signal(SIGNAL, self._on_signal)
                self._installed = True
            except (ValueError, OSError):  # pragma: no cover - no signals here: async exceptions only
                self._installed = False
        self._thread = threading.Thread(target=self._watch, name="hangdoc-rank-deadline", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        with self._cond:
            self._stop = True
            self._armed = None
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=self.grace + 5)
        if self._installed:
            try:
                if signal.getsignal(SIGNAL) == self._on_signal:
                    signal.signal(SIGNAL, self._previous if self._previous is not None else signal.SIG_DFL)
            except (ValueError, OSError):  # pragma: no cover
                pass
            self._installed = False

    def kill_new_processes(self) -> List[Tuple[int, str]]:
        """Kill the subtree of every child started since :meth:`__enter__` (in sessions of their
        own too); what was killed. The plugin calls it after every in-process run, passed or not."""
        return _kill_new_processes(self._children_before)

    @contextlib.contextmanager
    def rank(self, rank: int) -> Iterator[None]:
        """The deadline of ``rank``: ``timeout`` seconds from now."""
        with self._cond:
            self._armed, self._armed_at, self._fired = rank, time.monotonic(), False
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._armed = None
                self._cond.notify_all()

    # -- the watchdog thread ---------------------------------------------------------------------

    def _watch(self) -> None:
        while True:
            with self._cond:
                if self._stop:
                    return
                if self._armed is None:
                    self._cond.wait()
                    continue
                rank, left = self._armed, self._armed_at + self.timeout - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
            hang = self._snapshot(rank)
            hang.killed = _kill_new_processes(self._children_before)
            self.hung = hang
            self._fired = True
            self._interrupt_until_left(rank)
            return  # one hang per test: the ranks after it do not run

    def _interrupt_until_left(self, rank: int) -> None:
        given_up = time.monotonic() + self.grace
        while True:
            with self._cond:
                if self._armed != rank or self._stop:
                    return
            if time.monotonic() >= given_up:
                assert self.hung is not None
                self.hung.stuck = True
                if self.on_stuck is not None:
                    self.on_stuck(self.hung)
                return
            self._interrupt()
            with self._cond:
                self._cond.wait(RESEND_EVERY)

    def _interrupt(self) -> None:
        # A signal wakes the main thread from sleep(), lock and I/O waits; its handler raises.
        if self._installed and signal.getsignal(SIGNAL) == self._on_signal:
            try:
                signal.pthread_kill(self._target, SIGNAL)
                return
            except (OSError, ValueError):  # pragma: no cover
                pass
        # The test replaced the handler, or this is not the main thread: an asynchronous
        # exception, raised at the target thread's next bytecode (it does not end a sleep).
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._target), ctypes.py_object(RankTimeout))

    def _on_signal(self, signum, frame) -> None:
        if self._fired and self._armed is not None:
            raise RankTimeout(f"rank {self._armed} did not finish within {self.timeout:g} s")
        previous = self._previous
        if callable(previous):
            previous(signum, frame)

    def _snapshot(self, rank: int) -> Hang:
        frames = sys._current_frames()
        threads = [ThreadStack("MainThread" if self._target == threading.main_thread().ident else "test thread",
                               self._trim(frames.get(self._target)))]
        names = {t.ident: t.name for t in threading.enumerate()}
        me = threading.get_ident()
        for ident, frame in frames.items():
            if ident in self._threads_before or ident in (me, self._target):
                continue
            threads.append(ThreadStack(names.get(ident, f"thread {ident:#x}"), _extract(frame)))
        return Hang(rank, self.timeout, threads)

    def _trim(self, frame) -> List[traceback.FrameSummary]:
        """The main thread's frames from the test function in: pytest's own frames are noise."""
        if frame is None:
            return []
        pairs = list(traceback.walk_stack(frame))[::-1]  # outermost first
        start = next((i for i, (f, _) in enumerate(pairs) if f.f_code is self.test_code), None)
        if start is not None:
            pairs = pairs[start:]
        stack = traceback.StackSummary.extract(iter(pairs))
        if start is None:
            stack = [s for s in stack if not _RUNNER_FRAME.search(s.filename)]
        return list(stack)


def _extract(frame) -> List[traceback.FrameSummary]:
    stack = traceback.StackSummary.extract(reversed(list(traceback.walk_stack(frame))))
    return [s for s in stack if not s.filename.endswith("threading.py")]


def format_threads(hang: Hang) -> str:
    """The stacks of ``hang`` as Python prints them, most recent call last."""
    blocks = []
    for t in hang.threads:
        body = "".join(traceback.format_list(t.frames)).rstrip() or "  (no Python frames)"
        blocks.append(f"Thread {t.name} (most recent call last):\n{body}")
    return "\n".join(blocks)


def innermost(hang: Hang, path: Optional[str] = None) -> Optional[traceback.FrameSummary]:
    """The main thread's innermost frame in file ``path`` (any file when None)."""
    frames = hang.threads[0].frames if hang.threads else []
    for f in reversed(frames):
        if path is None or os.path.abspath(f.filename) == os.path.abspath(path):
            return f
    return None


# -- processes -------------------------------------------------------------------------------------


def _children() -> List[int]:
    from hangdoc.testing.procs import child_pids

    return child_pids(os.getpid())


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
    except OSError:
        return "?"


def _kill_new_processes(before: Set[int]) -> List[Tuple[int, str]]:
    """SIGKILL every process in the subtree of each child started after ``before`` was taken."""
    from hangdoc.proctree import descendants, kill_tree

    killed = []
    for pid in _children():
        if pid in before:
            continue
        tree = [pid] + descendants(pid)
        named = [(p, _cmdline(p)) for p in tree]  # before they die: a zombie has no command line
        kill_tree(pid)
        killed += named
    return killed
