"""Log events joined with the rest of the job: one event once, one rank one process.

A console log is often given twice (torchrun ``--tee`` writes the same lines into the console and
into ``--log-dir``), and one timeout is printed several times by one rank (the watchdog's line,
the exception's message, the traceback that carries it): :func:`join_events` keeps each event
once. It then fills identity the lines did not carry (a pid that a stack dump of the same rank
knows, a rank that a pid names) and makes every rank that only a log speaks of a process of the
job (status ``log-only``, no stack), so that reports and JSON count it.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from hangdoc.model import ROLE_RANK, ROLE_WORKER, STATUS_LOG, Job, LogEvent, Process

__all__ = ["join_events", "event_key"]


def event_key(e: LogEvent) -> Tuple[object, ...]:
    """What makes two events the same event (where and how it was printed does not)."""
    f = e.fields
    if e.kind == "timeout":
        what: Tuple[object, ...] = (f.get("group"), f.get("seq"), f.get("op"))
    elif e.kind == "watchdog-state":
        what = (f.get("group"), f.get("failed"), f.get("last_enqueued"), f.get("last_completed"))
    elif e.kind == "exception":
        what = (f.get("exc"),)
    elif e.kind == "exit":
        what = (f.get("exitcode"), f.get("signal"))
    else:
        what = tuple(sorted((k, str(v)) for k, v in f.items()))
    return (e.kind, e.host, e.rank if e.rank is not None else e.pid) + what


def join_events(job: Job) -> None:
    if not job.events:
        return
    hosts = {e.host for e in job.events if e.host is not None} | {p.host for p in job.processes if p.host is not None}
    if len(hosts) <= 1:
        # torchrun's agent names local ranks ("failed (exitcode: -9) local_rank: 4"); on one host
        # they are the ranks (the same rule the readers apply to "[default4]:" prefixes)
        for e in job.events:
            if e.rank is None and isinstance(e.fields.get("local_rank"), int):
                e.rank = e.fields["local_rank"]
                e.fields["rank_from"] = "local rank (one host)"
    _dedupe(job)
    ranked: Dict[Tuple[Optional[str], int], Process] = {}
    by_pid: Dict[Tuple[Optional[str], int], Process] = {}
    one_host = len({p.host for p in job.processes if p.host is not None}) <= 1
    for p in job.processes:
        if p.role == ROLE_WORKER:
            continue
        if p.rank is not None:
            ranked.setdefault((p.host, p.rank), p)
            ranked.setdefault((None, p.rank), p)
        if p.pid is not None:
            by_pid.setdefault((p.host, p.pid), p)
            by_pid.setdefault((None, p.pid), p)
    for e in job.events:
        if e.rank is None and e.pid is not None:
            p = by_pid.get((e.host, e.pid)) or (by_pid.get((None, e.pid)) if one_host or e.host is None else None)
            if p is not None and p.rank is not None:
                e.rank = p.rank
                e.host = e.host or p.host
        if e.rank is not None:
            p = ranked.get((e.host, e.rank)) or ranked.get((None, e.rank))
            if p is not None:
                if e.pid is None:
                    e.pid = p.pid
                if e.host is None:
                    e.host = p.host
                if p.pid is None and e.pid is not None:
                    p.pid = e.pid
    # ranks that only the logs know of: the writers of lines, and the ranks lines name (the other
    # side of a DETAIL mismatch, the ranks missing from a barrier or a collective)
    known = {p.rank for p in job.processes if p.rank is not None and p.role != ROLE_WORKER}
    first: Dict[int, LogEvent] = {}
    for e in job.events:
        for r in [e.rank] + _named_ranks(e):
            if r is not None and r not in known and r not in first:
                first[r] = e
    by_writer: Dict[int, List[LogEvent]] = {}
    for x in job.events:
        if x.rank is not None:
            by_writer.setdefault(x.rank, []).append(x)
    for rank, e in sorted(first.items()):
        hosts = {x.host for x in by_writer.get(rank, ()) if x.host is not None}
        pids = {x.pid for x in by_writer.get(rank, ()) if x.pid is not None}
        job.processes.append(Process(
            host=next(iter(hosts)) if len(hosts) == 1 else None,
            pid=next(iter(pids)) if len(pids) == 1 else None,
            rank=rank, role=ROLE_RANK, status=STATUS_LOG, status_detail="seen only in a log",
            source=e.source, source_line=e.line, format="log",
            meta={"rank_from": "log"},
        ))


#: ranks one event may add as processes (a barrier of 100,000 absent ranks is not 100,000 processes)
MAX_NAMED = 4096


def _named_ranks(e: LogEvent) -> List[int]:
    f = e.fields
    out: List[int] = []
    for key in ("ranks", "missing", "expected", "deviants", "agreeing"):
        v = f.get(key)
        if isinstance(v, list):
            out.extend(r for r in v[:MAX_NAMED] if type(r) is int and r >= 0)
    for side in f.get("sides") or []:
        if isinstance(side, dict) and type(side.get("rank")) is int:
            out.append(side["rank"])
    return out[:MAX_NAMED]


def _dedupe(job: Job) -> None:
    seen: Dict[Tuple[object, ...], LogEvent] = {}
    out: List[LogEvent] = []
    for e in job.events:
        k = event_key(e)
        kept = seen.get(k)
        if kept is None:
            seen[k] = e
            out.append(e)
        else:
            if kept.time is None and e.time is not None:
                kept.time = e.time
            for k, v in e.fields.items():  # the traceback's copy knows where it was raised
                if k != "inferred":
                    kept.fields.setdefault(k, v)
    job.events[:] = out
