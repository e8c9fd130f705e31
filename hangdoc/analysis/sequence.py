"""Cross-rank analysis of collective records: alignment, lag, pending ops, wait-for graph.

Per process group, every rank's sequence of collective calls is aligned against the majority with
an insert/delete-aware comparison (not by equal sequence numbers). At the first column where a rank
disagrees, a small longest-common-subsequence test over a window decides whether it *lacks* the
majority's op (``missing``), issued one the others did not (``extra``), issued a different one
(``signature``) or swapped two (``order``). That rank is the culprit; the rank is then left out of
later columns, so one skipped op yields one divergence, not one per later op.

    >>> from hangdoc.model import CollectiveRecord as R
    >>> recs = [R(rank=r, seq=i, op=op, shapes=((8,),), dtypes=("float32",))
    ...         for r in range(3) for i, op in enumerate(["all_reduce", "broadcast", "all_reduce"])
    ...         if not (r == 2 and op == "broadcast")]
    >>> [(d.kind, d.ranks) for d in divergences(recs)]
    [('missing', [2])]

Cost: linear in the number of records per column walked, plus a window-sized (``WINDOW``) LCS at
each divergence.
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from hangdoc.model import CollectiveRecord
# finding text: long rank lists end in "… and N more" (the culprits keep every rank)
from hangdoc.ranges import describe_ranks_capped as describe_ranks

#: point-to-point ops: matched by peer, never aligned as collectives.
P2P_OPS = frozenset({"send", "recv", "isend", "irecv", "send_object_list", "recv_object_list"})
_SENDS = frozenset({"send", "isend", "send_object_list"})
#: how far ahead the divergence test looks.
WINDOW = 32

@dataclass
class Divergence:
    """The first place where ``ranks`` part from the rest of ``group``."""

    group: str
    kind: str  # "missing" | "extra" | "signature" | "order"
    ranks: List[int]
    expected: Optional[CollectiveRecord]
    actual: Optional[CollectiveRecord]
    index: int
    summary: str
    #: the ranks that issued ``expected``.
    agreeing: List[int] = field(default_factory=list)
    #: True when only two ranks disagree and nothing says which one is wrong.
    ambiguous: bool = False
    #: what decided which side is wrong: "majority", "history" (the op the call site always
    #: issued before) or "tie" (nothing: ``ambiguous``).
    basis: str = "majority"


@dataclass
class Lag:
    """Ranks that are merely behind in ``group``: what they issued there is a prefix of what the others
    issued, their last op completed, and the others wait (pending) in ``waiting_in``, the op they
    have not reached. Not a divergence: the records cannot say why they are behind (a DataLoader
    batch, a lock, a slow step); their stacks can.
    """

    group: str
    ranks: List[int]
    #: the op the other ranks are blocked in and these ranks never issued.
    waiting_in: CollectiveRecord
    #: the ranks blocked in ``waiting_in``.
    waiting: List[int]
    index: int
    summary: str


@dataclass
class StreamMismatch:
    group: str
    index: int
    ranks: List[int]
    expected: CollectiveRecord
    actual: CollectiveRecord
    agreeing: List[int]
    what: str  # "stream" or "phase"
    summary: str


def site(rec: Optional[CollectiveRecord]) -> str:
    """``train.py:30`` from ``/path/train.py:30:main``."""
    if rec is None or not rec.call_site:
        return "?"
    parts = rec.call_site.rsplit(":", 2)
    if len(parts) == 3 and parts[1].isdigit():
        return f"{os.path.basename(parts[0])}:{parts[1]}"
    return os.path.basename(rec.call_site)


def _what(rec: CollectiveRecord) -> str:
    """``broadcast #4 (src=0, [8] float32)``."""
    inner = rec.describe()[len(rec.op):].strip("()")
    return f"{rec.op} #{rec.seq}" + (f" ({inner})" if inner else "")


