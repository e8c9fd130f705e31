"""Collectives in flight on two threads of every rank at once: an ordering race the stacks show.

Every rank waits at one place, which alone reads as a hang below Python; but when each of them also
has another thread blocked in a collective (a prefetch thread's all_gather beside the main thread's
all_reduce), the likelier story is an order the threads did not keep: on one group, every rank must
issue its collectives in the same order, and two threads issue them in whatever order they happen
to run. A rank whose threads took the other order waits for a collective the others issue later.
The stacks cannot show which rank swapped them (the collective records can).

    >>> from hangdoc.model import Frame, Process, Thread
    >>> def rank(r):
    ...     main = Thread("1", "MainThread", (Frame("main", "t.py", 60), Frame("all_reduce", "torch/distributed/distributed_c10d.py", 3075)), state="idle")
    ...     side = Thread("2", "prefetch_0", (Frame("gather_layer", "t.py", 44), Frame("all_gather", "torch/distributed/distributed_c10d.py", 4086)), state="idle")
    ...     return Process(rank=r, threads=[main, side])
    >>> [(name, w.op) for name, w in side_collectives(rank(0))]
    [('prefetch_0', 'all_gather')]
    >>> f = finding([rank(0), rank(1)], "ranks 0-1")
    >>> f.kind, f.culprits, f.summary.split(":")[0]
    ('collective-mismatch', [], 'ranks 0-1 wait in collectives on two threads at once')
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from hangdoc.analysis.signatures import BACKWARD_OP, Wait, classify_stack, wait_of
from hangdoc.analysis.stack_words import _RECORDS_ADVICE, _cap
from hangdoc.model import Finding, Process

#: above a collective-wait's 0.6: with a second thread in a collective, the order is the likelier cause
CONFIDENCE = 0.65


def side_collectives(p: Process) -> List[Tuple[str, Wait]]:
    """``(thread name, wait)`` of each thread other than the main one blocked in a collective."""
    from hangdoc.analysis.normalize import is_hangdoc_thread

    out = []
    main = p.main_thread
    for t in p.threads:
        if t is main or not t.frames or is_hangdoc_thread(t.frames):
            continue
        w = classify_stack(t.frames, t.state)
        if w.category == "collective":
            out.append((t.name or f"thread {t.ident}", w))
    return out


def _own_collective(p: Process) -> bool:
    """The main thread is in a collective of its own frames (not waiting for another thread's:
    a queue, a lock, or autograd's backward, whose hooks run on another thread)."""
    t = p.main_thread
    if t is None or not t.frames:
        return False
    w = classify_stack(t.frames, t.state)
    return w.category == "collective" and w.op != BACKWARD_OP


def finding(procs: Sequence[Process], who: str) -> Optional[Finding]:
    """The race finding when every one of ``procs`` (the ranks waiting at one place, ``who``) has a
    collective on another thread too; None otherwise. The first process is looked at first, so a
    job without side collectives costs one process's threads."""
    if not procs or not side_collectives(procs[0]):
        return None
    places: dict = {}
    for p in procs:
        sides = side_collectives(p)
        if not sides or not _own_collective(p):
            return None
        main = wait_of(p)
        key = (main.describe(),) + tuple(sorted(f"{name}: {w.describe()}" for name, w in sides))
        places.setdefault(key, []).append(p.rank)
    (first_key, _), = list(places.items())[:1]
    threads = ", ".join(first_key[1:])
    evidence = [f"{_ranks(ranks)}: main thread in {key[0]}; {', '.join(key[1:])}"
                for key, ranks in places.items()]
    return Finding(
        "collective-mismatch",
        f"{who} wait in collectives on two threads at once: the main thread in {first_key[0]}, and {threads}. "
        "Collectives that two threads issue on one group must reach it in the same order on every rank, and "
        "threads keep no order: a rank that issued them the other way round waits for the others' later "
        "collective (the stacks cannot show which rank did)",
        [],
        _cap(evidence, "ranks"),
        ["Issue the collectives of one group from one thread, or give the side thread a group of its own "
         "(`dist.new_group(...)`, created in the same order on every rank); or wait for the side thread's "
         "collective (`future.result()`, `work.wait()`) before the main thread issues its next one.",
         _RECORDS_ADVICE,
         "If the two threads use different groups, the order does not matter: read it as a wait below Python "
         "(`NCCL_DEBUG=INFO` shows which rank the collective waits for)."],
        CONFIDENCE,
    )


def _ranks(ranks: List[Optional[int]]) -> str:
    from hangdoc.ranges import describe_ranks

    known = [r for r in ranks if r is not None]
    return describe_ranks(known) if known else "processes of unknown rank"
