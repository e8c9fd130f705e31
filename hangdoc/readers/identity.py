"""Who a process is: host, pid, rank, role, put together from every piece of evidence there is.

The ``# hangdoc process`` tag line before a dump (:mod:`hangdoc.tags`), a line prefix (the
stream's channel), the file name (``trace-node7.out`` → host ``node7``; ``stacks-node7-r3-42.txt``;
``stderr-rank3.log``), a ``rank`` argument or local in a py-spy ``--locals`` dump, torchrun's
failure table (pids of failed ranks), and the order of a file (a DataLoader worker printed after
its rank). The rank map, which wins over all of these, is applied across files in
:mod:`hangdoc.readers.merge`.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from hangdoc.bounds import MAX_IDENT, MAX_PID, MAX_RANK, MAX_RANKS, bounded_int
from hangdoc.model import (
    Frame,
    ROLE_LAUNCHER,
    ROLE_RANK,
    ROLE_UNKNOWN,
    ROLE_WORKER,
    STATUS_EXITED,
    STATUS_OK,
    STATUS_TRUNCATED,
    LogEvent,
    Process,
)
from hangdoc.readers._base import FileContext, Interner

__all__ = ["exited_process", "apply_exit_events", "apply_tags", "from_file_name", "finish_identity",
           "tie_workers_by_order"]


def exited_process(ctx: FileContext, lineno: int, fields: Dict[str, str]) -> Process:
    """A process ``hangdoc dump`` found gone before it could dump it: identity, no stack."""
    p = Process(source=ctx.path, source_line=lineno, format="hangdoc-exited")
    reason = fields.pop("reason", "exited")
    _apply_tag(p, fields)
    p.status = STATUS_EXITED
    p.status_detail = reason.replace("_", " ")
    if p.role == ROLE_UNKNOWN:
        p.role = ROLE_RANK
    return p


def apply_exit_events(emitted: List[Tuple[Any, Process]], events: List[LogEvent]) -> None:
    """torchrun's failure table is the only place a console names a failed rank's pid (and host):
    give them to the processes of the same file that have that rank."""
    exits = [e for e in events if e.kind == "exit" and e.rank is not None and e.pid is not None]
    if not exits:
        return
    by_rank = {e.rank: e for e in exits}
    hosts = {e.host for e in exits}
    if len(hosts) == 1:
        # one torchrun, one host: its own traceback (the launcher's) ran there too
        for ch, p in emitted:
            if p.role == ROLE_LAUNCHER or (p.host is None and ch.host is None and p.rank is None):
                p.host = p.host or next(iter(hosts))
    for ch, p in emitted:
        rank = p.rank if p.rank is not None else ch.rank
        e = by_rank.get(rank)
        if e is None or p.pid is not None:
            continue
        p.pid = e.pid
        if p.host is None and ch.host is None:
            p.host = e.host
        if p.local_rank is None and e.fields.get("local_rank") is not None:
            p.local_rank = e.fields["local_rank"]


def apply_tags(emitted: List[Tuple[Any, Process]], tags: List[Tuple[Any, int, Dict[str, str]]]) -> None:
    """A tag line belongs to the first process of its channel that starts after it."""
    if not tags:
        return
    # both lists are in line order: one pass per channel (a file may hold 100,000 tagged dumps)
    by_channel: Dict[int, List[Process]] = {}
    for ch, p in emitted:
        by_channel.setdefault(id(ch), []).append(p)
    cursor: Dict[int, int] = {}
    for ch, tag_line, fields in tags:
        procs = by_channel.get(id(ch), [])
        i = cursor.get(id(ch), 0)
        while i < len(procs) and (procs[i].source_line <= tag_line or procs[i].meta.get("tagged")):
            i += 1
        cursor[id(ch)] = i
        if i < len(procs):
            _apply_tag(procs[i], fields)


#: the bounds of a tag line's numbers: one out of them is left out (never a huge world to enumerate)
_TAG_BOUNDS = {"pid": (0, MAX_PID), "ppid": (0, MAX_PID), "rank": (0, MAX_RANK), "local_rank": (0, MAX_RANK),
               "parent_rank": (0, MAX_RANK), "world_size": (1, MAX_RANKS)}


def _int(v: Optional[str], name: str = "rank") -> Optional[int]:
    lo, hi = _TAG_BOUNDS[name]
    return bounded_int(v, lo, hi)


_STATUSES = {STATUS_OK, STATUS_TRUNCATED, "unresponsive", "stopped"}  # what a tag line may set
_TAG_FIELDS = ("host", "pid", "rank", "local_rank", "ppid", "parent_rank", "world_size", "role", "status", "reason",
               "main_thread")


def _apply_tag(p: Process, fields: Dict[str, str]) -> None:
    p.meta["tagged"] = True
    p.host = fields.get("host") or p.host
    for name in ("pid", "rank", "local_rank", "ppid", "parent_rank"):
        v = _int(fields.get(name), name)
        if v is not None:
            setattr(p, name, v)
    if "rank" in fields and _int(fields["rank"]) is not None:
        p.meta["rank_from"] = "tag"
    ws = _int(fields.get("world_size"), "world_size")
    if ws is not None:
        p.meta["world_size"] = ws
    if fields.get("role"):
        p.role = fields["role"]
    status = fields.get("status")
    if status in _STATUSES and status != STATUS_OK:
        # "hangdoc dump" says what it saw (a stopped process, one no dumper could read)
        p.status = status
        if fields.get("reason"):
            p.status_detail = fields["reason"].replace("_", " ")
    elif fields.get("reason"):
        p.meta["reason"] = fields["reason"]
    main = fields.get("main_thread")
    if main and p.threads:
        # the watchdog names the main thread: faulthandler output does not say which it is
        want = bounded_int(main, 0, MAX_IDENT, base=16)
        hit = [t for t in p.threads if want is not None and t.ident.startswith("0x")
               and bounded_int(t.ident, 0, MAX_IDENT, base=16) == want]
        if hit:
            for t in p.threads:
                t.is_main = t is hit[0]
    for k, v in fields.items():
        if k not in _TAG_FIELDS:
            p.meta[k] = v


#: hangdoc.analysis.normalize.role_of, imported on first use (readers load without the analysis) and
#: kept: not an import statement run again for each of 131,072 processes
_ROLE_OF: list = []


def _role_of():
    from hangdoc.analysis.normalize import role_of

    _ROLE_OF[:] = [role_of]
    return role_of


def from_file_name(ctx: FileContext, procs: List[Process]) -> None:
    for p in procs:
        if p.host is None and ctx.host_from_name is not None:
            p.host = ctx.host_from_name
    if ctx.rank_from_name is None and ctx.pid_from_name is None:
        return
    # The name speaks for one process (a rank's own stderr, hangdoc's stacks-host-rR-pid.txt);
    # its forked DataLoader workers may have written into the same file.
    from hangdoc.analysis.normalize import role_of

    owners = [p for p in procs if role_of(p) != ROLE_WORKER]
    if len(owners) == 1:
        o = owners[0]
        if o.rank is None and ctx.rank_from_name is not None:
            o.rank = ctx.rank_from_name
            o.meta.setdefault("rank_from", "file name")
        if o.pid is None and ctx.pid_from_name is not None:
            o.pid = ctx.pid_from_name


def finish_identity(p: Process, interner: Interner) -> None:
    role_of = _ROLE_OF[0] if _ROLE_OF else _role_of()
    if p.host is not None:
        p.host = interner.string(p.host)
    main = p.main_thread
    # What a stack says (its rank local, its role) is the same for every process that shares it:
    # asked once per distinct (stack, command), not once per process.
    facts = None
    if main is not None and main.frames:
        key = (id(main.frames), p.command)
        facts = interner.facts.get(key)
        if facts is None:
            facts = interner.facts[key] = (_rank_from_locals(main.frames), role_of(p), main.frames)
    if p.rank is None:
        r = facts[0] if facts is not None else None
        if r is not None:
            p.rank = r
            p.meta["rank_from"] = "locals"
    if not p.meta.get("tagged") or p.role in ("", "unknown"):
        p.role = facts[1] if facts is not None else role_of(p)
    if p.role == ROLE_WORKER and p.rank is not None and p.meta.get("rank_from") in ("prefix", "file name", "locals"):
        # a worker writes under its rank's prefix / into its rank's file: that rank owns it
        p.parent_rank = p.rank
        p.rank = None


_RANK_LOCALS = ("rank", "global_rank")


def _rank_from_locals(frames: Tuple[Frame, ...]) -> Optional[int]:
    """``rank: 3`` among the arguments/locals of user frames (py-spy --locals), outermost first."""
    for f in frames:
        if not f.locals or f.file.startswith("torch/"):
            continue
        for name in _RANK_LOCALS:
            v = f.local(name)
            r = bounded_int(v, 0, MAX_RANK) if v is not None else None
            if r is not None:
                return r
    return None


def tie_workers_by_order(procs: List[Process]) -> None:
    """Tie DataLoader workers to the rank process printed before them in the same file.

    Only when the file's order says so: it holds one rank process, or ranks and workers alternate
    (``py-spy dump --subprocesses``, a tree walk). ``pgrep | xargs py-spy dump`` prints all ranks
    first and their workers after, which says nothing about who forked whom.
    """
    ranks = [p for p in procs if p.role == ROLE_RANK]
    workers = [p for p in procs if p.role == ROLE_WORKER and p.ppid is None and p.parent_rank is None]
    if not workers or not ranks:
        return
    order = {id(p): i for i, p in enumerate(procs)}
    first_worker = min(order[id(w)] for w in workers)
    interleaved = any(order[id(r)] > first_worker for r in ranks)
    if len(ranks) > 1 and not interleaved:
        return
    current: Optional[Process] = None
    for p in procs:
        if p.role == ROLE_RANK:
            current = p
        elif p.role == ROLE_WORKER and current is not None and p.ppid is None and p.parent_rank is None:
            p.ppid = current.pid
            p.parent_rank = current.rank
            p.meta["parent_from"] = "file order"