def one_origin(records: Iterable[CollectiveRecord]) -> List[CollectiveRecord]:
    """Per rank, the records of one origin: hangdoc's own when a rank has both hangdoc records and
    a Flight Recorder dump of the same calls (their numbering differs, mixing them would misalign)."""
    records = list(records)
    origins: Dict[int, set] = defaultdict(set)
    for r in records:
        origins[r.rank].add(r.origin)
    if all(len(o) == 1 for o in origins.values()):
        return records
    return [r for r in records if len(origins[r.rank]) == 1 or r.origin == "hangdoc"]


def _by_group(records: Iterable[CollectiveRecord]) -> Dict[str, Dict[int, List[CollectiveRecord]]]:
    groups: Dict[str, Dict[int, List[CollectiveRecord]]] = defaultdict(lambda: defaultdict(list))
    for r in one_origin(records):
        groups[r.group][r.rank].append(r)
    for per_rank in groups.values():
        for lst in per_rank.values():
            lst.sort(key=lambda r: r.seq)
    return groups


def collectives(records: Iterable[CollectiveRecord]) -> Dict[str, Dict[int, List[CollectiveRecord]]]:
    """Group -> rank -> its collective (non-p2p) records in issue order."""
    return _by_group(r for r in records if r.op not in P2P_OPS)


def _lcs(a: Sequence, b: Sequence) -> int:
    if not a or not b:
        return 0
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def _classify(a: Sequence, b: Sequence) -> str:
    """How ``a`` (a rank) departs from ``b`` (the majority) at their first elements.

    Each explanation is scored by how much of the window still lines up after it (an LCS); the
    best one wins, ties going to the plainest (a different op, then a skipped one, then an extra
    one, then two swapped).
    """
    a, b = a[:WINDOW], b[:WINDOW]
    scores = {
        "signature": _lcs(a[1:], b[1:]),
        "missing": _lcs(a, b[1:]),
        "extra": _lcs(a[1:], b),
        "order": 2 + _lcs(a[2:], b[2:]) if len(a) > 1 and len(b) > 1 and a[0] == b[1] and a[1] == b[0] else -1,
    }
    best = max(scores.values())
    for kind in ("signature", "missing", "extra", "order"):
        if scores[kind] == best:
            return kind
    return "signature"


def _mismatch_detail(exp: CollectiveRecord, act: CollectiveRecord) -> str:
    if exp.op != act.op:
        return "op"
    parts = []
    if exp.shapes != act.shapes:
        parts.append("shape")
    if exp.dtypes != act.dtypes:
        parts.append("dtype")
    if exp.root != act.root:
        parts.append("root")
    return "/".join(parts) or "signature"


def _trim_start(per_rank: Dict[int, List[CollectiveRecord]], wrapped: bool = True) -> Dict[int, List[CollectiveRecord]]:
    """A wrapped ring buffer loses old records: start every rank at the latest common first seq.

    ``wrapped`` says whether any rank of the group lost records at all: sequence numbers count
    send/recv too, so ranks of a pipeline start their collectives at different seqs with nothing lost.
    """
    firsts = [lst[0].seq for lst in per_rank.values() if lst]
    start = max(firsts) if firsts else 0
    if not wrapped or start == 0 or len(set(firsts)) == 1:
        return per_rank
    return {r: [x for x in lst if x.seq >= start] for r, lst in per_rank.items()}


def _aligned_groups(records: Iterable[CollectiveRecord]) -> Dict[str, Dict[int, List[CollectiveRecord]]]:
    """Group -> rank -> collectives, trimmed to a common start only where a ring buffer wrapped."""
    records = list(records)
    first_any: Dict[Tuple[str, int], int] = {}
    for r in one_origin(records):
        key = (r.group, r.rank)
        if key not in first_any or r.seq < first_any[key]:
            first_any[key] = r.seq
    groups = collectives(records)
    return {
        name: _trim_start(per_rank, wrapped=any(first_any.get((name, rank), 0) > 0 for rank in per_rank))
        for name, per_rank in groups.items()
    }


#: the recorder's sequence of new_group calls (hangdoc.runtime.recorder.CREATION_GROUP)
CREATION = "new_group"


