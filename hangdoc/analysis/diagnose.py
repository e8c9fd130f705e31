"""Turn a grouped report into findings: run every rule, rank by confidence, headline first.

A rule is a function ``rule(report) -> Iterable[Finding]``; a new hang class is one new rule in
``RULES``. A rule that raises is reported as a finding-free failure on stderr, never a crash.
"""

from __future__ import annotations

import importlib
import re
import sys
from typing import Any, Callable, Dict, Iterable, List, Optional

from hangdoc.model import Culprit, Finding, Report
from hangdoc.ranges import describe_ranks

Rule = Callable[[Report], Iterable[Finding]]

#: "module:function" of every rule, in no particular order (findings are sorted afterwards).
RULES: List[str] = [
    "hangdoc.analysis.stack_rules:findings",
    "hangdoc.analysis.record_rules:findings",
    "hangdoc.analysis.log_rules:findings",
    "hangdoc.analysis.fatal_rules:findings",
    "hangdoc.analysis.stream_order:findings",
    "hangdoc.analysis.went_on:findings",
]


def _load(spec: str) -> Rule:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


#: what each rule's findings are based on, for the evidence of a merged finding.
_ORIGIN = {
    "hangdoc.analysis.stack_rules:findings": "stacks",
    "hangdoc.analysis.record_rules:findings": "collective records",
    "hangdoc.analysis.log_rules:findings": "console logs",
    "hangdoc.analysis.fatal_rules:findings": "a fatal stack and the records",
    "hangdoc.analysis.stream_order:findings": "collective records",
    "hangdoc.analysis.went_on:findings": "records after the stacks",
}
#: kinds whose culprits add up across rules (each rule names processes the other did not see).
_ADDITIVE = frozenset({"missing-rank", "unresponsive-process"})


def diagnose(report: Report) -> List[Finding]:
    from hangdoc.analysis.source_waits import set_source_roots

    # the rules read call sites' source: py-spy's relative names are under the scripts' directories
    set_source_roots(p.command for p in report.job.processes if p.command)
    found: List[Finding] = []
    origins: Dict[int, str] = {}
    for spec in RULES:
        try:
            rule = _load(spec)
        except (ImportError, AttributeError):
            continue  # a rule module not present in this build
        try:
            got = list(rule(report))
        except Exception as e:  # one broken rule must not hide the others' verdicts
            print(f"hangdoc: rule {spec} failed: {type(e).__name__}: {e}", file=sys.stderr)
            continue
        for f in got:
            origins[id(f)] = _ORIGIN.get(spec, spec)
        found.extend(got)
    _raised_first(report, found, origins)
    found = _set_aside_past_stacks(found, origins)
    found = merge(found, origins)
    found = _drop_explained_p2p(report, found)
    if found:
        found[0].evidence.extend(_process_notes(report, found[0]))
    if not found:
        found = [
            Finding(
                kind="no-hang",
                summary="no hang signature: every process is busy or progressing",
                advice=["If the job is stuck anyway, take dumps again a minute later and compare."],
                confidence=0.3,
            )
        ]
    return found


def _set_aside_past_stacks(found: List[Finding], origins: Dict[int, str]) -> List[Finding]:
    """Beside a "the job went on after its stacks" finding, the stack rules' findings describe a
    moment the job went past: they become its detail, not verdicts of their own."""
    from hangdoc.analysis.went_on import ORIGIN

    went_on = next((f for f in found if origins.get(id(f)) == ORIGIN), None)
    if went_on is None:
        return found
    past = [f for f in found if origins.get(id(f)) == "stacks"]
    for f in past:
        went_on.detail.append(f"the stacks, taken during the stall, said: {f.kind}: {f.summary}")
    return [f for f in found if origins.get(id(f)) != "stacks"]


#: processes whose own notes (a printed exception, a stack that moved) a headline lists at most.
MAX_NOTES = 5


