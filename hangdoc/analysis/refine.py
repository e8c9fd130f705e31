"""Flight Recorder's completion states lifted onto hangdoc's records of the same calls.

Flight Recorder tracks completion in C++ from the backend's own events, at no Python cost;
hangdoc's recorder spaces its CUDA events in time (HANGDOC_CUDA_EVENT_GAP_MS), so the last records
of a burst that hung mid-way can read issued though they ran. Both describe one rank's calls in
the order it issued them; they are paired from the newest call back.

Flight Recorder numbers point-to-point calls and collectives with separate counters
(``p2p_seq_id``, ``collective_seq_id``), so its entries are put in issue order by their creation
time, never by those numbers: sorted by number, a pipeline's sends and receives fell among much
older collectives, and the newest receive was paired with a completed one of an early step (2 x
H200, ``examples/bugs/pp_skip_pair.py``: every send and receive queued behind a hung all_reduce
read completed).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, Iterable, List, Tuple

from hangdoc.model import CollectiveRecord


def _issue_order(r: CollectiveRecord) -> Tuple[float, int]:
    return (r.time_issued if r.time_issued is not None else float("inf"), r.seq)


def refine_states(records: Iterable[CollectiveRecord], window: int = 256) -> int:
    """Upgrade hangdoc records still read ``issued`` to ``completed`` where the same rank's Flight
    Recorder dump saw the same call complete; returns how many changed (in place).

    Per rank and group the two are aligned from the newest call back: each hangdoc record is paired
    with the newest not yet paired Flight Recorder entry of the same op, shapes and peer (Flight
    Recorder also holds calls hangdoc never saw, such as DDP's gradient all_reduces). Pairing with
    a newer twin than the true one can only leave a record issued (work in one group completes
    in order), never complete one that did not run; a record is never downgraded.

    The same order holds after: a synchronous call on a CUDA stream runs after every call queued
    there before it, so an upgrade behind an earlier call of the same rank and stream that Flight
    Recorder itself saw not completed is a pairing the evidence contradicts, and is undone.

        >>> from hangdoc.model import CollectiveRecord as R
        >>> mine = R(rank=0, seq=0, op="send", peer=1, shapes=((4,),))
        >>> fr = R(rank=0, seq=0, op="send", peer=1, shapes=((4,),), state="completed", origin="flight-recorder")
        >>> refine_states([mine, fr]), mine.state
        (1, 'completed')
    """
    records = list(records)
    per: Dict[Tuple[int, str, str], List[CollectiveRecord]] = defaultdict(list)
    for r in records:
        per[(r.rank, r.group, r.origin)].append(r)
    lifted: List[Tuple[CollectiveRecord, object]] = []
    unfinished = set()  # ids of hangdoc records whose Flight Recorder twin is not completed either
    for (rank, group, origin), mine in per.items():
        if origin != "hangdoc" or not any(r.state == "issued" for r in mine):
            continue
        theirs = per.get((rank, group, "flight-recorder"))
        if not theirs:
            continue
        mine = sorted(mine, key=lambda r: r.seq)  # hangdoc: one counter per group for every call
        theirs = sorted(theirs, key=_issue_order)
        j = len(theirs) - 1
        for rec in reversed(mine):
            key = (rec.op, tuple(rec.shapes), rec.peer)
            for k in range(j, max(-1, j - window), -1):
                t = theirs[k]
                if (t.op, tuple(t.shapes), t.peer) == key:
                    if rec.state == "issued" and t.state == "completed":
                        lifted.append((rec, rec.time_completed))
                        rec.state = "completed"
                        rec.time_completed = rec.time_completed or t.time_completed
                    elif rec.state == "issued":
                        unfinished.add(id(rec))
                    j = k - 1
                    break
            if j < 0:
                break
    if lifted and unfinished:
        _undo_out_of_order(records, lifted, unfinished)
    return sum(1 for rec, _ in lifted if rec.state == "completed")


def _undo_out_of_order(records: List[CollectiveRecord], lifted: List[Tuple[CollectiveRecord, object]],
                       unfinished: set) -> None:
    """Undo the upgrades of synchronous CUDA calls that come after a call of the same rank and
    stream that neither hangdoc nor Flight Recorder saw complete (hangdoc's records, in issue order)."""
    before = {id(rec): t1 for rec, t1 in lifted}
    lanes: Dict[Tuple[int, str], List[CollectiveRecord]] = defaultdict(list)
    for r in records:
        if r.origin == "hangdoc" and r.stream and not r.async_op:
            lanes[(r.rank, r.stream)].append(r)
    for lane in lanes.values():
        lane.sort(key=_issue_order)
        blocked = False
        for r in lane:
            if id(r) in unfinished:
                blocked = True
            elif blocked and id(r) in before and r.state == "completed":
                r.state, r.time_completed = "issued", before[id(r)]
