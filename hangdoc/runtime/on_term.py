"""Leave the records when the launcher stops the job: SIGTERM, even while blocked in a C call.

When one rank dies, torchrun (and Slurm, Kubernetes) sends SIGTERM to the others. Those are often
blocked inside a collective, a C call: a Python signal handler would only run once it returns,
which it never does before the SIGKILL that follows, so their records were lost and the aggregate
could not tell the rank that died from one that was stopped. Python's C-level handler still writes
the signal number to the *wakeup fd*: a daemon thread reading it runs the exit dump at once, then
the signal takes its course (the previous handler, or the default: the process ends by SIGTERM).

Installed only from the main thread, and only where nobody uses the wakeup fd already (asyncio
does): then the handler alone does it, when the main thread gets to run Python.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
from typing import Any, Callable, Iterator, List, Optional

#: re-entrant: the main thread's handler may run while that thread holds it in install()
_lock = threading.RLock()
_state: dict = {"installed": False, "done": False, "previous": None, "fds": None, "actions": []}


def _run_actions() -> None:
    """The actions, once; a second caller (the handler and the thread both woke) waits for the first."""
    with _lock:
        if _state["done"]:
            return
        _state["done"] = True
        actions: List[Callable[[], None]] = list(_state["actions"])
        for action in actions:
            try:
                action()
            except Exception:
                pass  # an exit path never raises into the job's shutdown


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
            pending = None
            if _hold["depth"] == 0:
                _hold["owner"] = None
                pending, _hold["pending"] = _hold["pending"], None
                _released.set()
        if pending is not None:
            _end_as_before(pending, None)


def _handler(signum: int, frame: Any) -> None:
    _run_actions()
    if _hold["owner"] == threading.get_ident():
        _hold["pending"] = signum  # the held block, this thread's, ends the process when it is over
        return
    _released.wait(HOLD_LIMIT)
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
            _run_actions()
            # the main thread may never run the Python handler (stuck in C): end the process the
            # way SIGTERM would, unless the job installed a handler of its own, which then runs
            previous = _state["previous"]
            if not callable(previous):
                # a main thread running Python ends the process in the handler within a moment
                _released.wait(HOLD_LIMIT)
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
    _state["fds"] = None
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
    threading.Thread(target=_watch, args=(r,), name="hangdoc-sigterm", daemon=True).start()


def uninstall(action: Optional[Callable[[], None]] = None) -> None:
    """Forget ``action`` (all when None); the handler stays until the last is gone."""
    with _lock:
        if action is None:
            _state["actions"].clear()
        elif action in _state["actions"]:
            _state["actions"].remove(action)
