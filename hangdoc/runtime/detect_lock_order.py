"""Threads of one rank that wait for each other's locks in a cycle: a lock-order deadlock (ABBA).

The training loop takes ``COUNTERS_LOCK`` and then ``REGISTRY_LOCK``; an exporter thread takes them
in the opposite order (``examples/bugs/abba_threads.py``). Once each holds one and waits for the
other, neither ever runs again, and the rank's main thread never issues its next collective. As
in :mod:`hangdoc.runtime.detect_lock`, which locks a thread holds and which one it waits for are read
from its live frames and the source: a thread waits for a ``threading.Lock`` that is locked at its
innermost frame's ``with L:`` line (or ``L.acquire()``), and holds every lock whose ``with`` body one
of its frames is in. Following "waits for a lock held by" from the main thread, a return to a thread
already on the path is a cycle: every thread on it waits for the next, for ever.

A lock held by a thread that is not waiting for a lock (it sleeps, reads, computes) is no cycle:
that thread may still let go (docs/detect.md, Limits). Each look reads one snapshot of every
thread's frames; the detector names a cycle only when two looks a second apart see the same one.
(Tested on real threads: ``tests/test_detect_lock_order.py``.)
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any, Dict, List, Optional, Tuple

from hangdoc.runtime import detect_lock

#: threads followed from the main thread, at most
MAX_CHAIN = 32


def _where(frame: Any) -> str:
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def _holders(frames: Dict[int, Any]) -> Dict[int, Tuple[int, str, Any]]:
    """id(lock) -> (thread ident, the lock's expression, the frame in whose ``with`` body it is)."""
    out: Dict[int, Tuple[int, str, Any]] = {}
    for ident, top in frames.items():
        f, depth = top, 0
        while f is not None and depth < detect_lock.MAX_FRAMES:
            for lock, text in detect_lock.held_in(f, skip_header=f is top):
                out.setdefault(id(lock), (ident, text, f))
            f, depth = f.f_back, depth + 1
    return out


def cycle(frames: Dict[int, Any], start: int) -> Optional[List[Dict[str, Any]]]:
    """The steps from thread ``start`` into a cycle of lock waits through two threads or more (one
    thread waiting for its own lock is :func:`detect_lock.self_deadlock`), each ``{"thread",
    "lock", "at", "in", "holder", "held_at", "held_in"}``: ``start``'s wait first, the last step's
    holder a thread of an earlier step. None when there is none. ``frames``: ident -> innermost
    frame (one snapshot)."""
    holders: Optional[Dict[int, Tuple[int, str, Any]]] = None
    path: List[Dict[str, Any]] = []
    seen: Dict[int, int] = {}
    t = start
    while t not in seen:
        if len(path) >= MAX_CHAIN or t not in frames:
            return None
        seen[t] = len(path)
        top = frames[t]
        lock, text = detect_lock._acquiring(top)
        if lock is detect_lock._MISSING or not isinstance(lock, detect_lock._LOCK) or not lock.locked():
            return None
        if holders is None:  # only for a thread that waits for a lock: most looks end above
            holders = _holders(frames)
        held = holders.get(id(lock))
        if held is None:
            return None  # its holder is not seen in a ``with`` (a bare acquire, or it is leaving)
        holder, name, hf = held
        path.append({"thread": t, "lock": text or name, "at": _where(top), "in": top.f_code.co_name,
                     "holder": holder, "held_at": detect_lock.taken_at(hf, lock), "held_in": hf.f_code.co_name})
        t = holder
    return path if len(path) - seen[t] >= 2 else None


def main_thread_cycle() -> Optional[List[Dict[str, Any]]]:
    """:func:`cycle` from this process's main thread (called from another thread), each step's
    threads named."""
    main = threading.main_thread()
    if main is threading.current_thread() or main.ident is None:
        return None
    frames = sys._current_frames()
    found = cycle(frames, main.ident)
    if found is None:
        return None
    names = {t.ident: t.name for t in threading.enumerate()}
    for step in found:
        for key in ("thread", "holder"):
            ident = step[key]
            step[key] = "the main thread" if ident == main.ident else f"thread '{names.get(ident, hex(ident))}'"
    return found


def key(found: List[Dict[str, Any]]) -> Tuple[Tuple[str, str], ...]:
    """What must stay the same between two looks for the cycle to be named."""
    return tuple(sorted((s["thread"], s["at"]) for s in found))


def verdict(rank: int, found: List[Dict[str, Any]], digests: Any, describe: Any) -> Any:
    """The detector's verdict: a ``collective-mismatch`` of this rank (it never issues the collective
    the others wait in), basis ``lock``."""
    from hangdoc.ranges import describe_ranks
    from hangdoc.runtime.detect_digest import Verdict
    from hangdoc.runtime.detect_failed import last_call
    from hangdoc.textsafe import visible

    group, n, entry, last = last_call(digests, describe)
    v = Verdict(group, max(0, n - 1), True, [rank], [], entry, None, "lock")

    def clean(value: Any) -> str:
        return visible(str(value))[:200]

    steps = [f"{clean(s['thread'])} waits for `{clean(s['lock'])}` at {clean(s['at'])} in {clean(s['in'])}, held by "
             f"{clean(s['holder'])} (taken at {clean(s['held_at'])} in {clean(s['held_in'])})" for s in found[:8]]
    v.text = (f"{describe_ranks([rank])} is deadlocked between its own threads: " + "; ".join(steps) +
              f": each holds a lock the next waits for (locks taken in opposite orders){last}; the other ranks "
              "wait for it at their next collective")
    return v
