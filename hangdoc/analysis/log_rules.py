"""Findings from what the job's console logs said (``Job.events``; see :mod:`hangdoc.readers.events`).

The logs know exact things the stacks do not: the sequence number, op and size of the collective
each rank's watchdog gave up on, how many collectives each rank had enqueued, which exception a
rank raised and when, how torchrun saw each rank end. The rules, strongest first:

- ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` named two different fingerprints, or ranks failed a monitored
  barrier: **collective-mismatch**, the odd side (both when there is no majority).
- ranks timed out at the same (group, seq) with a different op or size: **collective-mismatch**.
- a rank's last enqueued collective is lower than the one the others time out in: it never issued
  it: **collective-mismatch**, naming it.
- ranks time out at different sequence numbers of the same op: they disagree on how many
  collectives came before; the minority is off (both sides when there is no majority).
- a rank raised an exception of its own (not a timeout, an abort, a closed connection: those are
  fallout) or was killed, before the timeouts: **rank-failed**, the headline; torchrun's "Root
  Cause" is weighed against it and called out when it names a rank whose failure was fallout.
- the world size is known and one rank said nothing while all others timed out: **missing-rank**,
  a suspicion.
- everyone timed out at the same collective: **collective-wait**, no culprit.
"""

from __future__ import annotations

import re
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from hangdoc.model import Culprit, Finding, LogEvent, Report
from hangdoc.ranges import describe_ranks

__all__ = ["findings", "is_fallout"]

#: evidence lines of one finding drawn from the log
MAX_LINES = 6
_P2P_OPS = {"SEND", "RECV", "RECVANYSOURCE"}

# What a rank raises because *another* rank failed: timeouts, aborts, closed connections, the
# launcher's signals, DETAIL's own verdict (its rule reads it), a user's Ctrl-C.
_FALLOUT_RE = re.compile(
    r"Watchdog caught|[Tt]imed? ?out|[Tt]imeout|communicator was aborted|Connection (?:closed|reset)|"
    r"by peer|Broken pipe|DistBackendError|DistNetworkError|ProcessGroupNCCL|NCCL (?:error|communicator)|"
    r"nccl(?:Remote|System|Internal)Error|SignalException|SIGTERM|monitoredBarrier|"
    r"Detected mismatch between collectives|KeyboardInterrupt|terminate called|"
    r"Socket Timeout|Interrupted system call|failed to recv, got 0 bytes|Aborted|ChildFailedError")
_FALLOUT_SIGNALS = {"SIGABRT", "SIGTERM", "SIGINT", "SIGHUP"}


def is_fallout(text: str) -> bool:
    """Whether an exception's text is what a rank raises when *another* one failed.

    >>> is_fallout("torch.distributed.DistBackendError: NCCL communicator was aborted on rank 0.")
    True
    >>> is_fallout("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    False
    """
    return _FALLOUT_RE.search(text) is not None


def _c(e: LogEvent) -> Culprit:
    return Culprit(host=e.host, pid=e.pid, rank=e.rank)


def _cite(e: LogEvent) -> str:
    return f"{e.where}: {e.text[:200]}"


def _ranks(events: Iterable[LogEvent]) -> List[int]:
    return sorted({e.rank for e in events if e.rank is not None})


def _who(ranks: Sequence[int]) -> str:
    return describe_ranks(list(ranks)) if ranks else "an unknown rank"


def _cap(lines: List[str]) -> List[str]:
    return lines if len(lines) <= MAX_LINES else lines[:MAX_LINES] + [f"… and {len(lines) - MAX_LINES} more lines"]


def _culprits(events: Iterable[LogEvent], ranks: Iterable[int]) -> List[Culprit]:
    want = set(ranks)
    seen: Dict[int, Culprit] = {}
    for e in events:
        if e.rank in want and e.rank not in seen:
            seen[e.rank] = _c(e)
    for r in want:
        seen.setdefault(r, Culprit(rank=r))
    return [seen[r] for r in sorted(seen)]


