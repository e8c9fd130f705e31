"""Readers: stack dumps and collective records of a hung job → one :class:`~hangdoc.model.Job`.

:func:`read_paths` takes files, globs and directories (walked recursively), detects the format of
every block of every file (several formats may share a file: ``srun --output=trace-%N.out``
appends whatever each dumper printed), and fills ``Job.processes``, ``Job.records``,
``Job.sources`` (each with its :class:`~hangdoc.model.ParseError` list) and ``Job.world_size``.

Stack formats, one module each: :mod:`~hangdoc.readers.pyspy` (plain, ``--native``, ``--locals``,
``--json``, py-spy's own errors), :mod:`~hangdoc.readers.faulthandler`,
:mod:`~hangdoc.readers.traceback`, :mod:`~hangdoc.readers.pystack`, :mod:`~hangdoc.readers.gdb`.
Record files go to ``records`` and ``flight_recorder``. See ``docs/formats.md``.

Who a process is (host, pid, rank, role) is put together from every piece of evidence there is:
the ``# hangdoc process`` tag line before a dump (:mod:`hangdoc.tags`), a line prefix (``[rank3]:``,
``[default3]:`` from torchrun ``--tee``, ``[host:3]`` from hangdoc), the file name
(``trace-node7.out`` → host ``node7``; ``stacks-node7-r3-42.txt``; ``stderr-rank3.log``), a
``rank`` argument or local in a py-spy ``--locals`` dump, and the rank map (``{"host:pid": rank}``
or ``{"pid": rank}``), which wins. A process whose main thread runs ``_worker_loop`` is a
DataLoader worker, tied to its rank through its parent pid (tag, ``py-spy --subprocesses``) or
through the file it is in; torchrun and the elastic agent are launchers.

    >>> job = read_text('''# hangdoc process host=n1 pid=42 rank=3 world_size=4
    ... Process 42: python train.py
    ... Python v3.11.7 (/usr/bin/python3.11)
    ...
    ... Thread 42 (idle): "MainThread"
    ...     all_reduce (torch/distributed/distributed_c10d.py:3252)
    ...     main (train.py:40)
    ... ''')
    >>> p = job.processes[0]
    >>> (p.host, p.pid, p.rank, p.role, job.world_size, p.main_thread.top.function)
    ('n1', 42, 3, 'rank', 4, 'all_reduce')
"""

from __future__ import annotations

import fnmatch
import gc
import glob
import importlib
import io
import json
import os
import re
from contextlib import contextmanager
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Set, Tuple

from hangdoc.model import (
    Frame,
    ROLE_LAUNCHER,
    ROLE_RANK,
    ROLE_UNKNOWN,
    ROLE_WORKER,
    STATUS_EXITED,
    STATUS_OK,
    STATUS_TRUNCATED,
    CollectiveRecord,
    Job,
    ParseError,
    Process,
    Source,
)
from hangdoc.bounds import MAX_IDENT, MAX_PID, MAX_RANK, MAX_RANKS, bounded_int
from hangdoc.readers import faulthandler as _faulthandler
from hangdoc.readers import gdb as _gdb
from hangdoc.readers import pyspy as _pyspy
from hangdoc.readers import pystack as _pystack
from hangdoc.readers import traceback as _traceback
from hangdoc.readers._base import BlockParser, FileContext, Interner, chunks, squeeze
from hangdoc.safeio import drop_nul_runs, open_input, read_bounded, sniff_head
from hangdoc.tags import PREFIX as _TAG_PREFIX
from hangdoc.tags import parse_exited, parse_tag
from hangdoc.textsafe import strip_ansi_bytes

__all__ = [
    "read_paths", "read_files", "read_file", "read_text", "expand_paths", "finish_job", "load_rank_map",
    "normalize_rank_map", "gc_paused", "Interner",
]

#: bytes read to decide what a file is
HEAD_BYTES = 1 << 16