def _creations_of_all(groups: Dict[str, Dict[int, List[CollectiveRecord]]], records: List[CollectiveRecord]) -> None:
    """Every rank of the job takes part in the sequence of group creations, members or not
    (torch.distributed's contract): a rank with a whole history (its records from its first call
    on) but no creation at all skipped them (DeviceMesh built by every rank but one, whose fallback
    path never calls init_device_mesh), as one with fewer would have."""
    creation = groups.get(CREATION)
    if not creation:
        return
    first: Dict[int, int] = {}
    for r in one_origin(records):
        if r.group != CREATION and r.op not in P2P_OPS:
            first[r.rank] = min(first.get(r.rank, r.seq), r.seq)
    for rank, seq in first.items():
        if rank not in creation and seq == 0:
            creation[rank] = []


def divergences(records: Iterable[CollectiveRecord], hung: bool = False) -> List[Divergence]:
    """The divergences of every group, first divergence of each group first (see module doc).

    ``hung``: the records come from a hung job, every rank still alive and blocked somewhere. Then a
    rank whose records are a prefix of the others' while they wait for it is *behind* (see
    :func:`lags`), not diverging. Without it (records of ranks that ran to their end, as the pytest
    plugin has them) that rank issued fewer collectives than the others: a divergence.
    """
    out: List[Divergence] = []
    records = list(records)
    groups = _aligned_groups(records)
    _creations_of_all(groups, records)
    for name in sorted(groups, key=lambda g: (g != "default_pg", g)):
        out.extend(_align_group(name, groups[name], hung)[0])
    out.sort(key=lambda d: (d.group != "default_pg", d.group, d.index))
    return out


