"""The failure text of a multi-rank test: one headline, then one section per problem.

The headline names what went wrong in the order a reader should look at it: a rank's exception
first (with its rank; the earliest first, since the other ranks often fail *because* of it), then
ranks that crashed, then the collective-order divergence, then the hang. The collective diff comes
after the ranks' tracebacks, and only when it says something the exceptions do not: a rank that
raised stops issuing calls, so the others having issued more is no divergence of its own.

Sections follow pytest's ``--tb``: the ranks' tracebacks come already shaped by that style (the
rank processes format them with the parent's options); with ``--tb=line`` each problem is one
line, ``path:lineno: message`` as pytest writes it; with ``--tb=no`` only the headline is kept
(pytest shows it in the ``-r`` summary).

    >>> v = compose(4, "fake", [RankFailure(2, "failed", "ValueError: bad shard", "Traceback ...",
    ...                                     crash=("/t/test_x.py", 9))], {}, "line")
    >>> v.title
    'rank 2 failed: ValueError: bad shard'
    >>> print(v.text)
    rank 2: /t/test_x.py:9: ValueError: bad shard
    >>> v.location
    ('/t/test_x.py', 9)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from hangdoc.ranges import describe_ranks

#: the longest exception line the headline repeats.
SUMMARY_WIDTH = 200


@dataclass
class RankFailure:
    """One rank that raised (``kind="failed"``) or died (``kind="crashed"``)."""

    rank: int
    kind: str
    #: one line: ``"ValueError: boom"``, ``"killed by SIGABRT"``.
    summary: str
    #: the section body: the rank's traceback, shaped by ``--tb``, or how it died.
    text: str
    #: ``(path, lineno)`` where it raised, for pytest's crash line.
    crash: Optional[Tuple[str, int]] = None
    #: when it failed (any clock common to the ranks): the earliest is named first.
    at: float = 0.0
    #: the test phase that failed: ``setup``, ``call`` or ``teardown``.
    when: str = "call"


@dataclass
class HangReport:
    """The hang part of a failure: built by the caller, which knows how the ranks ran."""

    head: str
    #: the stacks / the aggregator's verdict.
    text: str = ""
    #: ``--tb=line``: one line per hung rank.
    lines: List[str] = field(default_factory=list)
    #: ranks whose records stop early because they were stuck in their own code, not waiting for a
    #: peer (the fake backend never blocks): like ranks that raised, their shorter sequences are
    #: no divergence.
    stopped: Sequence[int] = ()
    location: Optional[Tuple[str, int]] = None


@dataclass
class Verdict:
    title: str
    text: str
    #: ``(path, lineno)`` for pytest's crash line; None: the test function's.
    location: Optional[Tuple[str, int]] = None


def compose(world_size: int, backend: str, failures: Sequence[RankFailure], records: Mapping[int, Sequence[Any]],
            tbstyle: str = "long", hang: Optional[HangReport] = None) -> Optional[Verdict]:
    """The verdict on one multi-rank run, or None when nothing went wrong.

    ``records`` maps each rank that ran to its collective records (a rank that crashed has none).
    """
    failed = _by_time([f for f in failures if f.kind == "failed"])
    crashed = sorted((f for f in failures if f.kind == "crashed"), key=lambda f: f.rank)
    stopped = {f.rank for f in failed} | set(hang.stopped if hang else ())
    order = collective_order(records, world_size, backend, stopped)

    # An exception that a collective call itself raised (gloo's "connection closed by peer") is
    # the divergence's doing when there is one: then the divergence is the news, not the exception.
    order_first = order.relevant and bool(failed) and all(_raised_in_collective(records.get(f.rank)) for f in failed)
    heads: List[str] = [order.title] if order_first else []
    heads += _failed_heads(failed)
    for summary, ranks in _groups((f.summary, f.rank) for f in crashed):
        heads.append(f"{describe_ranks(ranks)} crashed ({summary})")
    if order.relevant and not order_first:
        heads.append(order.title)
    if hang is not None:
        heads.append(hang.head)
    if not heads:
        return None
    title = "; ".join(heads)

    location = next((f.crash for f in failed if f.crash), None)
    if location is None and order.relevant:
        location = order.location
    if location is None and hang is not None:
        location = hang.location

    if tbstyle == "no":
        return Verdict(title, title, location)
    if tbstyle == "line":
        lines = [title]
        for f in failed + crashed:
            where = f"{f.crash[0]}:{f.crash[1]}: " if f.crash else ""
            lines.append(f"rank {f.rank}: {where}{_first_line(f.summary)}")
        if order.relevant:
            lines += order.lines
        if hang is not None:
            lines += hang.lines
        # pytest itself ends with the crash line, ``path:lineno: <headline>``
        return Verdict(title, "\n".join(lines[1:]) or title, location)

    if order.relevant and not failed and not crashed and hang is None:
        return Verdict(title, order.text, location)  # its first line is the headline already
    # the sections in the headline's order; the note that the collectives agree last
    sections = [order.text] if order_first else []
    sections += [f"---- rank {f.rank} ----\n{f.text.rstrip()}" for f in failed + crashed]
    if order.relevant and not order_first:
        sections.append(order.text)
    if hang is not None and hang.text:
        sections.append(hang.text)
    if not order.relevant and order.note:
        sections.append(order.note)
    return Verdict(title, title + "\n\n" + "\n\n".join(s.rstrip() for s in sections if s.strip()), location)


def _raised_in_collective(records: Optional[Sequence[Any]]) -> bool:
    return bool(records) and getattr(records[-1], "state", "") == "failed"


def _by_time(failures: Sequence[RankFailure]) -> List[RankFailure]:
    return sorted(failures, key=lambda f: (f.at, f.rank))


def _groups(pairs) -> List[Tuple[str, List[int]]]:
    """``(key, ranks)`` in order of first appearance."""
    out: Dict[str, List[int]] = {}
    for key, rank in pairs:
        out.setdefault(key, []).append(rank)
    return list(out.items())


def _first_line(text: str) -> str:
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line if len(line) <= SUMMARY_WIDTH else line[:SUMMARY_WIDTH - 3] + "..."


def _exception_type(summary: str) -> str:
    m = re.match(r"([\w.]+(?:Error|Exception|Exit|Interrupt|Failed|Warning)|Failed)\b", summary)
    return m.group(1) if m else _first_line(summary)[:60]


def _failed_heads(failed: Sequence[RankFailure]) -> List[str]:
    """The earliest exception in full, later ones by type: they are most often its consequence."""
    groups = _groups(((f.when, _first_line(f.summary)), f.rank) for f in failed)
    heads = []
    for i, ((when, summary), ranks) in enumerate(groups[:3]):
        phase = f" in {when}" if when != "call" else ""
        if i == 0:
            heads.append(f"{describe_ranks(ranks)} failed{phase}: {summary}")
        else:
            heads.append(f"then {describe_ranks(ranks)} failed{phase} ({_exception_type(summary)})")
    rest = sorted(r for _, ranks in groups[3:] for r in ranks)
    if rest:
        heads.append(f"then {describe_ranks(rest)} failed too")
    return heads


# -- the collective diff ---------------------------------------------------------------------------


@dataclass
class OrderCheck:
    """What the ranks' records say: a divergence worth a headline, or a note that they agree."""

    relevant: bool = False
    title: str = ""
    text: str = ""
    lines: List[str] = field(default_factory=list)
    location: Optional[Tuple[str, int]] = None
    note: str = ""