# Markers of a stack dump in a file's head: a file found by walking a directory is read only when
# its head holds one of them (a file named on the command line is always read).
_MARKERS = (
    b"Thread ",
    b"Traceback (most recent call last)",
    b"Process ",
    b"Current thread 0x",
    b"Stack (most recent call first)",
    b"Traceback for thread ",
    _TAG_PREFIX.strip().encode(),
    b'"thread_name"',
    b"Error: Failed",
    b"Fatal Python error",
)
# Never dumps, when met in a directory walk.
_SKIP_SUFFIXES = (
    ".py", ".pyc", ".pyo", ".so", ".o", ".a", ".md", ".rst", ".html", ".svg", ".dot", ".png", ".jpg",
    ".jpeg", ".gif", ".pdf", ".gz", ".bz2", ".xz", ".zip", ".tar", ".whl", ".ipynb", ".toml", ".cfg",
    ".ini", ".yaml", ".yml", ".pt", ".pth", ".safetensors", ".bin", ".npy", ".npz",
)
# What hangdoc itself writes next to the dumps: reports, not inputs.
_OWN_OUTPUTS = {"report.txt", "report.json", "report.md", "report.html", "report.dot", "report.svg"}
# Names that only dumps carry (srun --output=trace-%N.out, hangdoc dump, the watchdog, Flight
# Recorder's default): found by a directory walk, an empty or unreadable one is reported, not
# skipped; an empty trace-node3.out is how a node that failed to dump shows itself.
_DUMP_NAMES = ("trace-*.out", "stacks-*-r*-*.txt", "nccl_trace_rank_*", "fr_trace*")
_SKIP_DIRS = {"__pycache__", ".git", ".hg", ".svn", "node_modules", ".tox", ".venv", "venv"}

# torchrun --tee / --log-line-prefix-template: "[rank3]:", "[default3]:", "[3]:";
# hangdoc's own prefix: "[host:3] ".
_TORCHRUN_PREFIX_RE = re.compile(r"^\[([A-Za-z_]*)(\d+)\]:")
_HANGDOC_PREFIX_RE = re.compile(r"^\[([A-Za-z0-9_.\-]+):(\d+)\] ")


# --- block detection ---------------------------------------------------------------------------


def _detect(ctx: FileContext, lineno: int, line: str) -> Optional[BlockParser]:
    """The parser for a block that starts at ``line``, or None when no block starts there."""
    c = line[:1]
    if c == "T":
        if line.startswith("Thread "):
            if _faulthandler.starts(line):
                return _faulthandler.FaulthandlerParser(ctx, lineno)
            if _gdb.starts(line):
                return _gdb.GdbParser(ctx, lineno)
            if _pyspy.starts(line):
                return _pyspy.PySpyParser(ctx, lineno)
        elif _traceback.starts(line):
            return _traceback.TracebackParser(ctx, lineno)
        elif _pystack.starts(line):
            return _pystack.PystackParser(ctx, lineno)
    elif c == "P":
        if _pyspy.starts(line):
            return _pyspy.PySpyParser(ctx, lineno)
    elif c in ("C", "S", "F"):
        if _faulthandler.starts(line):
            return _faulthandler.FaulthandlerParser(ctx, lineno)
    elif c in ("[", "{"):
        if _pyspy.starts_json(line):
            return _pyspy.PySpyJsonParser(ctx, lineno)
    elif c in ("E", "e"):
        if _pyspy.starts(line):
            return _pyspy.PySpyParser(ctx, lineno)
    return None


class _Channel:
    """The lines of one prefix (one rank's output) inside a file, with their own parser."""

    __slots__ = ("parser", "tag_line", "rank", "local_rank", "host")

    def __init__(self, rank: Optional[int] = None, local_rank: Optional[int] = None, host: Optional[str] = None):
        self.parser: Optional[BlockParser] = None
        #: the line of a tag not yet followed by anything (0: none)
        self.tag_line = 0
        self.rank = rank
        self.local_rank = local_rank
        self.host = host


#: launcher prefixes peeled off one line at most (torchrun nests two; more is no prefix but text)
_MAX_PREFIXES = 8