def _process_notes(report: Report, headline: Finding) -> List[str]:
    """What the readers learnt about single processes that bears on the verdict: the exception a
    rank printed (folded in from a log), a fatal signal it died of (its faulthandler dump), and a
    stack that changed between two dumps of one process (it was moving, not stuck). Culprits first."""
    culprits = {(c.host, c.pid, c.rank) for c in headline.culprits}
    noted = [p for p in report.job.processes if "exception" in p.meta or p.meta.get("moved") or p.meta.get("fatal_error")]
    noted.sort(key=lambda p: ((p.host, p.pid, p.rank) not in culprits, p.key))
    out: List[str] = []
    timeouts = {e.rank: e for e in report.job.events if e.kind == "timeout"}
    for p in noted[:MAX_NOTES]:
        if p.meta.get("fatal_error"):
            out.append(f"{p.describe()} died of a fatal signal in this stack (Fatal Python error: {p.meta['fatal_error']}): "
                       + _abort_cause(timeouts.get(p.rank) if p.rank is not None else None, bool(timeouts)))
        if "exception" in p.meta:
            at = f" ({p.meta['exception_at']})" if p.meta.get("exception_at") else ""
            out.append(f"{p.describe()} printed {p.meta['exception']}{at}")
        if p.meta.get("moved"):
            out.append(f"{p.describe()}: its stack changed between its {p.meta.get('snapshots', 2)} dumps, "
                       f"so it was moving when dumped, not stuck where one dump shows it")
    if len(noted) > MAX_NOTES:
        out.append(f"… and {len(noted) - MAX_NOTES} more processes with such notes")
    return out


def _abort_cause(own: Any, any_timeout: bool) -> str:
    """Why a process aborted in native code, as far as the console log tells: its own collective's
    timeout (NCCL's watchdog then tears the process down), another rank's, or neither known."""
    if own is not None:
        op, seq = own.fields.get("op"), own.fields.get("seq")
        what = f" ({op} #{seq})" if op and seq is not None else ""
        return (f"the teardown after its collective{what} timed out (the console log's watchdog timeout): "
                "the stack is where the rank waited, not a cause of its own")
    if any_timeout:
        return ("a native abort while other ranks' collectives timed out (the console log): most likely the "
                "process group's teardown, not a check that failed on this rank")
    return ("a native abort: a backend's check that failed (gloo's or NCCL's check of a collective that does not "
            "match its peers'), or a process group's timeout tearing the process down")


def merge(found: List[Finding], origins: Optional[Dict[int, str]] = None) -> List[Finding]:
    """Sort by confidence (stable), drop a ``no-hang`` when any other finding exists, and fold
    findings of one kind from different rules (``origins``: ``id(finding)`` → what it rests on) into one.

    The folded finding is the more confident one (records are exact, stacks are not): it keeps its
    culprits and gains the other's summary and distinct evidence as ``detail``; when the other pointed
    at different processes, that detail says so. Findings of one rule are never folded together (the record rules
    report one divergence per process group on purpose).

    >>> from hangdoc.model import Culprit
    >>> rec = Finding("collective-mismatch", "rank 2 skipped broadcast #3", [Culprit(rank=2)], ["rank 2 never issued it"], confidence=0.95)
    >>> stk = Finding("collective-mismatch", "rank 0 waits in broadcast", [Culprit(rank=1), Culprit(rank=2)], ["rank 0: broadcast"], confidence=0.5)
    >>> [m] = merge([stk, rec], {id(rec): "collective records", id(stk): "stacks"})
    >>> m.summary, [c.rank for c in m.culprits]
    ('rank 2 skipped broadcast #3', [2])
    >>> m.evidence, m.detail
    (['rank 2 never issued it'], ['the stacks alone said: rank 0 waits in broadcast (pointing at ranks 1-2, not only at rank 2)', 'rank 0: broadcast'])
    """
    real = [f for f in found if f.kind != "no-hang"]
    if origins:
        _corroborate(real, origins)
    keep = sorted(real if real else found, key=lambda f: -f.confidence)
    if not origins:
        return keep
    out: List[Finding] = []
    best: Dict[str, Finding] = {}
    for f in keep:
        head = best.get(f.kind)
        if head is None or origins.get(id(head)) == origins.get(id(f)):
            if head is None:
                best[f.kind] = f
            out.append(f)
            continue
        _fold(head, f, origins.get(id(f), "another rule"))
    return out


