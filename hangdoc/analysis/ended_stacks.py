"""A rank whose main program has ended while its process lives on, held by its other threads.

When a rank's main function raises (or returns early), Python starts to exit: the main thread
runs ``threading._shutdown``, which waits for every non-daemon thread. A thread nobody stops (a
metrics pusher, a heartbeat, a prefetcher) keeps the process alive for ever, so the launcher sees no
failure while the other ranks wait in their next collective for a rank that has left the job.

Its dump shows it: the main thread's outermost Python frame is ``_shutdown`` in ``threading.py``
(py-spy ``_shutdown (threading.py:1590)``, faulthandler ``File ".../threading.py", line 1590 in
_shutdown``), or in native frames ``wait_for_thread_shutdown`` with no Python frame left. A mixin of
:class:`hangdoc.analysis.stack_rules._Analysis`, which provides ``ok_b``, ``in_category``,
``evidence_lines``, ``who_b`` and ``out``.

    >>> from hangdoc.model import Frame, Process, Thread
    >>> main = Thread("1", "MainThread", (Frame("_shutdown", "/usr/lib/python3.11/threading.py", 1590),), is_main=True)
    >>> beat = Thread("2", "heartbeat", (Frame("_bootstrap", "threading.py", 1002), Frame("heartbeat", "train.py", 28)))
    >>> main_ended(Process(threads=[main, beat]))
    "'heartbeat' at heartbeat (train.py:28)"
    >>> main_ended(Process(threads=[Thread("1", "MainThread", (Frame("<module>", "train.py", 9),), is_main=True)])) is None
    True
"""

from __future__ import annotations

from typing import Optional

from hangdoc.analysis.stack_words import _culprits, _procs, _s
from hangdoc.model import Finding, Process

#: the other threads named as what keeps an ended process alive
MAX_HOLDERS = 3


def _ended_frames(frames) -> bool:
    python = [f for f in frames if not f.native]
    if python:
        first = python[0]
        return first.function == "_shutdown" and (first.file or "").replace("\\", "/").rsplit("/", 1)[-1] == "threading.py"
    return any("wait_for_thread_shutdown" in f.function for f in frames)


def _where(p: Process) -> str:
    frames = p.main_thread.frames if p.main_thread is not None else ()
    python = [f for f in frames if not f.native]
    return (python or list(frames))[0].label() if frames else "its exit"


def main_ended(p: Process) -> Optional[str]:
    """``None`` unless ``p``'s main thread has ended and Python waits for its other threads to exit;
    then what those threads are doing (``"'heartbeat' at heartbeat (train.py:28)"``, or ``""``
    when the dump shows none)."""
    t = p.main_thread
    if t is None or not t.frames or not _ended_frames(t.frames):
        return None
    from hangdoc.analysis.normalize import is_hangdoc_thread

    held = []
    for o in p.threads:
        if o is t or not o.frames or is_hangdoc_thread(o.frames):
            continue
        user = [f for f in o.frames if not f.native and (f.file or "").rsplit("/", 1)[-1] != "threading.py"]
        at = (user or [f for f in o.frames if not f.native] or list(o.frames))[-1]
        held.append(f"'{o.name or o.ident}' at {at.label()}")
    more = f" and {len(held) - MAX_HOLDERS} more" if len(held) > MAX_HOLDERS else ""
    return ", ".join(held[:MAX_HOLDERS]) + more


class EndedRules:
    """The ended-main-thread rule of the stack analysis (see the module)."""

    def ended(self) -> bool:
        """A ``rank-failed`` finding for ranks whose main program ended while others wait in
        collectives for them; those ranks leave ``ok_b`` (the later rules would read them as blocked
        outside any collective). True when it found some."""
        gone = []
        for b in self.ok_b:
            if b.worker or not b.procs:
                continue
            holders = main_ended(b.procs[0])
            if holders is not None:
                gone.append((b, holders))
        if not gone:
            return False
        ended_b = [b for b, _ in gone]
        rest, waiting = self.set_apart(ended_b)
        if not waiting:
            return False  # nobody waits for them: a job at its end, not a rank that left it
        procs = _procs(ended_b)
        holders = "; ".join(sorted({h for _, h in gone if h}))
        summary = (f"{self.who_b(ended_b)} left the job: {_s(procs, 'its', 'their')} main thread ended (an exception "
                   f"or a return) while {self.who_b(waiting)} {_s(_procs(waiting), 'waits', 'wait')} in collectives for "
                   f"{_s(procs, 'it', 'them')}")
        if holders:
            summary += f"; other threads keep {_s(procs, 'the process', 'the processes')} alive ({holders})"
        evidence = [f"{self.who_b([b])}: main thread at {_where(b.procs[0])}, where Python exits and waits for every "
                    "non-daemon thread" + (f"; still running: {h}" if h else "") for b, h in gone]
        evidence += [f"meanwhile {line}" for line in self.evidence_lines(waiting)]
        advice = [
            "Its log (stderr) says why the main thread ended: the traceback of the exception it raised, or nothing "
            "when its main function returned early (uneven data, a rank-dependent `return`); `hangdoc aggregate` of "
            "the dumps with the job's log names the exception.",
            "The launcher sees no failure while a thread keeps the process alive: make such threads daemons "
            "(`daemon=True`), or stop and join them in a `finally:`, so that a failing rank exits and the job ends "
            "instead of hanging.",
        ]
        self.out.append(Finding("rank-failed", summary, _culprits(procs), evidence, advice, 0.8))
        self.ok_b[:] = rest
        return True