def _channel_for(channels: Dict[str, _Channel], line: str) -> Tuple[_Channel, str]:
    """Strip every leading prefix (torchrun nests its own inside the template's) → channel, text."""
    if line[:1] != "[":
        return channels[""], line
    key = ""
    rank = local = None
    host = None
    peeled = 0
    # at most _MAX_PREFIXES prefixes: each peel copies the line, so "[1]:[1]:[1]:..." would be quadratic
    while line[:1] == "[" and peeled < _MAX_PREFIXES:
        peeled += 1
        m = _TORCHRUN_PREFIX_RE.match(line)
        if m:
            name, num = m.group(1), bounded_int(m.group(2), 0, MAX_RANK)
            if name in ("rank", ""):
                rank = num
            else:
                local = num
            key = key or m.group(0)
            line = line[m.end():]
            # torchrun's --tee adds no space, torch's own "[rank0]: " one: indentation in dumps is
            # even (2, 4, 8 spaces), so an odd run of spaces holds the prefix's own space
            n = len(line) - len(line.lstrip(" "))
            if n % 2:
                line = line[1:]
            continue
        m = _HANGDOC_PREFIX_RE.match(line)
        if m:
            host, rank = m.group(1), bounded_int(m.group(2), 0, MAX_RANK)
            key = key or m.group(0).strip()
            line = line[m.end():]
            continue
        break
    ch = channels.get(key)
    if ch is None:
        ch = channels[key] = _Channel(rank=rank, local_rank=local, host=host)
    return ch, line


# --- one file ----------------------------------------------------------------------------------


def _read_stacks(path: str, source: Source, interner: Interner, fileobj=None) -> List[Process]:
    ctx = FileContext(path, source, interner)
    channels: Dict[str, _Channel] = {"": _Channel()}
    main = channels[""]
    emitted: List[Tuple[_Channel, Process]] = []
    tags: List[Tuple[_Channel, int, Dict[str, str]]] = []
    failures: List[Dict[str, object]] = []
    exits: List[Tuple[_Channel, int, Dict[str, str]]] = []

    def close(ch: _Channel) -> None:
        parser, ch.parser = ch.parser, None
        if parser is None:
            return
        try:
            procs = parser.close()
        except Exception as e:  # a reader bug must cost one block, never the whole input
            ctx.error(parser.start, f"could not read this {parser.format} block: {type(e).__name__}: {e}")
            return
        for p in procs:
            emitted.append((ch, p))

    last = 0
    tag_start = _TAG_PREFIX.strip()
    # Fast path: frame lines of the un-prefixed channel (nearly every line of a dump) go straight
    # to its parser's sink; msink/mindent mirror main.parser's and are refreshed after any other line.
    touched: Set[_Channel] = set()  # channels with lines in the current chunk
    msink: Optional[List[str]] = None
    mindent = "\x00"
    for first, block in chunks(path, ctx, fileobj):
        lineno = first - 1
        for line in block:
            lineno += 1
            if msink is not None and line.startswith(mindent):
                msink.append(line)
                continue
            if line[:1] == "[":
                ch, text = _channel_for(channels, line)
                touched.add(ch)
            else:
                ch, text = main, line
                mp = main.parser
                if mp is not None:  # _dispatch's first step, inlined for the main channel
                    try:
                        mine = mp.feed(lineno, line)
                    except Exception as e:
                        ctx.error(lineno, f"could not read this line: {type(e).__name__}: {e}")
                        mine = True
                    if mine:
                        msink = mp.sink
                        if msink is not None:
                            mindent = mp.indent
                        continue
                    close(main)
            _dispatch(ctx, ch, lineno, text, close, tags, failures, tag_start, exits)
            mp = main.parser
            if mp is not None and mp.sink is not None:
                msink, mindent = mp.sink, mp.indent
            else:
                msink = None
        last = lineno
        touched.add(main)
        _squeeze_sinks(touched)
        touched.clear()
    for ch in channels.values():
        close(ch)
    if ctx.cut_off and ctx.cut_off == last and emitted:
        ctx.error(last, "file ends in the middle of a line (cut off?)")
        lastp = max((p for _, p in emitted), key=lambda p: p.source_line)
        if lastp.status == STATUS_OK:
            lastp.status = STATUS_TRUNCATED
            lastp.status_detail = "the dump ends in the middle of a line"

    for ch, lineno, fields in exits:
        # a DataLoader worker or a launcher that exits is no news (workers come and go): only ranks
        if fields.get("role") not in (ROLE_WORKER, ROLE_LAUNCHER):
            emitted.append((ch, _exited_process(ctx, lineno, fields)))
    emitted.sort(key=lambda cp: cp[1].source_line)
    _apply_tags(emitted, tags)
    _apply_elastic_failures(emitted, failures)
    procs: List[Process] = []
    for ch, p in emitted:
        if p.host is None:
            p.host = ch.host
        if p.rank is None and ch.rank is not None:
            p.rank = ch.rank
            p.meta.setdefault("rank_from", "prefix")
        if p.local_rank is None and ch.local_rank is not None:
            p.local_rank = ch.local_rank
        ctx.add(p)
        procs.append(p)
    _from_file_name(ctx, procs)
    for p in procs:
        _finish_identity(p, interner)
    _tie_workers_by_order(procs)
    ctx.finish()
    return procs