def _minority(sides: Dict[object, List[int]]) -> Tuple[List[int], bool]:
    """(ranks of the odd sides, whether a majority exists) of ranks split by what they did."""
    sizes = sorted((len(v) for v in sides.values()), reverse=True)
    if len(sizes) < 2:
        return [], True
    if sizes[0] == sizes[1]:
        return sorted(r for v in sides.values() for r in v), False
    big = max(sides.values(), key=len)
    return sorted(r for v in sides.values() if v is not big for r in v), True


def stated_world_size(events: Iterable[LogEvent]) -> Optional[int]:
    """The largest world size a log states (``world-size`` events; fr_trace's ``world size`` of the
    default group), or None. Only the log rules use it: a rank with no dump is no news in a log.

    >>> from hangdoc.readers import read_text
    >>> stated_world_size(read_text("$ torchrun --nproc-per-node 4 train.py\\n").events)
    4
    """
    return _stated(events)[0]


def _stated(events: Iterable[LogEvent]) -> Tuple[Optional[int], Optional[LogEvent]]:
    best: Tuple[Optional[int], Optional[LogEvent]] = (None, None)
    for e in events:
        ws = e.fields.get("world_size")
        if type(ws) is not int:
            continue
        if e.kind == "world-size" or (e.kind == "missing" and "default_pg" in str(e.fields.get("group") or "")):
            if best[0] is None or ws > best[0]:
                best = (ws, e)
    return best


def findings(report: Report) -> List[Finding]:
    events = list(report.job.events)
    if not events:
        return []
    out: List[Finding] = []
    out.extend(_detail(events))
    out.extend(_divergence(events))
    out.extend(_fr_missing(events))
    out.extend(_timeouts(events, report))
    out.extend(_failed(events))
    return out


# --- hangdoc run --detect -------------------------------------------------------------------------------


def _side(entry) -> str:
    if isinstance(entry, list) and len(entry) >= 3:
        return f"{entry[1]} at {entry[2]}"
    return "(not in its recent window)"


def _divergence(events: List[LogEvent]) -> List[Finding]:
    out: List[Finding] = []
    for e in [x for x in events if x.kind == "divergence" and x.fields.get("deviants")][:4]:
        f = e.fields
        dev, agree = list(f["deviants"]), list(f.get("agreeing") or [])
        where = f"collective #{f.get('index')}" + ("" if f.get("exact", True) else " or earlier") + f" of {f.get('group')}"
        lines = [f"{_who(dev)}: {_side(f.get('deviant'))}", f"{_who(agree)}: {_side(f.get('expected'))}", _cite(e)]
        if f.get("basis") == "tie":
            both = sorted(set(dev) | set(agree))
            out.append(Finding("collective-mismatch",
                               f"{_who(dev)} and {_who(agree)} issued different collectives at {where} "
                               "(hangdoc --detect; two sides, no majority: either may be the wrong one)",
                               [Culprit(rank=r) for r in both], _cap(lines),
                               ["Compare both call sites; the in-job detector named the higher rank only because "
                                "it must name one."], 0.7))
        else:
            out.append(Finding("collective-mismatch", f"{_who(dev)} diverged from the other ranks at {where} "
                               f"(hangdoc --detect{', pattern' if f.get('basis') == 'pattern' else ''})",
                               [Culprit(rank=r) for r in dev], _cap(lines),
                               [f"Look at {_side(f.get('deviant'))} on {_who(dev)}: a rank-dependent branch "
                                "issued it instead of the others' collective."], 0.88))
    return out


# --- fr_trace ----------------------------------------------------------------------------------------