def collective_order(records: Mapping[int, Sequence[Any]], world_size: int, backend: str,
                     stopped: Set[int] = frozenset()) -> OrderCheck:
    """Compare the ranks' collectives; a disagreement that only says ranks in ``stopped`` issued
    fewer calls (a prefix of the others') is not relevant, and becomes a one-line note."""
    if not any(records.values()):
        return OrderCheck()
    from hangdoc.testing.order import CollectiveTrace, verdict_message

    trace = CollectiveTrace(records, world_size)
    found, problems = trace.problems()
    if not (found or problems):
        return OrderCheck()
    short = _stopped_early(trace, found, problems, stopped)
    if short is not None:
        who = describe_ranks(short)
        note = (f"collectives: the other ranks agree with {who} up to where {'it' if len(short) == 1 else 'they'} "
                f"stopped; what they issued after that is left out") if short else ""
        return OrderCheck(note=note)
    title = "collective order diverged" if found else "point-to-point schedule deadlocks or mismatches"
    text = verdict_message(trace, found, backend, problems)
    lines: List[str] = []
    seen: Set[str] = set()
    for d in found:
        if d.group not in seen:
            seen.add(d.group)
            lines.append(f"collective order diverged in process group {d.group}: {d.summary}")
    for p in problems:
        lines.append(f"point-to-point schedule: {_first_line(p.summary)}")
    location = None
    for d in found:
        for rec in (d.actual, d.expected):
            location = location or _site_location(rec)
    return OrderCheck(True, title, text, lines, location)