def _squeeze_sinks(channels: Iterable[_Channel]) -> None:
    """Keep a runaway stack's raw lines bounded while it is read (its middle goes, see _base.squeeze):
    called once a chunk with the channels that had lines in it."""
    for ch in channels:
        sink = ch.parser.sink if ch.parser is not None else None
        if sink is not None and len(sink) >= 128:
            squeeze(sink)


def _exited_process(ctx: FileContext, lineno: int, fields: Dict[str, str]) -> Process:
    """A process ``hangdoc dump`` found gone before it could dump it: identity, no stack."""
    p = Process(source=ctx.path, source_line=lineno, format="hangdoc-exited")
    reason = fields.pop("reason", "exited")
    _apply_tag(p, fields)
    p.status = STATUS_EXITED
    p.status_detail = reason.replace("_", " ")
    if p.role == ROLE_UNKNOWN:
        p.role = ROLE_RANK
    return p


def _dispatch(ctx: FileContext, ch: _Channel, lineno: int, text: str, close: Callable[[_Channel], None],
              tags: List[Tuple[_Channel, int, Dict[str, str]]], failures: List[Dict[str, object]], tag_start: str,
              exits: List[Tuple[_Channel, int, Dict[str, str]]]) -> None:
    """One line of one channel: to its active parser, or the start of a block, a tag, or nothing."""
    parser = ch.parser
    if parser is not None:
        sink = parser.sink
        if sink is not None and text.startswith(parser.indent):
            sink.append(text)
            return
        try:
            if parser.feed(lineno, text):
                return
        except Exception as e:
            ctx.error(lineno, f"could not read this line: {type(e).__name__}: {e}")
            return
        close(ch)
    if text[:1] == "#" and text.startswith(tag_start):
        # the fields of one tag text are parsed once and shared (read only): 8 MB of a repeated
        # tag line held 118,000 dicts, 93 MB
        cache = ctx.interner.tags
        fields = cache.get(text)
        if fields is None:
            fields = parse_tag(text)
            if fields is not None and len(cache) < 65536:
                cache[text] = fields
        if fields is not None:
            tags.append((ch, lineno, fields))
            ch.tag_line = lineno
        return
    if text[:1] == "#":
        fields = parse_exited(text)
        if fields is not None:
            exits.append((ch, lineno, fields))
            return
    if ch.tag_line and text.startswith("Error: "):
        # right after a tag line, any "Error: ..." is the dumper's (hangdoc dump writes the
        # reasons no dumper could read the process this way)
        new: Optional[BlockParser] = _pyspy.PySpyParser(ctx, lineno, after_tag=True)
    else:
        new = _detect(ctx, lineno, text)
    if new is not None or text.strip():
        ch.tag_line = 0
    if new is not None:
        new.feed(lineno, text)
        ch.parser = new
    elif text[:2] == "  " and text[2:3].isalpha():
        _elastic_failure_line(text, failures)


