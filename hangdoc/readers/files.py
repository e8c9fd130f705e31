"""Files, globs and directories: which files are evidence, and reading each into the job.

A file named on the command line is always read; a file met in a directory walk or a glob is read
when its name says it is a dump (``trace-*.out``, ``stacks-*-r*-*.txt``, Flight Recorder's) or its
head holds a marker of some format. Record files go to their readers (:mod:`records`,
:mod:`flight_recorder`), everything else through :func:`hangdoc.readers.stream.read_stream`.
"""

from __future__ import annotations

import fnmatch
import gc
import glob
import importlib
import io
import os
import re
from contextlib import contextmanager
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple

from hangdoc.model import CollectiveRecord, Job, ParseError, Source
from hangdoc.readers._base import Interner
from hangdoc.readers.merge import finish_job
from hangdoc.readers.registry import markers_re
from hangdoc.readers.stream import read_stream
from hangdoc.safeio import drop_nul_runs, open_input, sniff_head
from hangdoc.textsafe import strip_ansi_bytes

__all__ = ["read_paths", "read_files", "read_file", "read_text", "expand_paths", "gc_paused"]


def _optional(module: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


HEAD_BYTES = 1 << 16

# A file found by walking a directory is read only when its head holds a marker of some format
# (a stack dump's first line, a log reader's keyword); a file named on the command line is always read.
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


def _name_re(*patterns: str) -> Callable[[str], bool]:
    """``fnmatch.fnmatch(name, p)`` for any of ``patterns``, as one pattern compiled once (it ran
    six times a file: 16,384 files at 131,072 ranks)."""
    match = re.compile("|".join(f"(?:{fnmatch.translate(os.path.normcase(p))})" for p in patterns)).match
    return lambda name: match(os.path.normcase(name)) is not None


_is_dump_name = _name_re(*_DUMP_NAMES)
_is_records_name = _name_re("collectives-*.jsonl")
_is_fr_name = _name_re("nccl_trace_rank_*", "fr_trace*")

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


def read_file(path: str, named: bool, job: Job, interner: Interner) -> Optional[Source]:
    """Read one file into ``job``; None when a walked file is not a dump (skipped quietly)."""
    source = Source(path)
    base = os.path.basename(path)
    follow = named  # a file met in a directory walk is never read through a symbolic link
    named = named or _is_dump_name(base)
    # opened once: its head says what it is, and a stream reads on from its start
    try:
        f = open_input(path, follow=follow)
    except OSError as e:
        if not named:
            return None
        source.errors.append(ParseError(path, 0, f"cannot read: {e.strerror or e}"))
        return source
    try:
        try:
            head = sniff_head(f, HEAD_BYTES)
        except OSError as e:
            if not named:
                return None
            source.errors.append(ParseError(path, 0, f"cannot read: {e.strerror or e}"))
            return source
        return _read_opened(path, named, follow, source, head, f, job, interner)
    finally:
        f.close()  # read_stream closed it already; the other readers open the file themselves


def _read_opened(path: str, named: bool, follow: bool, source: Source, head: bytes, f, job: Job,
                 interner: Interner) -> Optional[Source]:
    base = os.path.basename(path)
    # colour codes and NUL holes (a file cut while written) say nothing about what a file is
    clean = strip_ansi_bytes(drop_nul_runs(head))
    records = _optional("hangdoc.readers.records")
    if records is not None and (_is_records_name(base) or records.looks_like(path, head)):
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
        if is_fr or _is_fr_name(base):
            recs = _call_reader(fr, path, source, follow)
            source.records = len(recs)
            source.formats.append(getattr(fr, "FORMAT", "flight-recorder"))
            job.records.extend(recs)
            return source
    marked = markers_re().search(clean) is not None
    if not named:
        if base.endswith(_SKIP_SUFFIXES) or base in _OWN_OUTPUTS or b"\x00" in clean[:4096] or not marked:
            return None
    elif b"\x00" in clean[:4096] and not marked:
        source.errors.append(ParseError(path, 1, "binary file, not a stack dump or a log; skipped"))
        return source
    # sniff_head left f at its start; a head read from there (not past a hole of NULs) is the
    # stream's first bytes, which its prefixes are learnt from
    procs, events = read_stream(path, source, interner, f, head if head[:1] != b"\x00" else None)
    # a world size alone (a torchrun command line) is context for other files, no evidence of a hang
    evidence = any(e.kind not in _CONTEXT_EVENTS for e in events)
    if not procs and not evidence and not named:
        return None  # a walked file that only looked like evidence (a log that mentions "Thread ")
    source.processes = len(procs)
    job.processes.extend(procs)
    job.events.extend(events)
    if not procs and not evidence:
        source.errors.append(ParseError(path, 1 if head else 0,
                                        "no stack dump or log event found" if head else "empty file"))
    return source


#: log events that describe the job rather than a hang (world_log's)
_CONTEXT_EVENTS = ("world-size",)


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
    procs, events = read_stream(name, source, Interner(), io.BytesIO(text.encode("utf-8", "surrogateescape")))
    source.processes = len(procs)
    job.processes.extend(procs)
    job.events.extend(events)
    job.sources.append(source)
    finish_job(job, rank_map)
    return job
