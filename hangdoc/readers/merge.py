"""The cross-file step of reading: one job out of many files.

What needs every file at once: the rank map, DataLoader workers tied to their ranks through parent
pids, local ranks that are the ranks on one host, one entry per process where a process was dumped
twice, file names printed at different lengths by different dumpers, log events joined with the
processes they speak of, and the world size.
"""

from __future__ import annotations

import importlib
import json
import os
from typing import Dict, List, Optional, Set, Tuple

from hangdoc.bounds import MAX_RANK, bounded_int
from hangdoc.model import (
    Frame,
    ROLE_LAUNCHER,
    ROLE_RANK,
    ROLE_WORKER,
    STATUS_OK,
    Job,
    ParseError,
    Process,
    Source,
    Thread,
)
from hangdoc.readers import pyspy as _pyspy
from hangdoc.readers.events import join_events
from hangdoc.safeio import open_input, read_bounded

__all__ = ["finish_job", "load_rank_map", "normalize_rank_map"]


def _optional(module: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def load_rank_map(path: str) -> Dict[str, int]:
    """A rank map file: JSON ``{"host:pid": rank}`` or ``{"pid": rank}``; values may also be
    objects with a ``"rank"`` key (``truth.json`` of the captured fixtures). Raises ValueError."""
    with open_input(path) as f:  # a regular file only: a FIFO would block
        data = json.loads(read_bounded(f, 256 << 20, "rank map").decode("utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a rank map is a JSON object {{\"host:pid\": rank}}")
    return normalize_rank_map(data)


def normalize_rank_map(data: Dict[str, object]) -> Dict[str, int]:
    """``{"host:pid": rank}`` with str keys and int ranks; raises ValueError on a rank that is no integer.

    >>> normalize_rank_map({"n1:42": "3", 43: {"rank": 4}})
    {'n1:42': 3, '43': 4}
    """
    if all(type(v) is int and 0 <= v <= MAX_RANK for v in data.values()) and all(type(k) is str for k in data):
        return data  # type: ignore[return-value]  # already normal (load_rank_map's output): no copy
    out: Dict[str, int] = {}
    for k, v in data.items():
        if isinstance(v, dict):
            v = v.get("rank")
        if v is None:
            continue
        r = bounded_int(v, 0, MAX_RANK)
        if r is None:
            shown = "an integer out of range" if isinstance(v, int) else repr(str(v)[:40])
            raise ValueError(f"rank map: rank of {str(k)[:80]!r} is not a non-negative integer up to {MAX_RANK}: {shown}")
        out[str(k)] = r
    return out


def finish_job(job: Job, rank_map: Optional[Dict[str, object]] = None) -> None:
    """Identity that needs all files at once: rank map, worker → rank ties, local ranks, world size.

    A rank map entry matches a process by ``host:pid`` (hosts also by their short name:
    ``node1.cluster`` is ``node1``) or by ``pid`` alone. Entries that match nothing are reported
    (as errors of a source named ``rank map``). Entries for hosts no dump came from widen the world
    (their ranks are missing) only if some ``host:pid`` entry matched, so a map that spells hosts
    differently, or is another job's, does not invent missing ranks.
    """
    rmap = normalize_rank_map(rank_map) if rank_map else {}
    used_keys: Set[str] = set()
    if rmap:
        short = {}
        for k, v in rmap.items():
            host, sep, pid = k.rpartition(":")
            if sep and host:
                short.setdefault(f"{_short_host(host)}:{pid}", k)
        shorts: Dict[str, str] = {}  # host -> its short name, worked out once a host
        for p in job.processes:
            key = None
            if p.host is not None and p.pid is not None:
                key = f"{p.host}:{p.pid}"
                if key not in rmap:
                    sh = shorts.get(p.host)
                    if sh is None:
                        sh = shorts[p.host] = _short_host(p.host)
                    key = short.get(f"{sh}:{p.pid}")
                    if key is not None and key not in rmap:
                        key = None
            if key is None and p.pid is not None and str(p.pid) in rmap:
                key = str(p.pid)
            if key is None:
                continue
            used_keys.add(key)
            r = rmap[key]
            if p.role == ROLE_WORKER:
                # a map that names a worker's pid gives the rank it works for
                if p.parent_rank is None:
                    p.parent_rank = r
                    p.meta["parent_from"] = "rank map"
            else:
                if p.rank is not None and p.rank != r:
                    p.meta["rank_before_map"] = p.rank
                p.rank = r
                p.meta["rank_from"] = "rank map"
                if p.role != ROLE_LAUNCHER:
                    p.role = ROLE_RANK
        _report_unused_map_entries(job, rmap, used_keys)

    # torchrun's [defaultN]: is the local rank; on one host it is the rank too
    hosts = {p.host for p in job.processes if p.local_rank is not None or p.rank is not None}
    if len(hosts) <= 1:
        for p in job.processes:
            if p.rank is None and p.local_rank is not None and p.role == ROLE_RANK:
                p.rank = p.local_rank
                p.meta.setdefault("rank_from", "local rank (one host)")

    by_pid: Dict[Tuple[Optional[str], int], Process] = {}
    for p in job.processes:
        if p.pid is not None and p.role != ROLE_WORKER:
            by_pid.setdefault((p.host, p.pid), p)
    for p in job.processes:
        if p.role == ROLE_WORKER and p.ppid is not None:
            parent = by_pid.get((p.host, p.ppid))
            if parent is not None and parent.rank is not None:
                p.parent_rank = parent.rank

    _unify_file_names(job.processes)
    _merge_duplicates(job)
    _one_job(job)
    join_events(job)

    sizes = [p.meta["world_size"] for p in job.processes if isinstance(p.meta.get("world_size"), int)]
    if rmap:
        # Entries for hosts no dump came from count only when the map's host names are proven to be
        # the dumps' (some host:pid entry matched): then a host without dump is a node that did not
        # dump; otherwise the map spells hosts differently or is another job's, and says nothing.
        hosts_read = {_short_host(h) for h in {p.host for p in job.processes if p.host is not None}}
        proven = any(":" in k for k in used_keys)
        counted = [r for k, r in rmap.items() if k in used_keys or ":" not in k or proven
                   or _short_host(k.rpartition(":")[0]) in hosts_read]
        if counted:
            sizes.append(max(counted) + 1)
    for r in job.records:
        sizes.append(r.rank + 1)
        if r.group_ranks:
            sizes.append(max(r.group_ranks) + 1)
    records = _optional("hangdoc.readers.records")
    if records is not None and hasattr(records, "world_size"):
        for s in job.sources:
            if s.records and "hangdoc-records" in s.formats:
                try:
                    ws = records.world_size(s.path)
                except Exception:
                    ws = None
                if isinstance(ws, int):
                    sizes.append(ws)
    job.world_size = max(sizes) if sizes else None


def _frame_count(p: Process) -> int:
    return sum(len(t.frames) for t in p.threads)


def _python_stack(p: Process) -> Tuple[Tuple[str, str, Optional[int]], ...]:
    t = p.main_thread
    return tuple((f.function, f.file, f.line) for f in t.frames if not f.native) if t is not None else ()


def _merge_duplicates(job: Job) -> None:
    """One process, one entry: the same ``host:pid`` read twice (a plain and a ``--native`` dump,
    two snapshots in one file) keeps its richest readable dump (of equals, the one read last); the
    traceback a rank printed as it died (pid unknown, read from a log) folds into that rank's live
    dump when there is one.

    What was folded stays visible: ``meta["snapshots"]`` counts the dumps of the process,
    ``meta["moved"]`` says its Python stack differed between them (it was not stuck), and
    ``meta["exception"]`` keeps the exception of a folded traceback.
    """
    by_pid: Dict[Tuple[str, int], List[Process]] = {}
    for p in job.processes:
        if p.host is not None and p.pid is not None:
            by_pid.setdefault((p.host, p.pid), []).append(p)
    drop: Set[int] = set()
    for same in by_pid.values():
        if len(same) < 2:
            continue
        # the richest readable dump; of equals, the last read
        _, keep = max(enumerate(same), key=lambda ip: (ip[1].status == STATUS_OK, _frame_count(ip[1]), ip[0]))
        keep.meta["snapshots"] = sum(p.meta.get("snapshots", 1) for p in same)  # a file's repeats count
        stacks = {_python_stack(p) for p in same if p.status == STATUS_OK}
        if _traceback_in_front(same, keep):
            pass  # one dump with a traceback in front of its threads, not a second snapshot
        elif len(stacks) > 1:
            keep.meta["moved"] = True
        for p in same:
            if p is not keep:
                drop.add(id(p))
                if p.rank is not None and keep.rank is None:
                    keep.rank = p.rank
    live: Dict[int, List[Process]] = {}
    for p in job.processes:
        if p.rank is not None and p.pid is not None and id(p) not in drop and p.role != ROLE_WORKER:
            live.setdefault(p.rank, []).append(p)
    for p in job.processes:
        if p.pid is None and p.rank is not None and "exception" in p.meta and id(p) not in drop:
            same_rank = [q for q in live.get(p.rank, ()) if p.host is None or q.host is None or q.host == p.host]
            if len(same_rank) == 1:
                q = same_rank[0]
                q.meta.setdefault("exception", p.meta["exception"])
                q.meta.setdefault("exception_at", f"{p.source}:{p.source_line}")
                drop.add(id(p))
    _merge_snapshots(job, drop)
    if drop:
        job.processes[:] = [p for p in job.processes if id(p) not in drop]


def _traceback_in_front(same: List[Process], keep: Process) -> bool:
    """The watchdog writes a traceback in front of every thread's stack, under the same tag line:
    the main function's when it raised (then the main thread's stack is in hangdoc's own dump code,
    and the traceback's main thread, where it raised, takes its place), or a thread's that died of
    an exception before a stall. One process either way, the exception noted, not two snapshots
    of a moving one. True when ``same`` is such a pair and ``keep`` was mended."""
    if len(same) != 2 or keep.format not in _SNAPSHOT_FORMATS:
        return False
    reason = str(keep.meta.get("reason", ""))
    tb = next((p for p in same if p is not keep and p.format == "traceback" and p.meta.get("reason") == reason), None)
    if tb is None:
        return False
    if reason.startswith("raised_"):
        raised = tb.main_thread
        if raised is None or not raised.frames:
            return False
        main = keep.main_thread
        threads = [t for t in keep.threads if t is not main]
        keep.threads = [Thread(ident=main.ident if main is not None else raised.ident, name=raised.name,
                               frames=raised.frames, state=raised.state, is_main=True)] + threads
    elif tb.source != keep.source or not tb.meta.get("exception"):
        return False
    keep.meta.setdefault("exception", tb.meta.get("exception"))
    return True


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


def _one_job(job: Job) -> None:
    """Dumps of two runs in one directory (yesterday's hang left beside today's) have two live
    processes for a rank. They are told apart by the launcher that started them (the ``ppid`` of the
    tag lines, per host) or else by the files' times; the newest run (by its last recorded call,
    then its files' times) is kept, with its records, and the evidence says so (one line on
    stderr) instead of merging two runs into one verdict."""
    ranked = [p for p in job.processes if p.rank is not None and p.pid is not None
              and p.role not in (ROLE_WORKER, ROLE_LAUNCHER) and p.format != "log"]
    per_rank: Dict[int, Set[Tuple[Optional[str], int]]] = {}
    for p in ranked:
        per_rank.setdefault(p.rank, set()).add((p.host, p.pid))  # type: ignore[arg-type]
    if not any(len(v) > 1 for v in per_rank.values()):
        return
    if all(p.ppid is not None for p in ranked):
        key = {id(p): ("launcher", p.host, p.ppid) for p in ranked}
    else:
        # no launcher pid: one run per file time (to the second)
        key = {id(p): ("files", int(_mtime(p.source))) for p in ranked}
    runs: Dict[Tuple, List[Process]] = {}
    for p in ranked:
        runs.setdefault(key[id(p)], []).append(p)
    how = ""
    if len(runs) < 2 or any(len({p.rank for p in ps}) != len(ps) for ps in runs.values()):
        # files copied without their times (cp, scp, a git checkout) all share one: the pids
        blocks = _pid_blocks(ranked)
        if blocks is None:
            _mixed_runs(job, per_rank)
            return
        runs, how = blocks, " (told apart by their pids: a launcher starts its ranks together, a later run's pids are higher)"
    # newest: by the time of its last recorded call (files copied without -p all share one mtime),
    # then by its files' times
    last_call: Dict[Tuple[Optional[str], Optional[int]], float] = {}
    for r in job.records:
        t = r.time_completed or r.time_issued
        if isinstance(t, (int, float)) and t > last_call.get((r.host, r.pid), float("-inf")):
            last_call[(r.host, r.pid)] = float(t)
    newest = max(runs, key=lambda k: (max((last_call.get((p.host, p.pid), float("-inf")) for p in runs[k])),
                                      max(_mtime(p.source) for p in runs[k]), len(runs[k]), max(p.pid for p in runs[k])))
    gone = {(p.host, p.pid) for k, ps in runs.items() if k != newest for p in ps}
    keep = runs[newest]
    job.processes[:] = [p for p in job.processes if (p.host, p.pid) not in gone
                        and not (p.role == ROLE_WORKER and (p.host, p.ppid) in gone)]
    job.records[:] = [r for r in job.records if (r.host, r.pid) not in gone]
    from hangdoc.ranges import describe_ranks

    others = "; ".join(f"{describe_ranks(sorted({p.rank for p in ps}))} with pids "
                       f"{', '.join(str(p.pid) for p in sorted(ps, key=lambda q: q.rank)[:4])}"
                       + ("…" if len(ps) > 4 else "") for k, ps in runs.items() if k != newest)
    src = Source("evidence")
    src.errors.append(ParseError(src.path, 0, f"{len(runs)} runs of a job are in the evidence: kept the newest "
                                 f"({describe_ranks(sorted({p.rank for p in keep}))}, pids from {min(p.pid for p in keep)}); "
                                 f"left out {others}{how}: give one run's files to see another"))
    job.sources.append(src)


def _pid_blocks(ranked: List[Process]) -> Optional[Dict[Tuple, List[Process]]]:
    """The runs, when the processes in pid order fall into blocks that each hold every rank once
    (a launcher starts its ranks one after another, so on one machine one run's pids are close
    together); ``None`` when they do not (several machines' pids interleave, a run is incomplete).

    >>> from hangdoc.model import Process
    >>> ps = [Process(pid=pid, rank=r) for pid, r in [(7581, 0), (7485, 0), (7486, 1), (7582, 1)]]
    >>> sorted((k, [p.pid for p in b]) for k, b in _pid_blocks(ps).items())
    [(('pids', 0), [7485, 7486]), (('pids', 1), [7581, 7582])]
    >>> _pid_blocks([Process(pid=pid, rank=r) for pid, r in [(10, 0), (11, 0), (12, 1), (13, 1)]]) is None
    True
    """
    blocks: List[List[Process]] = [[]]
    seen: Set[Optional[int]] = set()
    for p in sorted(ranked, key=lambda q: q.pid or 0):
        if p.rank in seen:
            blocks.append([])
            seen = set()
        blocks[-1].append(p)
        seen.add(p.rank)
    ranks = {p.rank for p in ranked}
    if len(blocks) < 2 or any({p.rank for p in b} != ranks for b in blocks):
        return None
    return {("pids", i): b for i, b in enumerate(blocks)}


def _mixed_runs(job: Job, per_rank: Dict[int, Set[Tuple[Optional[str], int]]]) -> None:
    """Two live processes for one rank that nothing tells apart: say so, once, on stderr."""
    from hangdoc.ranges import describe_ranks

    twice = sorted(r for r, v in per_rank.items() if len(v) > 1)
    r = twice[0]
    pids = ", ".join(str(pid) for _, pid in sorted(per_rank[r], key=lambda hp: hp[1]))
    src = Source("evidence")
    src.errors.append(ParseError(src.path, 0, f"more than one process for {describe_ranks(twice)} (rank {r}: pids {pids}): "
                                 "the evidence holds several runs of a job that neither their launcher, their files' "
                                 "times nor their pids tell apart; the verdict mixes them: give one run's files"))
    job.sources.append(src)


#: formats that are a snapshot of a live process (a log's traceback is not)
_SNAPSHOT_FORMATS = {"faulthandler", "py-spy", "py-spy-json", "pystack", "gdb"}


def _merge_snapshots(job: Job, drop: Set[int]) -> None:
    """Periodic dumps of one job (the debug server's ``stacks_<ts>.txt``, a watchdog that dumped
    twice) name ranks but no pids: one rank's processes from several files are snapshots of one
    process. The newest file (names sort by their time stamps) is the state; an earlier stack that
    differs says the rank was moving (``meta["moved"]``)."""
    by_rank: Dict[Tuple[Optional[str], int], List[Process]] = {}
    for p in job.processes:
        if (p.pid is None and p.rank is not None and p.role != ROLE_WORKER and p.format in _SNAPSHOT_FORMATS
                and id(p) not in drop):
            by_rank.setdefault((p.host, p.rank), []).append(p)
    for same in by_rank.values():
        if len({p.source for p in same}) < 2:
            continue
        keep = max(same, key=lambda p: (os.path.basename(p.source), p.source, p.source_line))
        keep.meta["snapshots"] = len(same)
        if len({_python_stack(p) for p in same if p.status == STATUS_OK}) > 1:
            keep.meta["moved"] = True
        drop.update(id(p) for p in same if p is not keep)


def _short_host(host: str) -> str:
    return host.split(".", 1)[0] if not host.replace(".", "").isdigit() else host


def _entries(n: int) -> str:
    return f"{n} entry" if n == 1 else f"{n} entries"


def _report_unused_map_entries(job: Job, rmap: Dict[str, int], used: Set[str]) -> None:
    unused = [k for k in rmap if k not in used]
    if not unused or not job.processes:
        return
    hosts_read = sorted({p.host for p in job.processes if p.host is not None})
    short_read = {_short_host(h) for h in hosts_read}
    src = Source("rank map")
    foreign = [k for k in unused if ":" in k and _short_host(k.rpartition(":")[0]) not in short_read]
    if foreign:
        shown = ", ".join(sorted({k.rpartition(":")[0] for k in foreign})[:5])
        src.errors.append(ParseError(src.path, 0, f"{_entries(len(foreign))} name{'s a host' if len(foreign) == 1 else ' hosts'} no dump came from ({shown}); "
                                     f"the dumps' hosts are {', '.join(hosts_read[:5]) or 'unknown'}{' ...' if len(hosts_read) > 5 else ''}"))
    local = [k for k in unused if k not in foreign]
    if local:
        src.errors.append(ParseError(src.path, 0, f"{_entries(len(local))} match{'es' if len(local) == 1 else ''} no process read "
                                     f"({', '.join(f'{k}={rmap[k]}' for k in local[:5])}{' ...' if len(local) > 5 else ''})"))
    job.sources.append(src)


def _unify_file_names(processes: List[Process]) -> None:
    """One file printed at different lengths by different dumpers (py-spy's ``stopped_rank.py``,
    faulthandler's ``/work/.../stopped_rank.py``) gets one name, so the stacks group together.

    Works per distinct stack (stacks are interned): each is rebuilt once and stays shared.
    """
    from dataclasses import replace

    from hangdoc.analysis.normalize import common_suffixes

    stacks: Dict[int, Tuple[Frame, ...]] = {}
    qualified: Dict[int, bool] = {}  # stack id -> printed by py-spy (qualified function names)
    short: Dict[int, bool] = {}  # stack id -> printed by plain py-spy (short file names)
    for p in processes:
        for t in p.threads:
            if id(t.frames) not in stacks:
                stacks[id(t.frames)] = t.frames
                qualified[id(t.frames)] = p.format in (_pyspy.FORMAT, _pyspy.FORMAT_JSON)
                # plain py-spy shortens every file name to its package-relative path; a py-spy stack
                # with absolute paths was dumped with --full-filenames and holds long names
                short[id(t.frames)] = p.format == _pyspy.FORMAT and not any(
                    f.file.startswith("/") for f in t.frames if not f.native)
    # Only a name plain py-spy shortened stands for a longer one another dumper printed: within one
    # format ``a.py`` and ``tools/a.py`` may well be two files.
    short_files = {f.file for sid, s in stacks.items() if short[sid] for f in s if not f.native}
    rename = {long: s for long, s in common_suffixes({f.file for s in stacks.values() for f in s if not f.native}).items()
              if s in short_files and long not in short_files}
    # py-spy prints qualified names (``_exception_logger.<locals>.wrapper``), faulthandler,
    # tracebacks and pystack bare ones (``wrapper``): a bare name that a py-spy stack of the same
    # job shows qualified, at the same file and line, is that function.
    long_names: Dict[Tuple[str, Optional[int]], set] = {}
    bare_names: Dict[Tuple[str, Optional[int]], set] = {}
    for sid, s in stacks.items():
        into = long_names if qualified[sid] else bare_names
        for f in s:
            if not f.native and f.line is not None:
                into.setdefault((rename.get(f.file, f.file), f.line), set()).add(f.function)
    qualify: Dict[Tuple[str, Optional[int], str], str] = {}
    for where, bare in bare_names.items():
        longs = long_names.get(where)
        if not longs or len(longs) != 1:
            continue
        (longest,) = longs
        for n in bare:
            if "." not in n and longest.endswith("." + n):
                qualify[where + (n,)] = longest
    if not rename and not qualify:
        return
    frames: Dict[int, Frame] = {}
    rebuilt: Dict[int, Tuple[Frame, ...]] = {}
    for sid, s in stacks.items():
        new = []
        changed = False
        for f in s:
            if not f.native and (f.file in rename or qualify):
                g = frames.get(id(f))
                if g is None:
                    file = rename.get(f.file, f.file)
                    fn = qualify.get((file, f.line, f.function), f.function)
                    g = frames[id(f)] = f if (file, fn) == (f.file, f.function) else replace(f, file=file, function=fn)
                changed = changed or g is not f
                f = g
            new.append(f)
        if changed:
            rebuilt[sid] = tuple(new)
    for p in processes:
        for t in p.threads:
            s = rebuilt.get(id(t.frames))
            if s is not None:
                t.frames = s
