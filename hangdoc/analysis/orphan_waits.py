"""A rank whose main thread waits for a thread that is no longer there.

A prefetch thread fills a ``queue.Queue`` and the main thread takes from it; a ``multiprocessing``
pool's result-handler thread delivers ``Pool.map``'s results. When that thread dies (an exception
in it is printed on stderr and the thread ends; the process goes on), the main thread waits for
ever, and the other ranks wait in their next collective for it. Its dump shows it: the main thread
in ``Queue.get`` with no other Python thread left in the process that could put, or in a pool
result's ``wait`` with no ``_handle_results`` thread. That is a **rank-failed**: the rank's own
code failed (on another thread), not a collective that went astray.

A mixin of :class:`hangdoc.analysis.stack_rules._Analysis` (``ok_b``, ``in_category``,
``evidence_lines``, ``who_b``, ``out``).

    >>> from hangdoc.model import Frame, Process, Thread
    >>> main = Thread("1", "MainThread", (Frame("main", "train.py", 57), Frame("Queue.get", "queue.py", 171),
    ...                                   Frame("Condition.wait", "threading.py", 355)), is_main=True)
    >>> orphaned(Process(threads=[main, Thread("2", None, ())]))
    'a thread to put into the queue (Queue.get), and no other thread of the process runs Python'
    >>> feeder = Thread("3", "prefetch-0", (Frame("prefetch", "train.py", 46), Frame("Queue.put", "queue.py", 140)))
    >>> orphaned(Process(threads=[main, feeder])) is None
    True
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from hangdoc.analysis.stack_words import _culprits, _procs, _s
from hangdoc.model import Finding, Process


def _has(frames, function: str, file_tail: str) -> bool:
    from hangdoc.analysis.normalize import _suffix_match

    return any(f.function.rsplit(".", 1)[-1] == function and _suffix_match((f.file or "").replace("\\", "/"), file_tail)
               for f in frames if not f.native)


def orphaned(p: Process) -> Optional[str]:
    """What ``p``'s main thread waits for when no thread that could deliver it is left; else None."""
    from hangdoc.analysis.normalize import is_hangdoc_thread

    t = p.main_thread
    if t is None or not t.frames:
        return None
    others = [o for o in p.threads if o is not t and o.frames and not is_hangdoc_thread(o.frames)
              and any(not f.native for f in o.frames)]
    frames = t.frames
    if _has(frames, "wait", "multiprocessing/pool.py") or _has(frames, "get", "multiprocessing/pool.py"):
        if not any(_has(o.frames, "_handle_results", "multiprocessing/pool.py") for o in others):
            return ("the pool's results (multiprocessing.pool), and the pool's result-handler thread "
                    "(_handle_results) is gone")
        return None
    if _has(frames, "get", "queue.py") and not others:
        return "a thread to put into the queue (Queue.get), and no other thread of the process runs Python"
    return None


class OrphanRules:
    """The orphaned-wait rule of the stack analysis (see the module)."""

    def orphans(self) -> bool:
        """A ``rank-failed`` finding for ranks whose main thread waits for a thread that is gone while
        others wait in collectives for them; those ranks leave ``ok_b``. True when it found some."""
        gone: List[Tuple[object, str]] = []
        for b in self.ok_b:
            if b.worker or not b.procs or b.wait.category not in ("lock", "io"):
                continue
            what = orphaned(b.procs[0])
            if what is not None:
                gone.append((b, what))
        if not gone:
            return False
        orphan_b = [b for b, _ in gone]
        rest, waiting = self.set_apart(orphan_b)
        if not waiting:
            return False  # nobody waits for them in a collective
        procs = _procs(orphan_b)
        summary = (f"{self.who_b(orphan_b)} failed on another thread: {_s(procs, 'its', 'their')} main thread waits "
                   f"for {gone[0][1]}, while {self.who_b(waiting)} {_s(_procs(waiting), 'waits', 'wait')} in "
                   f"collectives for {_s(procs, 'it', 'them')}")
        evidence = [f"{self.who_b([b])}: main thread at {(b.wait.call_site or b.wait.frame).label()}, waiting for {what}"
                    for b, what in gone]
        evidence += [f"meanwhile {line}" for line in self.evidence_lines(waiting)]
        advice = [
            "The thread that should have delivered ended, most likely of an exception: its traceback is on the "
            "rank's stderr (`Exception in thread ...`); `hangdoc aggregate` of the dumps with the job's log names it.",
            "Make the thread's failure reach the main thread: catch the exception in the thread and put it into the "
            "queue for the consumer to raise, or wait with a timeout (`queue.get(timeout=...)`, "
            "`Pool.map_async(...).get(timeout)`) and check that the producer is alive.",
        ]
        self.out.append(Finding("rank-failed", summary, _culprits(procs), evidence, advice, 0.8))
        self.ok_b[:] = rest
        return True