# no "(.*?)\s*$": a lazy group before a trailing \s* is quadratic on a line padded with spaces
_ELASTIC_RE = re.compile(r"^  (host|rank|exitcode)[ \t]+: ")
_ELASTIC_RANK_RE = re.compile(r"^(\d+) \(local_rank: (\d+)\)")
_ELASTIC_PID_RE = re.compile(r"\(pid: (\d+)\)")


def _elastic_failure_line(text: str, failures: List[Dict[str, object]]) -> None:
    """torchrun's ``ChildFailedError`` table (``host :``, ``rank : 1 (local_rank: 1)``,
    ``exitcode : 1 (pid: 13344)``): the only place a console names a failed rank's pid."""
    m = _ELASTIC_RE.match(text)
    if not m:
        return
    key, value = m.group(1), text[m.end():].strip()
    if key == "host":
        failures.append({"host": value})
    elif failures:
        entry = failures[-1]
        if key == "rank":
            rm = _ELASTIC_RANK_RE.match(value)
            if rm:
                entry["rank"], entry["local_rank"] = bounded_int(rm.group(1), 0, MAX_RANK), bounded_int(rm.group(2), 0, MAX_RANK)
        else:
            pm = _ELASTIC_PID_RE.search(value)
            if pm:
                entry["pid"] = bounded_int(pm.group(1), 0, MAX_PID)


def _apply_elastic_failures(emitted: List[Tuple[_Channel, Process]], failures: List[Dict[str, object]]) -> None:
    by_rank = {f["rank"]: f for f in failures if "rank" in f and "pid" in f}
    if not by_rank:
        return
    hosts = {f.get("host") for f in failures}
    if len(hosts) == 1:
        # one torchrun, one host: its own traceback (the launcher's) ran there too
        for ch, p in emitted:
            if p.role == ROLE_LAUNCHER or (p.host is None and ch.host is None and p.rank is None):
                p.host = p.host or next(iter(hosts))  # type: ignore[assignment]
    for ch, p in emitted:
        rank = p.rank if p.rank is not None else ch.rank
        f = by_rank.get(rank)
        if f is None or p.pid is not None:
            continue
        p.pid = f["pid"]  # type: ignore[assignment]
        if p.host is None and ch.host is None:
            p.host = f["host"]  # type: ignore[assignment]
        if p.local_rank is None:
            p.local_rank = f["local_rank"]  # type: ignore[assignment]


def _apply_tags(emitted: List[Tuple[_Channel, Process]], tags: List[Tuple[_Channel, int, Dict[str, str]]]) -> None:
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


def _from_file_name(ctx: FileContext, procs: List[Process]) -> None:
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


def _finish_identity(p: Process, interner: Interner) -> None:
    from hangdoc.analysis.normalize import role_of

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


def _tie_workers_by_order(procs: List[Process]) -> None:
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


# --- files, globs, directories -----------------------------------------------------------------


def expand_paths(paths: Iterable[str]) -> List[Tuple[str, bool]]:
    """``(file, named)`` for every file the arguments stand for; ``named`` is False for files
    found by walking a directory or matching a glob (those are read only when they look like dumps).
    A path that does not exist is returned as is (its Source gets the error)."""
    out: List[Tuple[str, bool]] = []
    seen = set()

    def add(path: str, named: bool) -> None:
        key = os.path.normpath(path)
        if key not in seen:
            seen.add(key)
            out.append((path, named))

    for arg in paths:
        if os.path.isdir(arg):
            for root, dirs, files in os.walk(arg):
                dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("."))
                for name in sorted(files):
                    if not name.startswith("."):
                        add(os.path.join(root, name), False)
        elif os.path.exists(arg):
            add(arg, True)
        elif any(c in arg for c in "*?["):
            matches = sorted(glob.glob(arg, recursive=True))
            if not matches:
                add(arg, True)
            for m in matches:
                if os.path.isdir(m):
                    for f, _ in expand_paths([m]):
                        add(f, False)
                else:
                    add(m, True)
        else:
            add(arg, True)
    return out


