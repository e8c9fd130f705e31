"""Leave the records when the launcher stops the job: SIGTERM, even while blocked in a C call.

When one rank dies, torchrun (and Slurm, Kubernetes) sends SIGTERM to the others. Those are often
blocked inside a collective, a C call: a Python signal handler would only run once it returns,
which it never does before the SIGKILL that follows, so their records were lost and the aggregate
could not tell the rank that died from one that was stopped. Python's C-level handler still writes
the signal number to the *wakeup fd*: a daemon thread reading it runs the exit dump at once, then
the signal takes its course (the previous handler, or the default: the process ends by SIGTERM).

Installed only from the main thread, and only where nobody uses the wakeup fd already (asyncio
does): then the handler alone does it, when the main thread gets to run Python.

The main thread's handler never waits for work running in another thread: it runs between any two
bytecodes of the job, perhaps inside an import that holds the module's lock, and the other thread's
work may need that very lock (a rank whose main function raised was importing a module when the
SIGTERM came, the thread running the exit verdict imported the same module: both waited for ever,
until the launcher's SIGKILL 30 s later, and the job got no verdict). Where the thread runs the
actions, or another thread holds the end back (:func:`holding`), the handler returns at once and
the signal is sent again once that work is over (:data:`HOLD_LIMIT` seconds at most).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import select
import signal
import threading
import time
from typing import Any, Callable, Iterator, List, Optional

#: re-entrant: the main thread's handler may run while that thread holds it in install()
_lock = threading.RLock()
_state: dict = {"installed": False, "done": False, "previous": None, "fds": None, "actions": [],
                "runner": None, "resend": None, "first": None}
#: set once the actions have run to their end (in whichever thread ran them)
_finished = threading.Event()


def _run_actions() -> bool:
    """The actions, once, in the first thread that gets here; True there. A second caller returns
    False at once, never waiting for the first (see the module: the main thread's handler may have
    interrupted code that holds what the running actions need)."""
    with _lock:
        if _state["done"]:
            return False
        _state["done"] = True
        _state["runner"] = threading.get_ident()
        actions: List[Callable[[], None]] = list(_state["actions"])
    try:
        for action in actions:
            try:
                action()
            except Exception:
                pass  # an exit path never raises into the job's shutdown
    finally:
        with _lock:
            _state["runner"] = None
            _finished.set()
        _resend_if_due()
    return True


def _busy_elsewhere(me: int) -> bool:
    """Whether another thread runs the actions or holds the end back (under _lock)."""
    return _state["runner"] not in (None, me) or _hold["owner"] not in (None, me)


def _resend_if_due(force: bool = False) -> None:
    """Send the deferred signal again once no thread's work holds it back any more (or ``force``:
    the time to wait is over): the main thread's handler then ends the process."""
    with _lock:
        signum = _state["resend"]
        if signum is None or (_busy_elsewhere(-1) and not force):
            return
        _state["resend"] = None
    try:
        os.kill(os.getpid(), signum)
    except OSError:
        pass


def _end_as_before(signum: int, frame: Any) -> None:
    previous = _state["previous"]
    if callable(previous) and previous is not _handler:
        previous(signum, frame)
        return
    if previous == signal.SIG_IGN:
        return
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


#: seconds SIGTERM's end waits at most for hangdoc's own exit work in progress (see holding)
HOLD_LIMIT = 8.0
_hold = {"owner": None, "depth": 0, "pending": None}
_released = threading.Event()
_released.set()


@contextlib.contextmanager
def holding() -> Iterator[None]:
    """While the block runs, a SIGTERM does not end the process (for at most :data:`HOLD_LIMIT`
    seconds): the dump of a rank whose main function raised, or the exit verdict, is not cut in
    half by the SIGTERM its launcher sends every rank as soon as one fails. A SIGTERM that came
    meanwhile ends the process when the block is over, as it would have."""
    me = threading.get_ident()
    with _lock:
        mine = _hold["owner"] in (None, me)
        if mine:
            _hold["owner"] = me
            _hold["depth"] += 1
            _released.clear()
    if not mine:  # another thread holds already: its hold covers this block too
        yield
        return
    try:
        yield
    finally:
        with _lock:
            _hold["depth"] -= 1
            if _hold["depth"] == 0:
                _hold["owner"] = None
                if _hold["pending"] is not None:
                    _state["resend"], _hold["pending"] = _hold["pending"], None
                _released.set()
        _resend_if_due()


def terminating() -> bool:
    """Whether a SIGTERM came (a launcher ending the job): what fails after it is the teardown's."""
    return _state.get("first") is not None


def _since_first() -> float:
    """Seconds since the first SIGTERM was seen (0 now, for the first)."""
    with _lock:
        if _state["first"] is None:
            _state["first"] = time.monotonic()
        return time.monotonic() - _state["first"]