def _align_group(name: str, per_rank: Dict[int, List[CollectiveRecord]], hung: bool = False):
    """Walk the columns of one group; returns (divergences, stream mismatches)."""
    sigs = {r: [x.signature() for x in lst] for r, lst in per_rank.items()}
    pos = {r: 0 for r in per_rank}
    active = set(per_rank)
    found: List[Divergence] = []
    streams: List[StreamMismatch] = []
    lags: List[Lag] = []
    history: Counter = Counter()
    # (previous signature, signature) over agreed columns: what a loop body issues after what.
    follows: Counter = Counter()
    column = 0
    guard = sum(len(v) for v in sigs.values()) * 2 + 10
    while active and guard > 0:
        guard -= 1
        here = {r: sigs[r][pos[r]] for r in active if pos[r] < len(sigs[r])}
        ended = [r for r in active if pos[r] >= len(sigs[r])]
        if not here:
            break
        counts = Counter(here.values())
        n_top = max(counts.values())
        # Ties (two ranks, say) leave no majority: the side that continues the loop's period wins
        # (a broadcast every third step: the rank that issued it keeps the period); then the side
        # that continues the way earlier iterations went on from the previous op (in a loop that
        # issues all_reduce then broadcast, the rank that skipped the broadcast is the one issuing
        # all_reduce twice); then the side that repeats what its call site always issued before;
        # failing that, the lowest rank's side, flagged ambiguous.
        top = here[min(r for r, s in here.items() if counts[s] == n_top)]
        basis = "majority"
        if sum(1 for c in counts.values() if c == n_top) > 1:
            tied = {sg for sg in here.values() if counts[sg] == n_top}
            first_r = min(r for r, sg in here.items() if sg in tied)
            predicted = periodic_next(sigs[first_r][:pos[first_r]])
            due = stride_due(sigs[first_r][:pos[first_r]], tied)
            fam = {}
            for r, sg in here.items():
                if counts[sg] == n_top:
                    x = per_rank[r][pos[r]]
                    prev = sigs[r][pos[r] - 1] if pos[r] else None
                    fam[sg] = max(fam.get(sg, (0, 0, 0, 0)),
                                  (due.get(sg, 0), sg == predicted, follows[(prev, sg)], history[(x.call_site, sg)]))
            best = max(fam.values())
            winners = [sg for sg, f in fam.items() if f == best]
            skipped = _skipped_creation(tied, here, sigs, pos)
            if skipped is not None:
                top, basis = skipped, "contract"
            elif len(winners) == 1:
                top, basis = winners[0], "history"
            else:
                basis = "tie"
        if len(counts) == 1 and not ended:
            _check_streams(name, column, {r: per_rank[r][pos[r]] for r in here}, streams,
                           {r: per_rank[r][pos[r] - 1] if pos[r] else None for r in here})
            for r in here:
                history[(per_rank[r][pos[r]].call_site, here[r])] += 1
                follows[(sigs[r][pos[r] - 1] if pos[r] else None, here[r])] += 1
                pos[r] += 1
            column += 1
            continue
        majority = [r for r, s in here.items() if s == top]
        # The representative is the majority rank that went furthest: it shows what came next.
        rep = min(majority, key=lambda r: (pos[r] - len(sigs[r]), r))
        if ended:
            finished = [r for r in ended if _went_elsewhere(per_rank[r])]
            waiting = [r for r in ended if r not in finished]
            active.difference_update(waiting)  # blocked at an earlier op: fallout, not a cause
            blocked_here = sorted(r for r in here if per_rank[r][pos[r]].state == "issued")
            if hung and finished and blocked_here:
                # The finished ranks issued a prefix of what the others issued, and the others wait in
                # the next op for them: they are behind, not diverging (no different op, nothing after).
                exp = per_rank[blocked_here[0]][pos[blocked_here[0]]]
                lags.append(Lag(name, sorted(finished), exp, blocked_here, column,
                                f"{describe_ranks(finished)} {'has' if len(finished) == 1 else 'have'} not issued "
                                f"{_what(exp)} that {describe_ranks(blocked_here)} {'waits' if len(blocked_here) == 1 else 'wait'} "
                                f"in at {site(exp)}: {'its' if len(finished) == 1 else 'their'} last op in group {name} "
                                f"completed and {'it' if len(finished) == 1 else 'they'} issued nothing after it "
                                f"(behind, blocked outside collectives)"))
                active.difference_update(finished)
                finished = []
            # Two ranks, one went elsewhere, one waits in an op the loop always issues next: the
            # waiting rank is on the expected path, the one that went elsewhere is missing.
            expected = len(finished) == len(here) and all(
                follows[(sigs[r][pos[r] - 1] if pos[r] else None, here[r])] for r in here)
            if finished and len(finished) >= len(here) and not expected:
                # Most ranks issued nothing more here: the ones that did are the odd ones out.
                for r in sorted(here):
                    found.append(_extra_at_end(name, column, per_rank, r, pos[r], finished))
                    active.discard(r)
                break
            for r in finished:
                exp = per_rank[rep][pos[rep]]
                found.append(_divergence(name, "missing", [r], exp, None, column, majority))
                active.discard(r)
            if len(counts) == 1:
                continue
        ambiguous = basis == "tie"
        deviants = sorted(r for r, s in here.items() if s != top)
        for r in deviants:
            kind = _classify(sigs[r][pos[r]:], sigs[rep][pos[rep]:])
            exp = per_rank[rep][pos[rep]]
            act = per_rank[r][pos[r]]
            d = _divergence(name, kind, [r], exp, act, column, majority)
            d.ambiguous, d.basis = ambiguous, basis
            if ambiguous:
                d.summary = (f"{describe_ranks([r])} and {describe_ranks(majority)} disagree at op #{exp.seq} "
                             f"of group {name}: " + d.summary)
            found.append(d)
            active.discard(r)
        for r in active:
            if r in here:
                pos[r] += 1
        column += 1
    return found, streams, lags


def _skipped_creation(tied: set, here: Dict[int, Any], sigs: Dict[int, List[Any]], pos: Dict[int, int]) -> Optional[Any]:
    """Of tied ``new_group`` calls, the one the other side never makes: torch.distributed's contract
    is that every rank calls new_group for every group, members or not, in one order, so the side
    without it skipped it (``if rank in (0, 1): new_group([0, 1])``), whatever the count."""
    if not all(sg[0] == "new_group" for sg in tied):
        return None
    rest = {r: set(sigs[r][pos[r]:pos[r] + 256]) for r in here}
    found = [sg for sg in tied if not any(sg in rest[r] for r, s2 in here.items() if s2 != sg)]
    return found[0] if len(found) == 1 else None


