"""The words of stack findings: who a set of processes is, the verb that agrees, culprits named
once, long lists capped; and the advice the stack rules share (:mod:`hangdoc.analysis.stack_rules`,
:mod:`hangdoc.analysis.p2p_stacks`)."""

from __future__ import annotations

from typing import Iterable, List, Sequence

from hangdoc.model import ROLE_WORKER, Culprit, Process
from hangdoc.ranges import compress_hosts
# finding text: long rank lists end in "… and N more" (the culprits keep every rank)
from hangdoc.ranges import describe_ranks_capped as describe_ranks

_RECORDS_ADVICE = (
    "Run again with the collective recorder (`hangdoc run --record ...`, or `--hang-timeout S` for the "
    "watchdog) and aggregate the `collectives-*.jsonl` files with the dumps: the records name the exact "
    "call and rank that diverged."
)
_LOCALS_ADVICE = "Dump with `py-spy dump --locals` (or `hangdoc dump`, which passes it) so the stacks show src/dst of each send/recv."

#: evidence lines of one kind a finding lists before "… and N more".
MAX_LINES = 12


def _cap(lines: List[str], what: str, limit: int = MAX_LINES) -> List[str]:
    """``lines`` cut to ``limit`` with a last line counting the rest (findings stay readable at any scale).

    >>> _cap([f"rank {i}: stopped" for i in range(5)], "stopped processes", 3)
    ['rank 0: stopped', 'rank 1: stopped', '… and 3 more stopped processes']
    """
    if len(lines) <= limit:
        return lines
    return lines[:limit - 1] + [f"… and {len(lines) - limit + 1} more {what}"]


def _sorted(procs: Iterable[Process]) -> List[Process]:
    return sorted(procs, key=lambda p: p.key)


def who(procs: Sequence[Process]) -> str:
    """``ranks 0-2,5`` or ``process (node1 pid 42)`` or ``12 processes on node[1-2]``.

        >>> who([Process(pid=12611), Process(), Process(), Process()])
        '4 processes (pid 12611; 3 with no pid)'
    """
    ranks = [p.rank for p in procs if p.rank is not None]
    rest = _sorted(p for p in procs if p.rank is None)
    parts = []
    if ranks:
        parts.append(describe_ranks(ranks))
    if rest:
        if len(rest) == 1:
            parts.append(_one(rest[0]))
        else:
            hosts = compress_hosts(p.host for p in rest if p.host)
            if hosts.count(",") >= MAX_LINES:  # hundreds of hosts with no common prefix
                hosts = f"{len(set(p.host for p in rest if p.host))} hosts"
            pids = [str(p.pid) for p in rest if p.pid is not None]
            unknown = len(rest) - len(pids)
            shown = (f"pid{'s' if len(pids) > 1 else ''} {', '.join(pids)}" if 0 < len(pids) <= 4 else "")
            if shown and unknown:
                shown += f"; {unknown} with no pid"
            parts.append(f"{len(rest)} processes" + (f" on {hosts}" if hosts else "") + (f" ({shown})" if shown else ""))
    return ", ".join(parts) if parts else "no process"


def _s(procs: Sequence[Process], one: str, many: str) -> str:
    """The verb that agrees with :func:`who` of ``procs``."""
    return one if len(procs) == 1 else many


def _one(p: Process) -> str:
    """``pid 42 on node1`` for a process without a rank (``rank 3`` is handled by :func:`who`)."""
    what = "DataLoader worker " if p.role == ROLE_WORKER else ""
    pid = f"pid {p.pid}" if p.pid is not None else "a process"
    return f"{what}{pid}" + (f" on {p.host}" if p.host else "")


def _culprits(procs: Iterable[Process]) -> List[Culprit]:
    """Culprits of ``procs``, once each; a process with no host, pid or rank cannot be named."""
    seen: List[Culprit] = []
    have = set()
    for p in _sorted(procs):
        c = p.culprit()
        if c.host is None and c.pid is None and c.rank is None:
            continue
        if c not in have:
            have.add(c)
            seen.append(c)
    return seen


def _procs(buckets: Iterable) -> List[Process]:
    """The processes of buckets (:class:`hangdoc.analysis.stack_rules._Bucket`), in order."""
    return [p for b in buckets for p in b.procs]