def _optional(module: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def _head(path: str, follow: bool = True) -> bytes:
    """The first bytes of a regular file, past a hole of NULs at its start (see hangdoc.safeio)."""
    with open_input(path, follow=follow) as f:
        return sniff_head(f, HEAD_BYTES)


def read_file(path: str, named: bool, job: Job, interner: Interner) -> Optional[Source]:
    """Read one file into ``job``; None when a walked file is not a dump (skipped quietly).

    Only regular files are read: a FIFO, a device or (met in a directory walk) a symbolic link is
    one error line when named, skipped quietly when walked; nothing is ever opened in a blocking way."""
    source = Source(path)
    base = os.path.basename(path)
    follow = named  # a file met in a directory walk is never read through a symbolic link
    named = named or any(fnmatch.fnmatch(base, pat) for pat in _DUMP_NAMES)
    try:
        head = _head(path, follow)
    except OSError as e:
        if not named:
            return None
        source.errors.append(ParseError(path, 0, f"cannot read: {e.strerror or e}"))
        return source
    # colour codes and NUL holes (a file cut while written) say nothing about what a file is
    clean = strip_ansi_bytes(drop_nul_runs(head))
    records = _optional("hangdoc.readers.records")
    if records is not None and (fnmatch.fnmatch(base, "collectives-*.jsonl") or records.looks_like(path, head)):
        recs = _call_reader(records, path, source, follow)
        source.records = len(recs)
        source.formats.append(getattr(records, "FORMAT", "hangdoc-records"))
        job.records.extend(recs)
        return source
    fr = _optional("hangdoc.readers.flight_recorder")
    if fr is not None:
        try:
            is_fr = fr.looks_like(path, head)
        except Exception:
            is_fr = False
        if is_fr or fnmatch.fnmatch(base, "nccl_trace_rank_*") or fnmatch.fnmatch(base, "fr_trace*"):
            recs = _call_reader(fr, path, source, follow)
            source.records = len(recs)
            source.formats.append(getattr(fr, "FORMAT", "flight-recorder"))
            job.records.extend(recs)
            return source
    if not named:
        if base.endswith(_SKIP_SUFFIXES) or base in _OWN_OUTPUTS or b"\x00" in clean[:4096] \
                or not any(m in clean for m in _MARKERS):
            return None
    elif b"\x00" in clean[:4096] and not any(m in clean for m in _MARKERS):
        source.errors.append(ParseError(path, 1, "binary file, not a stack dump; skipped"))
        return source
    try:
        f = open_input(path, follow=follow)
    except OSError as e:
        source.errors.append(ParseError(path, 0, f"cannot read: {e.strerror or e}"))
        return source
    procs = _read_stacks(path, source, interner, f)
    if not procs and not named:
        return None  # a walked file that only looked like a dump (a log that mentions "Thread ")
    source.processes = len(procs)
    job.processes.extend(procs)
    if not procs:
        source.errors.append(ParseError(path, 1 if head else 0, "no stack dump found" if head else "empty file"))
    return source


def _call_reader(module, path: str, source: Source, follow: bool = True) -> List[CollectiveRecord]:
    try:
        return list(module.read(path, source, follow=follow))
    except Exception as e:  # another engineer's reader failing must not take the stacks down
        source.errors.append(ParseError(path, 0, f"could not read records: {type(e).__name__}: {e}"))
        return []


def read_paths(paths: Iterable[str], rank_map: Optional[Dict[str, object]] = None,
               progress: Optional[Callable[[int, int, str], None]] = None) -> Job:
    """Read every dump and record file under ``paths`` into one :class:`~hangdoc.model.Job`.

    ``paths``: files, globs (``trace-*.out``, ``dumps/**/*.txt``) and directories (recursive).
    ``rank_map``: ``{"host:pid": rank}`` (or ``{"pid": rank}``); it overrides other evidence.
    ``progress(i, n, path)`` is called before each file.

    >>> import os, tempfile
    >>> d = tempfile.mkdtemp()
    >>> with open(os.path.join(d, "trace-node7.out"), "w") as f:
    ...     _ = f.write('Process 9: python t.py\\n\\nThread 9 (idle): "MainThread"\\n    main (t.py:3)\\n')
    >>> job = read_paths([d], rank_map={"node7:9": 5})
    >>> [(p.host, p.pid, p.rank) for p in job.processes]
    [('node7', 9, 5)]
    """
    with gc_paused():
        job = read_files(expand_paths(list(paths)), progress)
        finish_job(job, rank_map)
    return job


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while reading.

    Reading makes hundreds of thousands of small objects and no reference cycles among them: the
    collector would only rescan them again and again (it doubled the time at 131,072 ranks).
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def read_files(files: List[Tuple[str, bool]], progress: Optional[Callable[[int, int, str], None]] = None,
               total: Optional[int] = None) -> Job:
    """The per-file part of :func:`read_paths`: ``files`` as :func:`expand_paths` returns them,
    read into a Job without the cross-file step (:func:`finish_job`). For callers that split the
    files among processes and merge the Jobs before ``finish_job``.

    >>> job = read_files([("no/such/file.out", True)])
    >>> [str(e) for e in job.errors]
    ['no/such/file.out:0: no such file or directory']
    """
    job = Job()
    interner = Interner()
    with gc_paused():
        for i, (path, named) in enumerate(files):
            if progress is not None:
                progress(i, total or len(files), path)
            if not os.path.exists(path):
                job.sources.append(Source(path, errors=[ParseError(path, 0, "no such file or directory")]))
                continue
            try:
                source = read_file(path, named, job, interner)
            except Exception as e:  # never a traceback from hangdoc: one error for the file, go on
                source = Source(path, errors=[ParseError(path, 0, f"could not read: {type(e).__name__}: {e}")])
            if source is not None:
                job.sources.append(source)
    return job


def read_text(text: str, name: str = "<text>", rank_map: Optional[Dict[str, object]] = None) -> Job:
    """Read dump text held in memory (tests, doctests, ``hangdoc dump`` output piped in).

    >>> read_text('Thread 0x00007f (most recent call first):\\n  File "t.py", line 3 in main\\n').processes[0].format
    'faulthandler'
    """
    job = Job()
    source = Source(name)
    procs = _read_stacks(name, source, Interner(), io.BytesIO(text.encode("utf-8", "surrogateescape")))
    source.processes = len(procs)
    job.processes.extend(procs)
    job.sources.append(source)
    finish_job(job, rank_map)
    return job


# --- the whole job -----------------------------------------------------------------------------


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
        for p in job.processes:
            key = None
            if p.host is not None and p.pid is not None:
                for cand in (f"{p.host}:{p.pid}", short.get(f"{_short_host(p.host)}:{p.pid}")):
                    if cand is not None and cand in rmap:
                        key = cand
                        break
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

    sizes = [p.meta["world_size"] for p in job.processes if isinstance(p.meta.get("world_size"), int)]
    if rmap:
        # Entries for hosts no dump came from count only when the map's host names are proven to be
        # the dumps' (some host:pid entry matched): then a host without dump is a node that did not
        # dump; otherwise the map spells hosts differently or is another job's, and says nothing.
        hosts_read = {_short_host(p.host) for p in job.processes if p.host is not None}
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
        keep.meta["snapshots"] = len(same)
        stacks = {_python_stack(p) for p in same if p.status == STATUS_OK}
        if len(stacks) > 1:
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
    if drop:
        job.processes[:] = [p for p in job.processes if id(p) not in drop]


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