def _site_location(rec: Any) -> Optional[Tuple[str, int]]:
    parts = (getattr(rec, "call_site", "") or "").rsplit(":", 2)
    if len(parts) == 3 and parts[1].isdigit():
        return parts[0], int(parts[1])
    return None


def _stopped_early(trace: Any, found: Sequence[Any], problems: Sequence[Any], stopped: Set[int]) -> Optional[List[int]]:
    """The ranks of ``stopped`` that issued fewer calls than the others, when that is the whole of
    the disagreement (their sequences are prefixes of the others'); None when it is not."""
    if not stopped:
        return None
    from hangdoc.testing.diff import by_rank, member_records
    from hangdoc.testing.order import _renumber

    short: Set[int] = set()
    if found:
        seqs = by_rank(_renumber(member_records(trace.records())))
        groups: Dict[str, Any] = {}
        for per_group in seqs.values():
            for g, recs in per_group.items():
                groups.setdefault(g, recs[0])
        for g, sample in groups.items():
            members = [r for r in trace.by_rank if not sample.group_ranks or r in sample.group_ranks]
            keys = {r: [(c.signature(), c.peer) for c in seqs.get(r, {}).get(g, [])] for r in members}
            longest = max(keys.values(), key=len)
            for r, k in keys.items():
                if k != longest[:len(k)]:
                    return None
                if len(k) < len(longest):
                    if r not in stopped:
                        return None
                    short.add(r)
        problems = trace.schedule_problems()  # the replay runs only when collectives agree
    for p in problems:
        if p.kind == "unmatched" and set(p.ranks) & stopped:
            short |= set(p.ranks) & stopped
            continue
        if p.kind == "deadlock" and not p.cycle and p.waits:
            ends = _waits_end_in(p.waits, stopped)
            if ends:
                short |= ends
                continue
        return None
    return sorted(short)


def _waits_end_in(waits: Mapping[int, Sequence[int]], stopped: Set[int]) -> Optional[Set[int]]:
    """The stopped ranks that every stuck rank's waits lead to, or None when some lead elsewhere."""
    ends: Set[int] = set()

    def follow(rank: int, path: Tuple[int, ...]) -> bool:
        if rank in stopped:
            ends.add(rank)
            return True
        if rank is None or rank in path or rank not in waits or not waits[rank]:
            return False
        return all(follow(w, path + (rank,)) for w in waits[rank])

    # a stuck rank may be in ``stopped`` itself (it raised in that very call): what counts is whom it waits for
    return ends if all(follow(w, (r,)) for r in waits for w in waits[r] or [None]) else None
