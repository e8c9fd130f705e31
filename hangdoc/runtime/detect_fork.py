"""A child forked while another thread held a lock: the child blocks on it, and the rank waits for the child.

``fork`` copies only the thread that calls it. A lock that another thread held at that moment stays
held in the child for ever, with no thread there to release it: a DataLoader worker forked while a
"metrics" thread held ``STATS_LOCK`` blocks in its first ``__getitem__`` that takes it
(``examples/bugs/dataloader_deadlock.py``), a child forked while a log handler's lock was held blocks
in its first log call (``examples/bugs/logging_fork_lock.py``); the rank waits for its worker or in
``os.waitpid``, and the other ranks wait for the rank.

With ``--detect``, a hook runs in the forking thread just before each ``os.fork`` (a DataLoader's
workers, ``multiprocessing``; ``subprocess`` does not run it, and needs not: it execs at once) and
notes every ``threading.Lock`` another thread of the process holds then: a frame of that thread
inside the body of a ``with L:`` (:mod:`hangdoc.runtime.detect_lock`). While the rank is quiet, its
detector looks for the verdict: such a fork happened, the main thread waits for a child (in the
DataLoader, or at a line calling ``waitpid``, ``wait(``, ``join(``, ``communicate(``), and a child
of this process that started at such a fork (its start time in ``/proc/PID/stat``, within
FORK_SLACK of the fork noted) sits in a futex wait (``/proc/PID/wchan``), twice a second apart.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Dict, List, Optional

from hangdoc.runtime import detect_lock

#: forks with a lock held kept (the latest)
KEEP = 8
#: frames of a thread looked at, at a fork, and of all threads together (a process with a thousand
#: threads does not make each fork slow)
MAX_FRAMES = 64
MAX_ALL_FRAMES = 2048
#: frames of the main thread looked at for a wait on a child
MAX_WAIT_FRAMES = 32
_DATA = os.sep + os.path.join("torch", "utils", "data") + os.sep
_WAITS = (b"waitpid(", b".wait(", b".join(", b"communicate(", b"wait4(")

_state: Dict[str, Any] = {"installed": False, "active": False, "hazards": []}


def _site(frame: Any) -> str:
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def _libs() -> tuple:
    """The directories of the standard library, hangdoc and torch (their frames are not the user's)."""
    dirs = [os.path.dirname(os.__file__), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    torch = sys.modules.get("torch")
    if getattr(torch, "__file__", None):
        dirs.append(os.path.dirname(torch.__file__))
    return tuple(d + os.sep for d in dirs)


def _user_frame(frame: Any) -> Any:
    """The innermost frame outside the standard library, torch and hangdoc (where the fork was asked for)."""
    f, first, libs = frame, frame, _libs()
    while f is not None:
        name = f.f_code.co_filename
        if not name.startswith(libs) and not name.startswith("<"):
            return f
        f = f.f_back
    return first


def held_by_others(max_frames: int = MAX_FRAMES) -> List[Dict[str, Any]]:
    """The locks other threads of this process hold now, in the user's code (the standard library's,
    torch's and hangdoc's own frames are not parsed): ``{"lock", "thread", "held_at", "held_in"}``."""
    me, libs = threading.get_ident(), _libs()
    names = {t.ident: t.name for t in threading.enumerate()}
    out, budget = [], MAX_ALL_FRAMES
    for ident, frame in sys._current_frames().items():
        if ident == me:
            continue
        f, depth = frame, 0
        while f is not None and depth < max_frames and budget > 0:
            budget -= 1
            name = f.f_code.co_filename
            if name.startswith(("<",) + libs):
                f, depth = f.f_back, depth + 1
                continue
            for lock, text in detect_lock.held_in(f):
                out.append({"lock": text, "thread": names.get(ident, str(ident)), "held_at": _site(f),
                            "held_in": f.f_code.co_name, "_lock": lock})
            f, depth = f.f_back, depth + 1
    return out


def _before_fork() -> None:
    if not _state["active"]:
        return
    try:
        held = held_by_others()
        if not held:
            return
        here = sys._getframe(1)
        data = False
        f = here
        while f is not None:
            data = data or _DATA in f.f_code.co_filename
            f = f.f_back
        user = _user_frame(here)
        hazards = _state["hazards"]
        hazards.append({"held": [{k: v for k, v in h.items() if k != "_lock"} for h in held],
                        "forked_at": _site(user), "forked_in": user.f_code.co_name, "dataloader": data,
                        "time": time.time()})
        del hazards[:-KEEP]
    except Exception:  # never in the way of a fork
        pass


def install() -> None:
    """Watch forks from now on (``os.register_at_fork`` cannot be undone: :func:`uninstall` pauses it)."""
    _state["active"] = True
    if not _state["installed"] and hasattr(os, "register_at_fork"):
        os.register_at_fork(before=_before_fork)
        _state["installed"] = True


def uninstall() -> None:
    _state["active"] = False


def hazards() -> List[Dict[str, Any]]:
    return list(_state["hazards"])


def main_waits_for_child() -> Optional[str]:
    """``"dataloader"`` or ``"child"`` when the main thread waits for a worker or a child process
    (see the module), with where; None otherwise."""
    main = threading.main_thread()
    frame = sys._current_frames().get(main.ident) if main.ident is not None else None
    f, depth = frame, 0
    while f is not None and depth < MAX_WAIT_FRAMES:
        if _DATA in f.f_code.co_filename and f.f_code.co_name in ("_get_data", "_try_get_data", "_next_data"):
            return "dataloader"
        f, depth = f.f_back, depth + 1
    if frame is None:
        return None
    user = _user_frame(frame)
    text = detect_lock.line_of(user.f_code.co_filename, user.f_lineno)
    if text is not None and any(w in text for w in _WAITS):
        return "child"
    return None


def _boot_time() -> float:
    with open("/proc/stat", "rb") as f:
        for line in f:
            if line.startswith(b"btime "):
                return float(line.split()[1])
    raise OSError("no btime in /proc/stat")


def blocked_children(pid: Optional[int] = None) -> Dict[int, float]:
    """Children of this process whose main thread sits in a futex wait (a lock, a condition):
    {pid: when it started (seconds since the epoch, to a clock tick)}."""
    from hangdoc import proctree

    me = os.getpid() if pid is None else pid
    out: Dict[int, float] = {}
    try:
        boot, tick = _boot_time(), float(os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError):
        return out
    for child in proctree.parent_map().get(me, []):
        try:
            state, _ppid, start = proctree.stat(child)
            where = proctree.wchan(child)
        except OSError:
            continue
        if state == "S" and where.startswith("futex"):
            out[child] = boot + start / tick
    return out


#: a child belongs to a fork noted this close to its start (s): the hook runs right before the fork
FORK_SLACK = 2.0


class Watch:
    """The detector's look, once a second while quiet: a verdict once the same blocked child was
    seen twice, at least a second apart."""

    def __init__(self) -> None:
        self.seen: Dict[int, float] = {}

    def look(self, now: float) -> Optional[Dict[str, Any]]:
        hz = hazards()
        if not hz:
            return None
        waiting = main_waits_for_child()
        if waiting is None:
            self.seen.clear()
            return None
        kids = blocked_children()
        # only a child forked while a lock was held: its start matches a noted fork (an older fork
        # with a lock held whose child went through says nothing about this one)
        forked = {k: h for k, started in kids.items() for h in hz if abs(started - h["time"]) <= FORK_SLACK}
        self.seen = {k: self.seen.get(k, now) for k in forked}
        stood = sorted(k for k, since in self.seen.items() if now - since >= 1.0)
        if not stood:
            return None
        h = forked[stood[0]]
        return {"child": stood[0], "waiting": waiting, "dataloader": waiting == "dataloader" or h["dataloader"], **h}


def verdict(rank: int, found: Dict[str, Any], digests: Any, describe: Any) -> Any:
    """The detector's verdict: ``dataloader-stall`` for a DataLoader's worker, else ``collective-mismatch``
    (the rank never issues the collective the others wait in), basis ``fork``."""
    from hangdoc.ranges import describe_ranks
    from hangdoc.runtime.detect_digest import Verdict
    from hangdoc.runtime.detect_failed import last_call
    from hangdoc.textsafe import visible

    group, n, entry, last = last_call(digests, describe)
    v = Verdict(group, max(0, n - 1), True, [rank], [], entry, None, "fork")
    v.kind = "dataloader-stall" if found.get("dataloader") else "collective-mismatch"
    held = found.get("held") or [{}]
    h = {k: visible(str(held[0].get(k, "")))[:200] for k in ("lock", "thread", "held_at", "held_in")}
    what = "its DataLoader worker" if found.get("dataloader") else "its child process"
    v.text = (f"{describe_ranks([rank])} waits for {what} (pid {int(found.get('child', 0))}), blocked on a lock: it "
              f"was forked at {visible(str(found.get('forked_at', '?')))[:200]} while thread {h['thread']!r} held "
              f"`{h['lock']}` (taken at {h['held_at']} in {h['held_in']}), and a forked child has no thread to "
              f"release it{last}; the other ranks wait for it at their next collective")
    return v