def _fr_missing(events: List[LogEvent]) -> List[Finding]:
    out: List[Finding] = []
    for e in [x for x in events if x.kind == "missing" and x.fields.get("missing")][:4]:
        missing = list(e.fields["missing"])
        expected = list(e.fields.get("expected") or [])
        joined = [r for r in expected if r not in missing]
        where = f"collective #{e.fields.get('seq')} ({e.fields.get('op', '?')}" + \
                (f" of group {e.fields['group']}" if e.fields.get("group") else "") + ")"
        lines = [f"fr_trace: {_who(joined) if joined else 'the other ranks'} issued {where}; {_who(missing)} did not",
                 _cite(e)]
        if e.fields.get("call_site"):
            lines.insert(1, f"issued at {e.fields['call_site']}")
        if joined and len(missing) < len(joined):
            out.append(Finding("collective-mismatch", f"{_who(missing)} never joined {where} that the other ranks issued",
                               [Culprit(rank=r) for r in missing], _cap(lines),
                               [f"Find what {_who(missing)} did instead of {where}: a skipped call under a "
                                "rank-dependent condition, or a wait elsewhere (its stack)."], 0.85))
        else:
            both = sorted(set(missing) | set(joined))
            out.append(Finding("collective-mismatch",
                               f"{_who(joined) if joined else 'some ranks'} issued {where} that {_who(missing)} did not, "
                               "and the missing side is not a minority: either it is stuck before that collective or the "
                               "others issued one too many",
                               [Culprit(rank=r) for r in both], _cap(lines),
                               ["fr_trace names the ranks *missing* from the first collective that did not complete; "
                                "compare both sides' call sites before blaming the missing ones."], 0.55))
    return out


# --- DETAIL and monitoredBarrier ------------------------------------------------------------------


def _detail(events: List[LogEvent]) -> List[Finding]:
    out: List[Finding] = []
    mism = [e for e in events if e.kind == "mismatch" and e.fields.get("sides")]
    if mism:
        prints: Dict[int, Tuple[object, ...]] = {}
        for e in mism:
            for s in e.fields.get("sides", []):
                r = s.get("rank")
                if isinstance(r, int):
                    prints.setdefault(r, (s.get("seq"), s.get("op"), s.get("shape"), s.get("dtype")))
        sides: Dict[object, List[int]] = {}
        for r, fp in prints.items():
            sides.setdefault(fp, []).append(r)
        odd, majority = _minority(sides)
        if len(sides) < 2:
            # the old one-sided message names only the reporting rank's own fingerprint
            odd, majority = sorted(prints), False
        desc = {fp: f"{fp[1]}" + (f" of shape [{fp[2]}]" if fp[2] is not None else "") + (f" {fp[3]}" if fp[3] else "")
                + (f" (SequenceNumber {fp[0]})" if fp[0] is not None else "") for fp in sides}
        lines = [f"{_who(rs)}: {desc[fp]}" for fp, rs in sorted(sides.items(), key=lambda kv: -len(kv[1]))]
        if mism[0].fields.get("differ"):
            lines.append(f"DETAIL says they differ in: {mism[0].fields['differ']}")
        lines.append(_cite(mism[0]))
        if majority:
            summary = (f"{_who(odd)} {'runs' if len(odd) == 1 else 'run'} a different collective than the other ranks "
                       "(TORCH_DISTRIBUTED_DEBUG=DETAIL)")
        elif len(odd) == 1:
            summary = (f"{_who(odd)} runs a collective that another rank does not (TORCH_DISTRIBUTED_DEBUG=DETAIL "
                       "printed only this side): it, or the rank it was compared with, is wrong")
        else:
            summary = f"{_who(odd)} run different collectives and no side is the majority: one of them is wrong"
        out.append(Finding("collective-mismatch", summary, _culprits(mism, odd), _cap(lines),
                           ["Compare the call sites of the two collectives: a rank-dependent branch or a different "
                            "model/data path issued a different op or shape.",
                            "DETAIL compares fingerprints pairwise; with two sides and no majority, read both call sites."],
                           0.95 if majority else 0.7))
    shape = [e for e in events if e.kind == "mismatch" and e.fields.get("check") and not e.fields.get("sides")]
    if shape and not mism:
        out.append(Finding("collective-mismatch",
                           f"the input shapes of collective {shape[0].fields.get('op') or ''} differ across ranks "
                           "(TORCH_DISTRIBUTED_DEBUG=DETAIL); the message does not name the other side",
                           [], _cap([_cite(e) for e in shape]),
                           ["Print the tensor shapes passed to that collective on every rank: one rank has a "
                            "different size (uneven data, a rank-dependent branch)."], 0.7))
    bar = [e for e in events if e.kind == "barrier" and e.fields.get("ranks")]
    if bar:
        late = sorted({r for e in bar for r in e.fields["ranks"]})
        out.append(Finding("collective-mismatch",
                           f"{_who(late)} did not reach monitoredBarrier: {'it is' if len(late) == 1 else 'they are'} "
                           "elsewhere (stuck, or in another collective)",
                           [Culprit(rank=r) for r in late], _cap(list(dict.fromkeys(_cite(e) for e in bar))),
                           [f"Dump the stack of {_who(late)} (`hangdoc dump` on its node) to see where it is."], 0.9))
    return out