def lags(records: Iterable[CollectiveRecord]) -> List[Lag]:
    """Ranks that are behind (a prefix of the others' sequence) while the others wait for them.

    >>> from hangdoc.model import CollectiveRecord as R
    >>> recs = [R(rank=r, seq=i, op="all_reduce", state="completed" if i < 2 or r == 1 else "issued")
    ...         for r in range(3) for i in range(3 if r != 1 else 2)]
    >>> [(x.ranks, x.waiting, x.waiting_in.seq) for x in lags(recs)], divergences(recs, hung=True)
    ([([1], [0, 2], 2)], [])
    """
    out: List[Lag] = []
    groups = _aligned_groups(records)
    for name in sorted(groups, key=lambda g: (g != "default_pg", g)):
        out.extend(_align_group(name, groups[name], True)[2])
    return out


def _went_elsewhere(lst: List[CollectiveRecord]) -> bool:
    """True when a rank's last op in this group completed: it is now busy somewhere else. Not when
    it failed (the call raised: a peer gone, a timeout): the rank stopped there, as one still in it."""
    return not lst or lst[-1].state not in ("issued", "failed")


def _divergence(name, kind, ranks, exp, act, column, agreeing) -> Divergence:
    who = describe_ranks(ranks)
    others = describe_ranks(agreeing)
    if kind == "missing":
        s = f"{who} never issued {_what(exp)} that {others} issued at {site(exp)}"
        if act is not None:
            s += f"; {who} went on to {act.op} at {site(act)}"
        else:
            s += f"; {who} issued nothing more in group {name} after its last op completed"
        return Divergence(name, kind, ranks, exp, act, column, s, sorted(agreeing))
    if kind == "extra":
        s = (f"{who} issued an extra {act.describe()} at {site(act)} that {others} never issued "
             f"(they went on to {_what(exp)} at {site(exp)})")
        return Divergence(name, kind, ranks, exp, act, column, s, sorted(agreeing))
    if kind == "order":
        s = (f"{who} issued {act.describe()} at {site(act)} and {exp.describe()} in the opposite order "
             f"to {others}")
        return Divergence(name, kind, ranks, exp, act, column, s, sorted(agreeing))
    detail = _mismatch_detail(exp, act)
    s = (f"{who} issued {act.describe()} at {site(act)} where {others} issued {_what(exp)} "
         f"at {site(exp)} ({detail} mismatch)")
    return Divergence(name, "signature", ranks, exp, act, column, s, sorted(agreeing))


def _extra_at_end(name, column, per_rank, r, p, finished) -> Divergence:
    act = per_rank[r][p]
    last = per_rank[finished[0]][-1] if per_rank[finished[0]] else None
    s = (f"{describe_ranks([r])} issued {_what(act)} at {site(act)} that {describe_ranks(finished)} never issued"
         + (f" (their last op in group {name} was {_what(last)}, completed)" if last else ""))
    return Divergence(name, "extra", [r], last, act, column, s, sorted(finished))


#: the longest loop period looked for in a rank's history of calls
MAX_PERIOD = 64