def _ranks(f: Finding) -> frozenset:
    return frozenset(c.rank for c in f.culprits if c.rank is not None)


def _corroborate(found: List[Finding], origins: Dict[int, str]) -> None:
    """A rank the records show merely *behind* (a ``collective-wait`` naming it), or that a log
    shows never issued the collective the others wait in, is explained by a stack finding that
    names the same ranks (a DataLoader stall, a stopped process): that finding says why, so it
    becomes the headline, with the records' or the log's agreement as evidence."""
    from hangdoc.analysis.record_rules import is_lag

    lags = [f for f in found if is_lag(f) and origins.get(id(f)) == "collective records" and _ranks(f)]
    # a log that says which rank never issued the collective (its watchdog's last enqueued work)
    # says *who*; a DataLoader stall or a stopped process in that rank's stack says *why*
    lags += [f for f in found if f.kind in ("collective-mismatch", "missing-rank") and
             origins.get(id(f)) == "console logs" and _ranks(f)]
    for lag in lags:
        for f in found:
            if f is lag or f.kind in ("collective-wait", "no-hang", "collective-mismatch") or origins.get(id(f)) != "stacks":
                continue
            ranks = _ranks(f)
            if ranks and ranks <= _ranks(lag):
                f.confidence = max(f.confidence, lag.confidence + 0.05)
                f.evidence.append(f"the {origins.get(id(lag))} agree: {lag.summary}")


#: what an exception raised by the communication layer says (a backend that rejects a mismatched
#: call, a peer that went away, a timeout): such an exception is a consequence, not a rank's own error
_COMM_ERROR = re.compile(r"gloo|nccl|ProcessGroup|c10d|Dist(?:Backend|Network|Store)Error|Connection (?:closed|reset)"
                         r"|[Tt]imed? ?out|EnforceNotMet|collective|mismatch", re.I)


def _raised_first(report: Report, found: List[Finding], origins: Dict[int, str]) -> None:
    """A rank that raised an exception of its own (not one of the communication layer: a backend
    that rejects a mismatched call, a peer gone) and was blocked in no collective on the host issued nothing after it:
    the mismatch the records or a log report for that rank alone ("rank 3 skipped all_reduce #4")
    is the consequence, and the exception the headline (``examples/bugs/exception_in_collective_loop.py``)."""
    failed = [f for f in found if f.kind == "rank-failed" and _ranks(f)]
    if not failed:
        return
    # blocked in a collective on the host (a call queued on a CUDA stream blocks no host)
    pending = {r.rank for r in report.job.records if r.state == "issued" and not r.stream}
    texts: Dict[int, List[str]] = {}
    for p in report.job.processes:
        if p.rank is not None and p.meta.get("exception"):
            texts.setdefault(p.rank, []).append(str(p.meta["exception"]))
    for e in report.job.events:
        if e.kind == "exception" and e.rank is not None and e.fields.get("exc"):
            texts.setdefault(e.rank, []).append(str(e.fields["exc"]))
    raised = {r for r, t in texts.items() if not any(_COMM_ERROR.search(x[:2000]) for x in t)}
    for f in failed:
        ranks = _ranks(f)
        if not ranks <= raised or ranks & pending:
            continue
        failed_at = max((r.time_issued for r in report.job.records if r.rank in ranks
                         and isinstance(r.time_issued, (int, float))), default=None)
        for m in found:
            if m.kind != "collective-mismatch" or m.confidence < f.confidence or not _ranks(m):
                continue
            if _ranks(m) <= ranks:
                f.confidence = min(0.99, m.confidence + 0.01)
                f.evidence.append(f"the {origins.get(id(m), 'records')} agree, as its consequence: {m.summary}")
            elif not _ranks(m) & ranks and failed_at is not None and _after(report, _ranks(m), failed_at):
                # other ranks diverged only after this rank's last call: they went on without it
                f.confidence = min(0.99, m.confidence + 0.01)
                f.evidence.append(f"after it failed, the {origins.get(id(m), 'records')} show the others "
                                  f"going on without it: {m.summary}")


