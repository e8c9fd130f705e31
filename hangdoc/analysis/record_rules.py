"""Findings from collective records: the exact culprit where stacks are ambiguous.

Reads ``report.job.records`` (the recorder's JSONL files, Flight Recorder dumps) and emits:

* ``collective-mismatch``: the first divergence of each process group (a rank that skipped an op,
  issued an extra one, a different one, or two in swapped order), or a wait-for cycle made of
  collectives (two groups entered in opposite orders);
* ``p2p-cycle``: a cycle of blocked send/recv calls, shown rank by rank;
* ``stream-misplacement``: an aligned collective issued on another CUDA stream (or phase) by a
  minority of ranks;
* ``missing-rank``: a rank the records' world size implies but that left no record and no stack;
* ``collective-wait``: every rank of a group sits in the same collective and none completed it; or
  some ranks wait in a collective for ranks that are merely *behind* (they issued a prefix of the
  others' sequence and nothing after it): that is no divergence, and the records cannot say why
  they are behind, so the finding stays below the stack verdicts (at most 0.7); when the stacks of
  the ranks that are behind show them blocked outside collectives, it names them as culprits and
  is a ``collective-mismatch`` (ranks in no collective while the others wait in one).

Record verdicts are exact, so they carry a higher confidence (0.9-0.95) than stack-only findings
(at most 0.8) and become the headline. One finding per verdict: later ops are fallout, summarised in
the evidence, never reported one by one.

    >>> from hangdoc.model import CollectiveRecord as R, Job, Report
    >>> recs = [R(rank=r, seq=i, op=op, call_site=f"train.py:{30 + i}:main", state="completed")
    ...         for r in range(3) for i, op in enumerate(["all_reduce", "broadcast", "all_reduce"])
    ...         if not (r == 2 and op == "broadcast")]
    >>> findings(Report(job=Job(records=recs)))[0].summary
    'rank 2 skipped broadcast #1 (train.py:31); everything after it is fallout'
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

from hangdoc.analysis import sequence, wait_for
from hangdoc.model import CollectiveRecord, Culprit, Finding, Report
from hangdoc.ranges import MAX_LISTED, MAX_RUNS, RankSet
if TYPE_CHECKING:
    from hangdoc.analysis.signatures import Wait
# finding text: long rank lists end in "… and N more" (the culprits keep every rank)
from hangdoc.ranges import describe_ranks_capped as describe_ranks

CONFIDENCE_EXACT = 0.95
CONFIDENCE_CYCLE = 0.93
CONFIDENCE_STREAM = 0.92
#: two ranks disagree and nothing says which one is wrong: still above any stack-only verdict.
CONFIDENCE_TIE = 0.85
CONFIDENCE_MISSING = 0.9
CONFIDENCE_HISTORY = 0.9
CONFIDENCE_ALL_WAIT = 0.6
#: ranks behind, their stacks show them blocked elsewhere (a DataLoader wait, a lock): a candidate.
CONFIDENCE_LAG_STACKS = 0.7
#: ranks behind, no stack says why: the others wait for them, no more.
CONFIDENCE_LAG = 0.5


def _culprits(report: Report, ranks: List[int]) -> List[Culprit]:
    by_rank: Dict[int, Culprit] = {}
    for rec in report.job.records:
        if rec.rank in ranks and rec.rank not in by_rank and (rec.host or rec.pid):
            by_rank[rec.rank] = Culprit(host=rec.host, pid=rec.pid, rank=rec.rank)
    for p in report.job.processes:
        if p.rank in ranks and p.rank not in by_rank:
            by_rank[p.rank] = Culprit(host=p.host, pid=p.pid, rank=p.rank)
    return [by_rank.get(r, Culprit(rank=r)) for r in sorted(set(ranks))]


def _pending_lines(records: List[CollectiveRecord], limit: int = 8) -> List[str]:
    lines = []
    pend = wait_for.pending(records)
    for rank in sorted(pend)[:limit]:
        first = pend[rank][0]
        more = len(pend[rank]) - 1
        lines.append(
            f"rank {rank} is blocked in {first.describe()} #{first.seq} of group {first.group} "
            f"issued at {sequence.site(first)}, never completed" + (f" (+{more} more pending)" if more else "")
        )
    if len(pend) > limit:
        lines.append(f"... and {len(pend) - limit} more ranks with pending calls")
    return lines


def _count_lines(records: List[CollectiveRecord], group: str) -> List[str]:
    per_rank = sequence.counts(records).get(group, {})
    if not per_rank:
        return []
    by_count: Dict[int, List[int]] = {}
    for rank, (issued, _done) in per_rank.items():
        by_count.setdefault(issued, []).append(rank)
    if len(by_count) < 2:
        return []
    parts = [f"{describe_ranks(rs)}: {n}" for n, rs in sorted(by_count.items(), reverse=True)]
    if len(parts) > MAX_RUNS:
        parts = parts[:MAX_RUNS - 1] + [f"… and {len(parts) - MAX_RUNS + 1} more counts"]
    return [f"collectives issued in group {group}: " + "; ".join(parts)]


def _headline(d: sequence.Divergence) -> str:
    who = describe_ranks(d.ranks)
    exp, act = d.expected, d.actual
    if d.kind == "missing" and exp is not None:
        return f"{who} skipped {exp.op} #{exp.seq} ({sequence.site(exp)}); everything after it is fallout"
    if d.kind == "extra" and act is not None:
        return (f"{who} issued an extra {act.op} ({sequence.site(act)}) that {describe_ranks(d.agreeing)} never "
                f"issued; everything after it is fallout")
    if d.kind == "order" and act is not None and exp is not None:
        return f"{who} issued {act.op} and {exp.op} in the opposite order ({sequence.site(act)}); the ranks deadlock"
    if act is not None and exp is not None:
        detail = sequence._mismatch_detail(exp, act)
        if detail == "op":
            return (f"{who} called {act.op} ({sequence.site(act)}) while {describe_ranks(d.agreeing)} called "
                    f"{exp.op} #{exp.seq} ({sequence.site(exp)})")
        return (f"{who} called {act.describe()} ({sequence.site(act)}) but {describe_ranks(d.agreeing)} called "
                f"{exp.describe()} ({detail} mismatch at {exp.op} #{exp.seq})")
    return d.summary


def _key(x: Optional[CollectiveRecord]) -> Tuple:
    return (x.op, x.call_site, x.shapes, x.dtypes, x.root) if x is not None else ()


def _together(divs: List[sequence.Divergence]) -> List[sequence.Divergence]:
    """Ranks that left the group the same way at the same op (two ranks that both skipped the same
    broadcast) are one divergence naming all of them: several culprits, one finding."""
    out: List[sequence.Divergence] = []
    for d in divs:
        for o in out:
            if (o.group, o.kind, o.index, _key(o.expected), _key(o.actual)) == \
                    (d.group, d.kind, d.index, _key(d.expected), _key(d.actual)):
                o.ranks = sorted(set(o.ranks) | set(d.ranks))
                o.agreeing = [r for r in o.agreeing if r not in o.ranks]
                break
        else:
            out.append(d)
    return out


def findings(report: Report) -> List[Finding]:
    """Findings from ``report.job.records`` (empty when there are none)."""
    records = sequence.one_origin(report.job.records)
    if not records:
        return []
    out: List[Finding] = []
    pending_ev = _pending_lines(records)

    seen_groups = set()
    divs = _together(sequence.divergences(records, hung=True))  # a hang: nobody ran to its end
    for d in divs:
        if d.group in seen_groups:
            continue
        seen_groups.add(d.group)
        same_group = [x for x in divs if x.group == d.group and x is not d]
        evidence = [d.summary]
        evidence += [x.summary for x in same_group[:3]]
        if len(same_group) > 3:
            evidence.append(f"... and {len(same_group) - 3} more divergences in group {d.group}")
        evidence += _count_lines(records, d.group)
        if d.ambiguous:
            evidence.append("only two sides disagree, so the records alone cannot say which one is wrong")
        elif d.basis == "contract":
            evidence.append(f"every rank must call new_group for every group, members or not, in the same order "
                            f"(torch.distributed's contract): {describe_ranks(d.ranks)} never called this one, so "
                            f"the groups {'it' if len(d.ranks) == 1 else 'they'} created after it are numbered "
                            f"differently from the others'")
        elif d.basis == "history":
            evidence.append(f"two sides disagree; {describe_ranks(d.agreeing)} kept the pattern of calls the job "
                            f"repeated before (a periodic call's stride, the loop's period, what followed the previous "
                            f"call, what this call site issued), so {describe_ranks(d.ranks)} is the odd one out")
        where = d.expected if d.kind == "missing" or d.actual is None else d.actual
        advice = [
            f"Look at {sequence.site(where)} on {describe_ranks(d.ranks)}: the ranks of group "
            f"{d.group} must issue the same collectives in the same order with the same shapes, dtypes and roots.",
        ]
        if d.basis == "contract":
            advice = [f"Call new_group at {sequence.site(where)} on every rank, members or not (a rank outside the "
                      f"group gets GroupMember.NON_GROUP_MEMBER back), and create groups in the same order everywhere."]
        elif d.kind == "missing":
            advice.append("A rank-dependent condition (if rank == ..., uneven data, an early exit) usually skips it.")
        out.append(Finding(
            kind="collective-mismatch", summary=_headline(d), culprits=_culprits(report, d.ranks),
            evidence=evidence, advice=advice, detail=list(pending_ev),
            confidence=CONFIDENCE_TIE if d.ambiguous else CONFIDENCE_HISTORY if d.basis == "history" else CONFIDENCE_EXACT,
        ))

    wrong = _wrong_peers(records)
    for f in wrong:
        f.evidence += pending_ev
    out.extend(wrong)
    explained = {c.rank for f in wrong for c in f.culprits}
    for c in wait_for.cycles(records):
        if explained and {n[0] for n in c.nodes} & explained:
            continue  # a cycle through a rank that receives from the wrong peer is its consequence
        ranks = [n[0] for n in c.nodes]
        p2p = all(r.op in sequence.P2P_OPS for r in c.records)
        streams = {n[1] for n in c.nodes}
        if p2p:
            kind, head = "p2p-cycle", f"send/recv cycle between {describe_ranks(ranks)}: each waits for the other"
            advice = ["Order sends and receives so that one side sends first (e.g. even ranks send, odd ranks "
                      "receive), or use batch_isend_irecv / isend+irecv for the whole exchange."]
        elif len(streams) > 1 and "host" not in streams:
            # (one stream on every rank, host or CUDA: an order deadlock, below; a host call of one
            # group, gloo's, against a CUDA call of another is no stream of the same work: below too)
            kind, head = "stream-misplacement", f"cross-stream deadlock between {describe_ranks(ranks)}"
            advice = ["Issue the same collective on the same stream on every rank."]
        elif (broke := _broke_period(report, records, c, pending_ev)) is not None:
            if not any(f.summary == broke.summary for f in out):
                out.append(broke)
            continue
        else:
            sides = _sides(records, c.records)
            ranks = sorted({r for side, _ in sides for r in side})
            sizes = sorted(len(side) for side, _ in sides)
            odd = [r for side, _ in sides if len(side) == sizes[0] for r in side]
            kind = "collective-mismatch"
            head = (" while ".join(f"{describe_ranks(side)} {'waits' if len(side) == 1 else 'wait'} in {x.op} of "
                                   f"group {x.group} ({sequence.site(x)})" for side, x in sides)
                    + ": the two sides entered the groups in opposite orders")
            advice = ["Every rank must enter shared process groups' collectives in the same order: "
                      + " and ".join(sequence.site(x) for _, x in sides) + " run in a different order on each side."]
            if len(sides) == 2 and sizes[0] < sizes[1]:
                # a minority side is the odd one (it created or entered the groups the other way)
                head += f"; {describe_ranks(odd)}, the smaller side, {'is' if len(odd) == 1 else 'are'} the odd one"
                ranks = sorted(odd)
                never = _never_issued(records, sides, odd)
                if never is not None:
                    head, advice = never
        if any(f.summary == head for f in out):
            continue  # the same cycle found through another rank of the same side
        out.append(Finding(kind=kind, summary=head, culprits=_culprits(report, ranks),
                           evidence=[c.summary], advice=advice, confidence=CONFIDENCE_CYCLE,
                           detail=list(pending_ev)))

    for m in sequence.stream_mismatches(records):
        head = (f"{describe_ranks(m.ranks)} issued {m.actual.op} #{m.actual.seq} ({sequence.site(m.actual)}) on "
                f"{m.what} {getattr(m.actual, m.what)!r}; the "
                f"other ranks issued it on {getattr(m.expected, m.what)!r}")
        out.append(Finding(
            kind="stream-misplacement", summary=head, culprits=_culprits(report, m.ranks),
            evidence=[m.summary], detail=list(pending_ev),
            advice=["Issue the op under the same torch.cuda.stream(...) context on every rank (and in the same "
                    "phase): NCCL orders work per stream, so a collective on another stream waits behind "
                    "unrelated work and the two streams deadlock across ranks."],
            confidence=CONFIDENCE_STREAM,
        ))

    out.extend(_lag_findings(report, records, pending_ev))
    out.extend(_missing_ranks(report, records))
    if not out:
        out.extend(_all_waiting(report, records))
    return out


CONFIDENCE_WRONG_PEER = 0.94


def _never_issued(records: List[CollectiveRecord], sides: List[Tuple[List[int], CollectiveRecord]],
                  odd: List[int]) -> Optional[Tuple[str, List[str]]]:
    """(headline, advice) when the smaller side of a two-group cycle issued nothing at all in the
    group the larger side waits in: it did not enter the groups in another order, it never entered
    that one (a checkpoint thread's barrier on a group of its own that one rank never starts)."""
    (big, x), (_, y) = sorted(sides, key=lambda s: -len(s[0]))
    if sequence.site(x) == sequence.site(y) or any(r.rank in odd and r.group == x.group for r in records):
        return None  # one line, two groups: the groups differ (created in another order), see the caller
    head = (f"{describe_ranks(odd)} never issued {x.op} #{x.seq} of group {x.group} that {describe_ranks(big)} issued at "
            f"{sequence.site(x)} and wait in; {describe_ranks(odd)} went on to {y.op} of group {y.group} "
            f"({sequence.site(y)}), which {describe_ranks(big)} cannot reach")
    advice = [f"Look at why {x.op} at {sequence.site(x)} never runs on {describe_ranks(odd)}: a rank-dependent "
              "condition (an interval, a flag) that decides whether it starts the call (or the thread that makes "
              "it) must agree on every rank of the group."]
    return head, advice


def _broke_period(report: Report, records: List[CollectiveRecord], c: wait_for.Cycle,
                  pending_ev: List[str]) -> Optional[Finding]:
    """A wait-for cycle through several groups (tensor-parallel and pipeline, say) where some of its
    ranks broke the period of calls their loop kept before, and the others kept theirs: those ranks
    skipped (or added) a call, and the cycle is its consequence. None when the history cannot tell."""
    from hangdoc.analysis.history import period_breaks

    ranks = sorted({n[0] for n in c.nodes})
    breaks = period_breaks(records, ranks)
    if not breaks or len(breaks) == len(ranks):
        return None  # nobody, or everybody: the history cannot tell the sides apart
    odd = sorted(breaks)
    first = breaks[odd[0]]
    missed = f"{first.expected[0]} ({first.expected[1]})"
    head = (f"{describe_ranks(odd)} skipped {missed}: {'it' if len(odd) == 1 else 'they'} went on to "
            f"{first.actual.op} ({sequence.site(first.actual)}) where every earlier iteration issued it; the "
            f"wait-for cycle through {describe_ranks(ranks)} that follows is its consequence")
    return Finding(
        kind="collective-mismatch", summary=head, culprits=_culprits(report, odd),
        evidence=[breaks[r].summary for r in odd[:MAX_RUNS]] + [
            f"{describe_ranks([r for r in ranks if r not in breaks])} kept their loops' pattern", c.summary],
        advice=[f"Look at the condition around {first.expected[1]} on {describe_ranks(odd)}: every rank of a "
                f"process group must issue its collectives every time the others do (a rank-dependent "
                f"shortcut, an uneven batch, an early continue usually skips one)."],
        detail=list(pending_ev), confidence=CONFIDENCE_CYCLE)


def _wrong_peers(records: List[CollectiveRecord]) -> List[Finding]:
    """A rank blocked receiving from a peer that sends it nothing, while another rank is blocked
    sending to it: its receive names the wrong peer (the sender is the one it should name)."""
    pending: Dict[int, CollectiveRecord] = {}
    for r in records:
        if r.state in ("issued", "scheduled", "started") and (r.rank not in pending or r.seq > pending[r.rank].seq):
            pending[r.rank] = r
    p2p = {k: v for k, v in pending.items() if v.op in sequence.P2P_OPS and v.peer is not None}
    out: List[Finding] = []
    for rank, x in sorted(p2p.items()):
        if "recv" not in x.op:
            continue
        peer = x.peer
        peer_sends_here = any("send" in y.op and y.peer == rank for q, y in p2p.items() if q == peer)
        senders = sorted(q for q, y in p2p.items() if "send" in y.op and y.peer == rank and q != peer)
        if peer_sends_here or not senders:
            continue
        s0 = p2p[senders[0]]
        out.append(_wrong_peer_finding(rank, x, senders, f"rank {senders[0]} waits in {s0.op} (peer={rank}) at "
                                       f"{sequence.site(s0)}", f"rank {peer} is " + (
                                           f"in {p2p[peer].op} (peer={p2p[peer].peer})" if peer in p2p else "not sending to it")))
    return out or _wrong_peers_by_count(records)


def _waits_for(records: List[CollectiveRecord], peer: int, rank: int) -> bool:
    """Whether ``peer``'s first call not seen completed waits for ``rank``: a receive from it, or a
    collective of a group holding ``rank`` that ``rank`` has not issued."""
    mine = sorted((r for r in records if r.rank == peer), key=lambda r: r.seq)
    y = next((r for r in mine if r.state in ("issued", "scheduled", "started")), None)
    if y is None:
        return False
    if y.op in sequence.P2P_OPS:
        return y.op not in sequence._SENDS and y.peer == rank
    if y.group_ranks and rank not in y.group_ranks:
        return False
    index = sum(1 for r in mine if r.group == y.group and r.op not in sequence.P2P_OPS and r.seq < y.seq)
    theirs = sum(1 for r in records if r.rank == rank and r.group == y.group and r.op not in sequence.P2P_OPS)
    return theirs <= index


def _wrong_peer_finding(rank: int, x: CollectiveRecord, senders: List[int], sender_line: str, peer_line: str,
                        more: str = "") -> Finding:
    peer = x.peer
    return Finding(
            kind="p2p-stall",
            summary=(f"rank {rank} receives from rank {peer} ({sequence.site(x)}), which sends it nothing{more}, while "
                     f"{describe_ranks(senders)} {'is' if len(senders) == 1 else 'are'} sending to it: rank {rank}'s "
                     f"peer is wrong (rank {senders[0]}, not {peer})"),
            culprits=[Culprit(host=x.host, pid=x.pid, rank=rank)],
            evidence=[f"rank {rank} waits in {x.op} (peer={peer}) at {sequence.site(x)}", sender_line, peer_line],
            advice=[f"Check how rank {rank} computes its source at {sequence.site(x)}: the pipeline's sender to it "
                    f"is rank {senders[0]}."],
            confidence=CONFIDENCE_WRONG_PEER)


def _wrong_peers_by_count(records: List[CollectiveRecord]) -> List[Finding]:
    """The same, counted in messages, for backends whose sends do not wait for their receive (NCCL
    completes a small send into the receiver's buffer; every rank's host issues on) and for batched
    sends and receives (``batch_isend_irecv``): a rank's first receive not seen completed is its
    k-th from ``peer``, which sent it fewer, and waits for this rank in turn (its own first call not
    completed is a receive from it, or a collective this rank has not reached: a peer held up
    elsewhere may still send), while a rank it received from before sent it more messages than it
    took. Only where every rank's records start at its first call (the counts are whole)."""
    sends: Dict[Tuple[int, int], int] = defaultdict(int)
    recvs: Dict[Tuple[int, int], int] = defaultdict(int)
    first: Dict[int, Tuple[CollectiveRecord, int]] = {}  # rank -> its first pending receive, and its number from that peer
    lows: Dict[Tuple[int, str], int] = {}  # (rank, group) -> its first number there
    # in the order each rank issued them (numbers count per group)
    for r in sorted(records, key=lambda r: (r.rank, r.time_issued if isinstance(r.time_issued, (int, float)) else 0.0, r.seq)):
        lows[(r.rank, r.group)] = min(lows.get((r.rank, r.group), r.seq), r.seq)
        if r.op not in sequence.P2P_OPS or r.peer is None:
            continue
        if r.op in sequence._SENDS:
            sends[(r.rank, r.peer)] += 1
            continue
        if r.state in ("issued", "scheduled", "started") and r.rank not in first:
            first[r.rank] = (r, recvs[(r.rank, r.peer)])
        recvs[(r.rank, r.peer)] += 1
    if any(v != 0 for v in lows.values()):
        return []  # a ring buffer that dropped its oldest calls: the counts are not whole
    ranks = {rank for rank, _ in lows}
    out = []
    for rank, (x, k) in sorted(first.items()):
        peer = x.peer
        if peer not in ranks or sends[(peer, rank)] > k or not _waits_for(records, peer, rank):
            continue  # its peer's records are not here, it sends that message, or it is held up elsewhere
        senders = sorted(q for q in ranks if q not in (rank, peer) and sends[(q, rank)] > recvs[(rank, q)] > 0)
        if not senders:
            continue
        q = senders[0]
        out.append(_wrong_peer_finding(
            rank, x, senders,
            f"rank {q} sent rank {rank} {sends[(q, rank)]} messages, of which rank {rank} received {recvs[(rank, q)]}",
            f"rank {peer} sent rank {rank} {sends[(peer, rank)]} messages in all: never its message #{k + 1}",
            " more" if sends[(peer, rank)] else ""))
    return out


def _sides(records: List[CollectiveRecord], blocked: List[CollectiveRecord]) -> List[Tuple[List[int], CollectiveRecord]]:
    """Each blocked call of a cycle with every rank blocked in that same call (group, seq, op): a
    cycle is found through one rank per side, but the whole side waits."""
    pending: Dict[int, CollectiveRecord] = {}
    for r in records:
        if r.state in ("issued", "scheduled", "started") and (r.rank not in pending or r.seq > pending[r.rank].seq):
            pending[r.rank] = r
    out = []
    for x in blocked:
        side = sorted(q for q, y in pending.items() if (y.group, y.seq, y.op) == (x.group, x.seq, x.op))
        out.append((side or [x.rank], x))
    return out


#: how a finding of ranks that are behind (_lag_findings) ends its summary (is_lag)
LAG_SUFFIX = "behind and never issued it"


def is_lag(f: Finding) -> bool:
    """Whether ``f`` is a finding of ranks that are merely behind (:func:`_lag_findings`)."""
    return f.summary.endswith(LAG_SUFFIX)


def _lag_findings(report: Report, records: List[CollectiveRecord], pending_ev: List[str]) -> List[Finding]:
    from hangdoc.analysis.signatures import DISTRIBUTED, wait_of

    out = []
    in_flight = {r.rank for r in records if r.state == "issued"}  # in a call of any group
    lags = sequence.lags(records)
    for lag in lags:
        x = lag.waiting_in
        stacks = {}
        for p in report.job.processes:
            if p.rank in lag.ranks and p.role != "dataloader-worker" and p.rank not in stacks:
                stacks[p.rank] = wait_of(p)
        elsewhere = sorted(r for r, w in stacks.items() if w.category not in DISTRIBUTED and w.category != "unknown")
        locked = [r for r in elsewhere if stacks[r].category == "lock" and stacks[r].detail.startswith("waiting for ")]
        if locked and len(locked) == len(lag.ranks):
            out.append(_blocked_finding(report, lag, {r: stacks[r] for r in locked}, pending_ev))
            continue
        evidence = [lag.summary]
        evidence += [f"rank {r}'s stack: {stacks[r].describe()}" for r in sorted(stacks)[:MAX_RUNS]]
        if len(stacks) > MAX_RUNS:
            evidence.append(f"… and {len(stacks) - MAX_RUNS} more ranks' stacks")
        # no stack of theirs, by their records in no call of any group either, the only ranks
        # behind (ranks behind in two groups may wait for each other in calls the records lack:
        # a pipeline's send/recv that Flight Recorder on gloo does not hold), and fewer than the
        # ranks that wait (one against one: the other may as well have issued an extra call)
        unseen = ([] if stacks or set(lag.ranks) & in_flight or len(lags) > 1 or len(lag.waiting) <= len(lag.ranks)
                  else sorted(lag.ranks))
        if elsewhere:
            evidence.append(f"the stacks show {describe_ranks(elsewhere)} blocked outside collectives: "
                            f"that is what the others wait for")
        elif unseen:
            # no stack of theirs at all (Flight Recorder dumps, records alone): their records say
            # they hold nothing in flight, so they stand outside any collective while the others
            # wait for them; what keeps them there is for their stacks to say
            evidence.append(f"no stack of {describe_ranks(unseen)} was given: by the records {'it stands' if len(unseen) == 1 else 'they stand'} "
                            f"outside any collective (nothing in flight) while the others wait for {'it' if len(unseen) == 1 else 'them'}; "
                            "its stack says why (`hangdoc dump`, `py-spy dump`)")
        else:
            evidence.append("the stacks do not show why they are behind (they wait in collectives or in what no "
                            "frame names); being behind alone blames nobody")
        named = elsewhere or unseen
        out.append(Finding(
            # ranks blocked outside any collective (by their stacks, or by their records when there
            # is no stack of theirs) while the others wait in one: a mismatch
            # (docs/findings/collective-mismatch.md); behind for no reason their stacks show: a wait
            kind="collective-mismatch" if named else "collective-wait",
            summary=(f"{describe_ranks(lag.waiting)} {'waits' if len(lag.waiting) == 1 else 'wait'} in {x.op} #{x.seq} "
                     f"({sequence.site(x)}) for {describe_ranks(lag.ranks)}, which {'is' if len(lag.ranks) == 1 else 'are'} "
                     f"{LAG_SUFFIX}"),
            culprits=_culprits(report, named),
            evidence=evidence, detail=list(pending_ev),
            advice=[f"Find out where {describe_ranks(lag.ranks)} {'is' if len(lag.ranks) == 1 else 'are'} instead: its "
                    f"stack (a DataLoader wait, a lock, a sleep, a slow step) says why the {x.op} never comes."],
            confidence=CONFIDENCE_LAG_STACKS if elsewhere else CONFIDENCE_LAG,
        ))
    return out


def _blocked_finding(report: Report, lag: sequence.Lag, waits: Dict[int, "Wait"], pending_ev: List[str]) -> Finding:
    """Ranks behind because each is blocked on a primitive its source line names (a lock taken
    twice, a child process that never ends): they will never issue the collective the others wait in."""
    x = lag.waiting_in
    ranks = sorted(waits)
    w0 = waits[ranks[0]]
    where = w0.frame.label() if w0.frame is not None else "?"
    return Finding(
        kind="collective-mismatch",
        summary=(f"{describe_ranks(ranks)} {'is' if len(ranks) == 1 else 'are'} blocked {w0.detail} at {where} and never "
                 f"issued {x.op} #{x.seq} ({sequence.site(x)}) that {describe_ranks(lag.waiting)} "
                 f"{'waits' if len(lag.waiting) == 1 else 'wait'} in"),
        culprits=_culprits(report, ranks),
        evidence=[f"rank {r}'s stack: {w.describe()}" for r, w in sorted(waits.items())[:MAX_RUNS]] + [lag.summary],
        advice=[f"Look at {where} on {describe_ranks(ranks)}: a non-reentrant lock taken twice, a lock another "
                f"thread holds (or held when the process forked), or a child process or thread that never ends. "
                f"`py-spy dump --native --pid PID` shows the C-level wait; `py-spy dump --subprocesses` a forked child's."],
        detail=list(pending_ev), confidence=CONFIDENCE_HISTORY)


def _world_size(report: Report, records: List[CollectiveRecord]) -> Optional[int]:
    sizes = [len(r.group_ranks) for r in records if r.group == "default_pg" and r.group_ranks]
    if sizes:
        return max(sizes)
    return report.job.world_size


def _missing_ranks(report: Report, records: List[CollectiveRecord]) -> List[Finding]:
    world = _world_size(report, records)
    if not world:
        return []
    have = {r.rank for r in records} | {p.rank for p in report.job.processes if p.rank is not None}
    missing = RankSet.missing(world, have)
    if report.job.processes:
        # The stack side reports the ranks the grouping already found missing; add only the rest.
        missing = missing.minus(report.missing_ranks)
    if not missing:
        return []
    return [Finding(
        kind="missing-rank",
        summary=f"{describe_ranks(missing)} left no records and no stacks (world size {world})",
        culprits=[Culprit(rank=r) for r in missing.first(MAX_LISTED)],
        evidence=[f"records came from {describe_ranks(r.rank for r in records)}"] + _listed_note(missing),
        advice=["Check whether those processes died, were never started, or wrote to another directory."],
        confidence=CONFIDENCE_MISSING,
    )]


def _listed_note(missing: RankSet) -> List[str]:
    if len(missing) <= MAX_LISTED:
        return []
    return [f"culprits name the first {MAX_LISTED} of the {len(missing)} missing ranks; the summary names them all"]


def _all_waiting(report: Report, records: List[CollectiveRecord]) -> List[Finding]:
    """Every rank of a group pending in the same aligned collective: the collective itself stalls."""
    out = []
    for group, per_rank in sequence.collectives(records).items():
        lasts = {r: lst[-1] for r, lst in per_rank.items() if lst}
        if len(lasts) < 2 or any(x.state != "issued" for x in lasts.values()):
            continue
        if len({x.signature() for x in lasts.values()}) != 1:
            continue
        x = next(iter(lasts.values()))
        out.append(Finding(
            kind="collective-wait",
            summary=f"all ranks of group {group} are in {x.op} #{x.seq} ({sequence.site(x)}) and none completed it",
            culprits=[],
            evidence=[f"{describe_ranks(lasts)} issued {x.describe()}"],
            advice=["The ranks agree; suspect the transport (network, NCCL/gloo timeouts) or a rank outside "
                    "the records."],
            confidence=CONFIDENCE_ALL_WAIT,
        ))
    return out