def periodic_next(seq: Sequence[object]) -> Optional[object]:
    """What a repeating history of calls issues next, or None when it does not repeat.

    The period is the one that explains the longest stretch at the end of ``seq`` (at least two
    whole periods): a loop that all-reduces every step and broadcasts every third step repeats with
    period 4 (all_reduce, broadcast, all_reduce, all_reduce), not 1, though its last three calls are
    all all_reduces.

    >>> periodic_next(["ar", "bc", "ar", "ar", "ar", "bc", "ar", "ar", "ar"])
    'bc'
    >>> periodic_next(["ar", "bc", "x"]) is None
    True
    """
    n = len(seq)
    best_p, best_len = 0, 0
    for p in range(1, min(n // 2, MAX_PERIOD) + 1):
        i = n - 1
        while i >= p and seq[i] == seq[i - p]:
            i -= 1
        covered = (n - 1 - i) + p
        if covered >= 2 * p and covered > best_len:
            best_p, best_len = p, covered
    return seq[n - best_p] if best_p else None


def stride_due(seq: Sequence[object], tied: Iterable[object]) -> Dict[object, int]:
    """Of two calls the sides disagree on, whether the rarer one is due now by its stride: the
    number of the commoner call between its earlier occurrences (from the start when it occurred
    once), counted over ``seq`` (the history both sides agreed on) with every other call left out.
    A periodic call keeps its stride across calls made between (a checkpoint's barrier, a resume's
    broadcasts), where the last few calls alone read as a loop of the commoner call. ``{rare: 1,
    common: -1}`` when it is due, the other way round when it comes early, ``{}`` when its strides
    disagree or nothing says.

        >>> ar, ag = "all_reduce", "all_gather"
        >>> stride_due([ar] * 4 + [ag] + [ar, ar, "barrier", "broadcast", ar, ar], {ar, ag})
        {'all_gather': 1, 'all_reduce': -1}
        >>> stride_due([ar] * 4 + [ag] + [ar, ar], {ar, ag})
        {'all_gather': -1, 'all_reduce': 1}
        >>> stride_due([ar, ag, ar, ar, ag, ar, ar, ar, ag, ar], {ar, ag})  # strides 2, then 3
        {}
    """
    both = list(tied)
    if len(both) != 2:
        return {}
    counts = Counter(x for x in seq if x in both)
    common, rare = sorted(both, key=lambda x: (-counts[x], str(x)))
    if not counts[rare] or counts[rare] == counts[common]:
        return {}
    strides, run = [], 0
    for x in seq:
        if x == common:
            run += 1
        elif x == rare:
            strides.append(run)
            run = 0
    if len(strides) > 1:
        strides = strides[1:]  # between occurrences (the first may follow a warm-up)
    if len(set(strides)) != 1 or not strides[0]:
        return {}
    if run == strides[0]:
        return {rare: 1, common: -1}
    if run < strides[0]:
        return {rare: -1, common: 1}
    return {}


def _check_streams(name, column, recs: Dict[int, CollectiveRecord], out: List[StreamMismatch],
                   prev: Optional[Dict[int, Optional[CollectiveRecord]]] = None) -> None:
    if out and out[-1].group == name:
        return  # the first misplacement of a group is the cause; later ones are usually the same bug
    for what in ("stream", "phase"):
        values = {r: getattr(x, what) for r, x in recs.items() if getattr(x, what) is not None}
        if len(values) < 2 or len(set(values.values())) == 1:
            continue
        counts = Counter(values.values())
        ranked = counts.most_common()
        if len(ranked) > 1 and ranked[0][1] == ranked[1][1]:
            # No majority (two ranks): the side that left the stream its previous op of this group
            # was on is the misplaced one; if both or neither did, nothing says which.
            moved = {r for r, v in values.items() if prev and prev.get(r) is not None
                     and getattr(prev[r], what) is not None and getattr(prev[r], what) != v}
            if not moved or len(moved) == len(values):
                continue
            bad = sorted(moved)
            good = sorted(r for r in values if r not in moved)
        else:
            top = ranked[0][0]
            bad = sorted(r for r, v in values.items() if v != top)
            good = sorted(r for r, v in values.items() if v == top)
        exp, act = recs[good[0]], recs[bad[0]]
        s = (f"{describe_ranks(bad)} issued {_what(act)} at {site(act)} on {what} {getattr(act, what)!r} where "
             f"{describe_ranks(good)} issued it on {what} {getattr(exp, what)!r}")
        out.append(StreamMismatch(name, column, bad, exp, act, good, what, s))
        return


def stream_mismatches(records: Iterable[CollectiveRecord]) -> List[StreamMismatch]:
    """Aligned collectives issued on a different CUDA stream (or phase) on a minority of ranks."""
    out: List[StreamMismatch] = []
    groups = _aligned_groups(records)
    for name in sorted(groups):
        out.extend(_align_group(name, groups[name])[1])
    return out


def counts(records: Iterable[CollectiveRecord]) -> Dict[str, Dict[int, Tuple[int, int]]]:
    """Group -> rank -> (issued, completed) collective counts: who lags and who leads."""
    out: Dict[str, Dict[int, Tuple[int, int]]] = {}
    for name, per_rank in collectives(records).items():
        out[name] = {r: (len(lst), sum(1 for x in lst if x.state == "completed")) for r, lst in per_rank.items()}
    return out