def _handler(signum: int, frame: Any) -> None:
    me = threading.get_ident()
    watcher = _state.get("thread")
    if _state["fds"] is None or watcher is None or not watcher.is_alive():
        _run_actions()  # no thread watches the wakeup fd: this handler is the only one to run them
    # (else the thread has woken and runs them: never in this frame, which may hold an import's lock)
    late = _since_first() >= HOLD_LIMIT
    with _lock:
        if not late and _hold["owner"] == me:
            _hold["pending"] = signum  # the held block, this thread's, ends the process when it is over
            return
        if not late and (not _state["done"] or _busy_elsewhere(me)):
            _state["resend"] = signum  # the work running elsewhere sends it again when it is over
            if not _state.get("backstop"):
                # and if it never does (the thread missed its wakeup byte), the signal comes back
                # once the time to wait is over, when this handler ends the process
                _state["backstop"] = True
                t = threading.Timer(HOLD_LIMIT + 0.5, _resend_if_due, kwargs={"force": True})
                t.daemon = True
                t.start()
            return
    _end_as_before(signum, frame)


def _watch(read_fd: int) -> None:
    """The thread: a SIGTERM byte on the wakeup fd runs the actions while the main thread is stuck."""
    while True:
        try:
            ready, _, _ = select.select([read_fd], [], [], 3600)
            if not ready:
                continue
            data = os.read(read_fd, 512)
        except InterruptedError:
            continue
        except OSError:
            return
        if not data:
            return
        if signal.SIGTERM in data:
            left = HOLD_LIMIT - _since_first()
            _run_actions()
            end = time.monotonic() + max(0.0, left)
            _released.wait(max(0.0, end - time.monotonic()))
            _finished.wait(max(0.0, end - time.monotonic()))
            _resend_if_due(force=time.monotonic() >= end)
            # the main thread may never run the Python handler (stuck in C): end the process the
            # way SIGTERM would, unless the job installed a handler of its own, which then runs
            previous = _state["previous"]
            if not callable(previous):
                # a main thread running Python ends the process in the handler within a moment
                threading.Event().wait(1.0)
                os._exit(128 + signal.SIGTERM)


def install(action: Callable[[], None]) -> bool:
    """Run ``action`` (once) when SIGTERM arrives, before the process ends as it would have.
    Returns whether SIGTERM is watched (False outside the main thread or when SIGTERM is ignored)."""
    with _lock:
        if action not in _state["actions"]:
            _state["actions"].append(action)
        if _state["installed"]:
            return True
    if threading.current_thread() is not threading.main_thread():
        return False
    try:
        previous = signal.getsignal(signal.SIGTERM)
        if previous == signal.SIG_IGN:
            return False
        _state["previous"] = previous
        signal.signal(signal.SIGTERM, _handler)
    except (ValueError, OSError):
        return False
    _state["installed"] = True
    if not _state.get("fork_hook"):
        _state["fork_hook"] = True
        os.register_at_fork(after_in_child=_after_fork_in_child)
        atexit.register(_settle)
    _start_wakeup_thread()
    return True


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker) is not the rank: it must neither dump the rank's records
    on its own SIGTERM (a DataLoader terminates its workers so) nor write into the rank's wakeup pipe."""
    fds = _state["fds"]
    _hold.update(owner=None, depth=0, pending=None)
    _released.set()
    _state["actions"] = []
    _state["done"] = True
    _state.update(fds=None, runner=None, resend=None)
    _finished.set()
    try:
        if fds is not None:
            signal.set_wakeup_fd(-1)
            for fd in fds:
                os.close(fd)
        previous = _state["previous"]
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
    except (ValueError, OSError, TypeError):
        pass
    _state["installed"] = False


def _settle() -> None:
    """At the interpreter's exit: the actions a SIGTERM started in the thread finish first
    (:data:`HOLD_LIMIT` s at most), as they did when the handler waited for them."""
    if _state["done"] and _state["runner"] not in (None, threading.get_ident()):
        _finished.wait(HOLD_LIMIT)


def _start_wakeup_thread() -> None:
    try:
        r, w = os.pipe()
        os.set_blocking(w, False)
        old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except (ValueError, OSError):
        return
    if old != -1:  # asyncio (or another library) owns it: give it back, the handler alone will do
        signal.set_wakeup_fd(old)
        os.close(r)
        os.close(w)
        return
    _state["fds"] = (r, w)
    _state["thread"] = threading.Thread(target=_watch, args=(r,), name="hangdoc-sigterm", daemon=True)
    _state["thread"].start()


def uninstall(action: Optional[Callable[[], None]] = None) -> None:
    """Forget ``action`` (all when None); the handler stays until the last is gone."""
    with _lock:
        if action is None:
            _state["actions"].clear()
        elif action in _state["actions"]:
            _state["actions"].remove(action)