# --- watchdog timeouts ------------------------------------------------------------------------------


def _timeouts(events: List[LogEvent], report: Report) -> List[Finding]:
    tos = [e for e in events if e.kind == "timeout" and e.fields.get("seq") is not None]
    states = [e for e in events if e.kind == "watchdog-state" and e.fields.get("failed") is not None]
    if not tos and not states:
        return []
    out: List[Finding] = []
    named = sorted({e.fields["group"] for e in tos + states if e.fields.get("group")})
    # torch prints "[Rank 0] Watchdog caught ..." with no group next to "[PG ID 0 ...(default_pg) Rank 0]
    # ... last enqueued": with one group named in the log, lines that name none are that group's
    default = named[0] if len(named) == 1 else None

    def gkey(e: LogEvent) -> str:
        return e.fields.get("group") or default or ""

    for g in sorted({gkey(e) for e in tos + states}):
        out.extend(_one_group(g or None, [e for e in tos if gkey(e) == g], [e for e in states if gkey(e) == g],
                              events, report))
    return out


def _gname(g: Optional[str]) -> str:
    return f"group {g}" if g else "their process group"


def _one_group(g: Optional[str], tos: List[LogEvent], states: List[LogEvent], events: List[LogEvent],
               report: Report) -> List[Finding]:
    # each rank's position: the seq its watchdog failed at, with the op/size when the line says
    pos: Dict[int, Tuple[int, Optional[str], Optional[int], LogEvent]] = {}
    for e in sorted(tos, key=lambda x: (x.time is None, x.time or 0.0, x.line)):
        if e.rank is not None and e.rank not in pos:
            pos[e.rank] = (e.fields["seq"], e.fields.get("op"), e.fields.get("numel_in"), e)
    enq: Dict[int, Tuple[int, int, Optional[int], LogEvent]] = {}
    for e in states:
        if e.rank is not None and e.rank not in enq:
            enq[e.rank] = (e.fields["failed"], e.fields.get("last_enqueued"), e.fields.get("last_completed"), e)
            if e.rank not in pos:
                pos[e.rank] = (e.fields["failed"], None, None, e)
    if not pos:
        return []
    if g is None:
        seqs: Dict[int, set] = {}
        for e in tos:
            if e.rank is not None:
                seqs.setdefault(e.rank, set()).add(e.fields["seq"])
        if any(len(v) > 1 for v in seqs.values()):
            # one rank timed out at several seqs: several process groups, and the lines name none
            return [Finding("collective-wait",
                            f"{_who(sorted(seqs))} timed out in collectives of several process groups (a rank reports "
                            "several SeqNums and the lines name no group): the log cannot align the ranks",
                            [], _cap([_cite(e) for e in tos[:3]]),
                            ["Newer torch names the group on every line ([PG ID n ...]); Flight Recorder dumps or "
                             "`hangdoc run --record` align the ranks per group."], 0.3)]
    # 1. one seq, different collectives
    by_seq: Dict[int, Dict[Tuple[Optional[str], Optional[int]], List[int]]] = {}
    for r, (seq, op, numel, _) in pos.items():
        if op is not None:
            by_seq.setdefault(seq, {}).setdefault((op, numel), []).append(r)
    for seq, sides in sorted(by_seq.items()):
        if len(sides) > 1:
            odd, majority = _minority(sides)
            lines = [f"{_who(sorted(rs))}: {op}" + (f" of {n} elements" if n is not None else "") + f" at SeqNum {seq}"
                     + _site_of(pos, rs)
                     for (op, n), rs in sorted(sides.items(), key=lambda kv: -len(kv[1]))]
            lines += [_cite(pos[r][3]) for r in odd[:2]]
            summary = (f"{_who(odd)} timed out in a different collective than the other ranks at SeqNum {seq} of "
                       f"{_gname(g)}" if majority else
                       f"{_who(odd)} time out in different collectives at SeqNum {seq} of {_gname(g)}, "
                       "with no majority: one side issued the wrong one")
            return [Finding("collective-mismatch", summary, _culprits(events, odd), _cap(lines),
                            ["The ranks issued their collectives in different orders (or with different sizes) from "
                             "this point: compare the code paths that lead to SeqNum "
                             f"{seq} on each side (a rank-dependent branch, uneven data)."],
                            0.9 if majority else 0.6)]
    # 2. a rank that never enqueued the collective the others wait in
    waiting_at = max(p[0] for p in pos.values())
    behind = sorted(r for r, (_, last, _, _) in enq.items() if last is not None and last < waiting_at)
    if behind and len(behind) < len(pos):
        ahead = sorted(r for r in pos if r not in behind)
        lines = [f"{_who(ahead)} {'waits' if len(ahead) == 1 else 'wait'} in SeqNum {waiting_at}" + _op_of(pos, ahead),
                 f"{_who(behind)}: last enqueued " + ", ".join(f"{enq[r][1]}" for r in behind[:4]) +
                 f" < {waiting_at}: never issued it"] + [_cite(enq[r][3]) for r in behind[:2]]
        return [Finding("collective-mismatch",
                        f"{_who(behind)} never issued collective #{waiting_at} of {_gname(g)} that "
                        f"{_who(ahead)} {'waits' if len(ahead) == 1 else 'wait'} in",
                        _culprits(events, behind), _cap(lines),
                        [f"Find what {_who(behind)} did instead: a skipped collective under a rank-dependent "
                         "condition, an early exit, or a wait elsewhere (its stack: `hangdoc dump`)."], 0.9)]
    # 3. ranks at different positions of the same op: one side is a collective off
    positions: Dict[int, List[int]] = {}
    for r, p in pos.items():
        positions.setdefault(p[0], []).append(r)
    if len(positions) > 1:
        ops = {p[1] for p in pos.values() if p[1] is not None}
        if len(ops) <= 1:
            odd, majority = _minority({k: sorted(v) for k, v in positions.items()})
            lines = [f"{_who(sorted(rs))}: timed out at SeqNum {seq}" + _op_of(pos, rs)
                     for seq, rs in sorted(positions.items())]
            lines += [_cite(pos[r][3]) for r in sorted(pos)[:2]]
            if majority:
                summary = (f"{_who(odd)} {'is' if len(odd) == 1 else 'are'} out of step with the other ranks of "
                           f"{_gname(g)}: {'its' if len(odd) == 1 else 'their'} watchdog fired at another SeqNum of the "
                           "same collective, so it issued a different number of collectives before it")
            else:
                summary = (f"{_who(odd)} are one or more collectives apart in {_gname(g)} and no side is the "
                           "majority: one skipped a collective the other issued (or issued an extra one)")
            return [Finding("collective-mismatch", summary, _culprits(events, odd), _cap(lines),
                            ["Look for a collective issued under a rank-dependent condition before this point (every "
                             "N steps, only on some ranks).",
                             "Flight Recorder (TORCH_NCCL_TRACE_BUFFER_SIZE) or `hangdoc run --record` shows the exact "
                             "call each rank issued at each SeqNum."],
                            0.8 if majority else 0.55)]
    # 4. all at one collective: a silent rank is the suspect when the world is known
    seq = next(iter(positions))
    ws, said = report.job.world_size, None
    if ws is None:
        ws, said = _stated(events)
    silent: List[int] = []
    if ws is not None and ws <= (1 << 20) and g in (None, "default_pg"):
        seen = set(pos)
        if len(seen) >= max(2, ws // 2):
            silent = [r for r in range(ws) if r not in seen][:64]
    if silent:
        lines = [f"{_who(sorted(pos))} timed out at SeqNum {seq}" + _op_of(pos, sorted(pos)),
                 f"the job has {ws} ranks; {_who(silent)} reported no timeout"]
        if said is not None:
            lines.append(f"world size {ws} from {_cite(said)}")
        lines += [_cite(pos[r][3]) for r in sorted(pos)[:1]]
        return [Finding("missing-rank",
                        f"{_who(silent)} reported no timeout while every other rank timed out at SeqNum {seq}: "
                        f"{'it' if len(silent) == 1 else 'they'} likely never reached that collective",
                        _culprits(events, silent), _cap(lines),
                        [f"Check the log of {_who(silent)} (it may be cut off, or its lines missing from this file) "
                         "and dump its stack: it is stuck elsewhere or dead."], 0.6)]
    lines = [f"{_who(sorted(pos))} timed out at SeqNum {seq}" + _op_of(pos, sorted(pos))]
    lines += [_cite(pos[r][3]) for r in sorted(pos)[:2]]
    ops = {p[1] for p in pos.values()}
    if ops and ops <= _P2P_OPS:
        return [Finding("p2p-stall",
                        f"{_who(sorted(pos))} all time out in {'/'.join(sorted(o for o in ops if o))}: every rank waits for a "
                        "peer and the log names none that sends (a send/recv cycle, or a peer elsewhere)",
                        [], _cap(lines),
                        ["Check the order of sends and receives on each side (every rank receiving first deadlocks); "
                         "batch them with `dist.batch_isend_irecv` or alternate the order by rank parity.",
                         "Stacks with `py-spy dump --locals` or `hangdoc run --record` name each wait's peer."], 0.6)]
    return [Finding("collective-wait",
                    f"{_who(sorted(pos))} timed out in the same collective (SeqNum {seq} of {_gname(g)}); the log does not "
                    "say which rank is behind",
                    [], _cap(lines),
                    ["Stacks of every rank (`hangdoc dump`, py-spy) or Flight Recorder dumps tell who is elsewhere; "
                     "a rank missing from this log is a suspect.",
                     "If every rank is really in it, the hang is below Python (network, NCCL): NCCL_DEBUG=INFO."], 0.5)]


def _site_of(pos: Dict[int, Tuple[int, Optional[str], Optional[int], LogEvent]], ranks: Sequence[int]) -> str:
    """" issued at f (file:line)" when Flight Recorder's stack under the timeout names one call site."""
    sites = {pos[r][3].fields.get("call_site") for r in ranks if r in pos} - {None}
    return f" issued at {next(iter(sites))}" if len(sites) == 1 else ""


def _op_of(pos: Dict[int, Tuple[int, Optional[str], Optional[int], LogEvent]], ranks: Sequence[int]) -> str:
    ops = {(pos[r][1], pos[r][2]) for r in ranks if r in pos and pos[r][1] is not None}
    at = _site_of(pos, ranks)
    if len(ops) != 1:
        return f" ({at.strip()})" if at else ""
    op, n = next(iter(ops))
    return f" ({op}" + (f", {n} elements" if n is not None else "") + ("," + at if at else "") + ")"


# --- a rank's own failure ------------------------------------------------------------------------------


def _failed(events: List[LogEvent]) -> List[Finding]:
    own = [e for e in events if e.kind == "exception" and e.fields.get("exc") and not is_fallout(str(e.fields["exc"]))]
    # a rank that timed out or raised a communication error exits with it: its exit is fallout too
    fallout_ranks = {e.rank for e in events if e.rank is not None and (
        e.kind in ("timeout", "watchdog-state", "peer-closed") or
        (e.kind == "exception" and e.fields.get("exc") and is_fallout(str(e.fields["exc"]))))}

    def own_exit(e: LogEvent) -> bool:
        return e.kind == "exit" and e.rank not in fallout_ranks and \
            not (e.fields.get("exc") and is_fallout(str(e.fields["exc"])))

    killed = [e for e in events if own_exit(e) and e.fields.get("signal") and e.fields["signal"] not in _FALLOUT_SIGNALS]
    exited = [e for e in events if own_exit(e) and not e.fields.get("signal") and (e.fields.get("exitcode") or 0) > 0]
    # an exit code alone blames a rank only when it is the one failure and the others are known to
    # be fine: the table says "<NO_OTHER_FAILURES>", or the agent tore the others down after it
    if len({e.rank for e in exited}) != 1 or not (
            any(e.fields.get("alone") for e in exited) or any(e.fields.get("by_agent") for e in events)):
        exited = []
    first_timeout = min((e.time for e in events if e.kind in ("timeout", "watchdog-state") and e.time is not None),
                        default=None)
    cands = own or killed or exited
    if not cands:
        return []
    cands.sort(key=lambda e: (e.time is None, e.time or 0.0, e.source, e.line))
    head = cands[0]
    after = first_timeout is not None and head.time is not None and head.time > first_timeout
    same = [e for e in cands if e.rank is not None and _what(e) == _what(head)]
    ranks = sorted({e.rank for e in same}) if head.rank is not None else []
    what = _what(head)
    where = f" at {head.fields['at']}" if head.fields.get("at") else ""
    who_ = _who(ranks) if ranks else "a rank"
    if own:
        summary = f"{who_} raised {what}{where}" + ("" if after else "; the other ranks then waited for it")
    elif killed:
        sig = head.fields.get("signal")
        summary = f"{who_} was killed by {sig}" + (" (the OOM killer sends SIGKILL)" if sig == "SIGKILL" else "")
    else:
        summary = (f"{who_} exited with code {head.fields.get('exitcode')} first; the log does not hold "
                   f"{'its' if len(ranks) <= 1 else 'their'} traceback")
    lines = list(dict.fromkeys(_cite(e) for e in same[:3]))
    pids = {e.pid for e in same if e.pid is not None}
    # a rankless line about the same process (torchrun's "Signal 9 received by PID") is not another rank
    others = [e for e in cands if e not in same and e.rank not in ranks and not (e.rank is None and
                                                                                (e.pid in pids or e.pid is None))]
    if others:
        lines.append("other ranks' own errors: " + "; ".join(f"rank {e.rank}: {_what(e)}" for e in others[:3]))
    roots = [e for e in events if e.kind == "exit" and e.fields.get("root")]
    for rc in roots[:1]:
        if rc.rank is not None and rc.rank not in ranks:
            lines.append(f"torchrun's \"Root Cause\" names rank {rc.rank}, whose failure was fallout "
                         f"({rc.fields.get('exc') or rc.fields.get('signal') or 'exit code ' + str(rc.fields.get('exitcode'))}): "
                         "it is only the first failure torchrun observed")
    if after:
        lines.append("its time stamp is after the first watchdog timeout: it may itself be fallout")
    advice = ([f"Fix the error on {who_} first: the other ranks' timeouts are its consequence."] if own else
              ["Check `dmesg` / the node's memory use around that time (OOM killer) and the job's memory limit."] if killed else
              [f"Find {who_}'s own output (its traceback is in its stderr, or in the error_file torchrun names; "
               "run with `torchrun --redirects 3 --log-dir DIR` or decorate main with @record)."])
    conf = 0.6 if after else (0.92 if own or killed else 0.7)
    return [Finding("rank-failed", summary, _culprits(same or [head], ranks) if ranks else [_c(head)], _cap(lines), advice,
                    conf)]


def _what(e: LogEvent) -> str:
    exc = e.fields.get("exc")
    if exc:
        s = str(exc)
        return s if len(s) <= 160 else s[:157] + "..."
    return str(e.fields.get("signal") or f"exit code {e.fields.get('exitcode')}")