def _after(report: Report, ranks: frozenset, when: float) -> bool:
    """Whether every rank of ``ranks`` issued its first call not seen completed (pending or failed) after ``when``."""
    firsts: Dict[int, float] = {}
    for r in report.job.records:
        if r.rank in ranks and r.state != "completed" and isinstance(r.time_issued, (int, float)):
            firsts[r.rank] = min(firsts.get(r.rank, r.time_issued), r.time_issued)
    return set(firsts) == set(ranks) and all(t > when for t in firsts.values())


def _drop_explained_p2p(report: Report, found: List[Finding]) -> List[Finding]:
    """A ``p2p-cycle`` (from records or from peers in the stacks) explains every send/recv wait of
    its ranks: a ``p2p-stall`` about the same ranks ("wait with unknown peers", "waits on rank 2")
    would contradict it, so it is folded into the cycle's detail. A stall that names a rank outside
    every cycle, or while some rank outside the cycles also waits in send/recv, stays."""
    cycles = [f for f in found if f.kind == "p2p-cycle"]
    if not cycles or not any(f.kind == "p2p-stall" for f in found):
        return found
    from hangdoc.analysis.signatures import wait_of

    in_cycle = frozenset().union(*(_ranks(f) for f in cycles))
    waiting = {p.rank for p in report.job.processes if p.role != "dataloader-worker" and wait_of(p).category == "p2p"}
    if None in waiting or not waiting <= in_cycle:
        return found  # a send/recv wait the cycles do not cover: the stall may be about it
    out: List[Finding] = []
    for f in found:
        if f.kind == "p2p-stall" and _ranks(f) <= in_cycle and len(_ranks(f)) == len(f.culprits):
            head = next((c for c in cycles if _ranks(f) <= _ranks(c)), cycles[0])
            head.detail.append(f"the stacks alone said: {f.summary} (the cycle explains these waits)")
            continue
        out.append(f)
    return out


def _who(culprits: List[Culprit]) -> str:
    ranks = [c.rank for c in culprits if c.rank is not None]
    rest = [c for c in culprits if c.rank is None]
    parts = [describe_ranks(ranks)] if ranks else []
    parts += [f"pid {c.pid}" + (f" on {c.host}" if c.host else "") for c in rest[:3]]
    if len(rest) > 3:
        parts.append(f"… and {len(rest) - 3} more")
    return ", ".join(parts) or "nobody"


def _fold(head: Finding, other: Finding, origin: str) -> None:
    """Fold ``other`` (same kind, another rule, less confident) into ``head``."""
    def key(c: Culprit):
        return ("rank", c.rank) if c.rank is not None else ("process", c.host, c.pid)

    mine = {key(c) for c in head.culprits}
    theirs = {key(c) for c in other.culprits}
    note = f"the {origin} alone said: {other.summary}"
    if head.kind in _ADDITIVE:
        head.culprits.extend(c for c in other.culprits if key(c) not in mine)
    elif not theirs and other.candidates:
        note += f" (one of {_who(other.candidates)}, without saying which)"
    elif theirs and theirs != mine:
        note += f" (pointing at {_who(other.culprits)}, not only at {_who(head.culprits)})" if mine <= theirs else \
            f" (pointing at {_who(other.culprits)} instead)"
    # the more exact rule already proves the verdict: the other's view is supporting detail
    have = set(head.evidence) | set(head.detail)
    head.detail.append(note)
    head.detail.extend(e for e in other.evidence + other.detail if e not in have)
