"""``hangdoc aggregate PATHS...``: read every rank's dumps and records, merge, diagnose, report.

Wires readers → analysis → renderer. The one piece of its own is :class:`ParallelRead`, which
splits the reading of large inputs over two processes (the report is the same either way). Exit
status 0 when a report was produced (parse errors are listed in it), 2 for a usage error or when
nothing could be read.

    hangdoc aggregate trace-*.out hangdoc-out/
    hangdoc aggregate dumps/ --format json -o report.json
"""

from __future__ import annotations

import argparse
import gc
import json
import operator
import os
import sys
import threading
import time
from typing import Dict, List, Optional, Tuple

from hangdoc.bounds import MAX_PID, MAX_RANK, bounded_int
from hangdoc.cli import UsageError, write_stdout

FORMATS = ("text", "json", "markdown", "html", "dot", "svg")
_BY_SUFFIX = {".json": "json", ".md": "markdown", ".markdown": "markdown", ".html": "html", ".htm": "html", ".dot": "dot", ".gv": "dot", ".svg": "svg", ".txt": "text"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="+", metavar="PATH", help="dump files, record files, globs or directories (searched recursively)")
    parser.add_argument("--format", "-f", choices=FORMATS, default=None, help="output format (default: from -o's suffix, else text)")
    parser.add_argument("-o", "--output", metavar="FILE", help="write the report to FILE (atomically) instead of stdout")
    parser.add_argument("--granularity", choices=("function+line", "function"), default="function+line", help="how frames are compared when grouping (default: function+line)")
    parser.add_argument("--rank-map", metavar="FILE", help="map processes to ranks: JSON {\"host:pid\": rank} or lines 'KEY RANK' (KEY is host:pid or pid)")
    parser.add_argument("-v", "--verbose", action="store_true", help="every evidence line of the verdict (text, markdown, html); the default shows the few that prove it, JSON has all")
    parser.add_argument("--show-plumbing", action="store_true", help="show library plumbing frames (launcher wrappers, torch internals) instead of folding them")
    parser.add_argument("--color", choices=("auto", "always", "never"), default="auto", help="colour the text report (auto: only when stdout is a terminal)")
    parser.add_argument("--max-groups", type=int, default=None, metavar="N", help="groups shown in text, markdown and html (JSON has all)")
    parser.add_argument("--jobs", "-j", type=int, default=None, metavar="N", help="processes reading the files (default: 2 for inputs over 8 MB when 2 CPUs are available, else 1)")


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except (UsageError, KeyboardInterrupt):
        raise
    except Exception as e:  # a bug in hangdoc: one line, not a traceback, unless asked for
        if os.environ.get("HANGDOC_DEBUG"):
            raise
        print(f"hangdoc aggregate: internal error: {type(e).__name__}: {e} (HANGDOC_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    fmt = args.format or _BY_SUFFIX.get(os.path.splitext(args.output or "")[1].lower(), "text")
    rank_map = read_rank_map(args.rank_map) if args.rank_map else None
    if args.max_groups is not None and args.max_groups < 1:
        raise UsageError("--max-groups must be at least 1")
    if args.jobs is not None and args.jobs < 1:
        raise UsageError("--jobs must be at least 1")

    # Hundreds of thousands of small acyclic objects: the cyclic collector would rescan them again
    # and again (measured: grouping 1.6 s -> 0.2 s, rules 5.7 s -> 3.3 s at 131,072 ranks). This is
    # a short-lived command, so the collector stays off until it exits.
    gc.disable()
    # the helper process is forked before any thread of ours exists (fork + threads can deadlock)
    reader = ParallelRead.start(list(args.paths), rank_map, args.jobs)
    progress = Progress()
    try:
        progress.stage(f"reading {len(args.paths)} path{'s' if len(args.paths) != 1 else ''}")

        def on_file(i: int, n: int, path: str) -> None:
            progress.stage(f"reading file {i + 1}/{n}")

        job = reader.finish(on_file if progress.enabled else None)
        if not job.processes and not job.records and not job.events:
            errors = job.errors
            first = f"; first: {errors[0]}" if errors else ""
            n = len(job.sources)
            raise UsageError(f"nothing readable in {', '.join(args.paths)} ({n} file{'s' if n != 1 else ''}, {len(errors)} parse error{'s' if len(errors) != 1 else ''}{first})")
        _warn_unread(job)
        progress.stage(f"analysing {len(job.processes)} processes")
        from hangdoc.analysis import analyse

        report = analyse(job, granularity=args.granularity)
        progress.stage("rendering")
        from hangdoc.renderers import RenderOptions, render

        color = args.color == "always" or (args.color == "auto" and not args.output and _is_tty(sys.stdout) and "NO_COLOR" not in os.environ)
        options = RenderOptions(color=color and fmt == "text", show_plumbing=args.show_plumbing, max_groups=args.max_groups,
                                verbose=args.verbose)
        try:
            text = render(report, fmt, options)
        except ImportError as e:
            raise UsageError(f"format {fmt!r} is not available in this build ({e})")
    finally:
        progress.done()

    if args.output:
        from hangdoc.atomic import write_atomic

        try:
            write_atomic(args.output, text)
        except OSError as e:
            raise UsageError(f"cannot write {args.output}: {e.strerror or e}")
        return 0
    write_stdout(text)
    return 0


def read_rank_map(path: str) -> Dict[str, int]:
    """A rank map file: a JSON object ``{"host:pid": rank}`` (values may also be ``{"rank": R, ...}``,
    as in a fixture's ``truth.json``) or lines ``KEY RANK`` / ``HOST PID RANK``.

        >>> import tempfile
        >>> p = tempfile.mktemp()
        >>> _ = open(p, "w").write("# host:pid rank\\nnode1:42 0\\n43 1\\n")
        >>> read_rank_map(p)
        {'node1:42': 0, '43': 1}
    """
    from hangdoc.safeio import open_input, read_bounded

    try:
        with open_input(path) as f:  # a regular file only: a FIFO or a device would block or never end
            data = read_bounded(f, 256 << 20, "rank map")
    except OSError as e:
        raise UsageError(f"--rank-map {path}: {e.strerror or e}")
    text = data.decode("utf-8", "replace")
    if text.lstrip().startswith("{"):
        from hangdoc.readers import normalize_rank_map

        try:
            doc = json.loads(text)
            if not isinstance(doc, dict):
                raise ValueError("not an object")
            return normalize_rank_map(doc)
        except ValueError as e:
            raise UsageError(f"{path}:1: not a JSON object of KEY: RANK ({e})")
    out: Dict[str, int] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.replace("=", " ").replace(",", " ").split()
        try:
            if len(parts) == 2:
                key, rank = parts[0], bounded_int(parts[1], 0, MAX_RANK)
            elif len(parts) == 3:  # "host pid rank"
                pid = bounded_int(parts[1], 0, MAX_PID)
                key, rank = f"{parts[0]}:{pid}", bounded_int(parts[2], 0, MAX_RANK)
                if pid is None:
                    raise ValueError
            else:
                raise ValueError
            if rank is None:
                raise ValueError
            if key in out and out[key] != rank:
                raise UsageError(f"{path}:{n}: {key} is given rank {rank} here and rank {out[key]} before")
            out[key] = rank
        except ValueError:
            raise UsageError(f"{path}:{n}: expected 'KEY RANK' (KEY is host:pid or pid), got {line[:60]!r}")
    return out


#: below this many bytes of input a second reading process costs more than it saves (measured:
#: 3.6 MB / 8,192 ranks read in 0.3 s, where forking and shipping the results back break even).
PARALLEL_MIN_BYTES = 8 << 20
#: a helper's share of the bytes relative to this process's (it also encodes its answer).
HELPER_WEIGHT = 0.85


class ParallelRead:
    """Read the files in ``jobs`` processes: this one and forked helpers, each a share of the files.

    Each helper reads its files with the readers' own ``read_file`` and sends back its processes,
    sources and records as plain tuples (``marshal``: an order of magnitude cheaper than pickling
    dataclasses); this process rebuilds them, sharing one tuple per distinct stack, and runs the
    cross-file identity step (``finish_job``: rank map, worker → rank ties, world size) on the
    whole job, so the result equals ``read_paths``. A helper that fails in any way only means its
    files are read here after all. Without ``fork`` (or with one job) this is ``read_paths``.
    """

    def __init__(self, paths: List[str], rank_map: Optional[Dict[str, int]]) -> None:
        self.paths = paths
        self.rank_map = rank_map
        self.files: List = []
        self.helpers: List[Tuple[int, int, List]] = []  # (pid, read end of the pipe, its files)

    @classmethod
    def start(cls, paths: List[str], rank_map: Optional[Dict[str, int]], jobs: Optional[int]) -> "ParallelRead":
        self = cls(paths, rank_map)
        if jobs == 1 or not hasattr(os, "fork"):
            return self
        try:
            from hangdoc.readers import expand_paths

            files = expand_paths(paths)
        except Exception:
            return self
        if jobs is None:
            jobs = 2 if _free_cpus() >= 2 and _total_bytes(files) >= PARALLEL_MIN_BYTES else 1
        jobs = min(jobs, len(files))
        if jobs < 2:
            return self
        self.files = files
        # contiguous shares by bytes, so the merged order is the sequential order; a helper's share
        # is smaller by what encoding its answer costs (measured: ~18% of reading it), so that
        # both finish together
        sizes = [_size(f[0]) for f in files]
        weights = [1.0] + [HELPER_WEIGHT] * (jobs - 1)
        bounds, acc = [], 0.0
        for wgt in weights:
            acc += wgt
            bounds.append(acc / sum(weights) * (sum(sizes) or 1))
        shares: List[List] = [[] for _ in range(jobs)]
        done, k = 0, 0
        for f, n in zip(files, sizes):
            while k < jobs - 1 and done >= bounds[k]:
                k += 1
            shares[k].append(f)
            done += n
        self.mine = shares[0]
        for share in shares[1:]:
            if not share:
                continue
            r, w = os.pipe()
            try:
                pid = os.fork()
            except OSError:
                os.close(r)
                os.close(w)
                self.mine = self.mine + share
                continue
            if pid == 0:  # the helper: read, send, leave without running any of the parent's cleanup
                code = 1
                try:
                    os.close(r)
                    from hangdoc.readers import read_files

                    data = _encode(read_files(share))
                    with os.fdopen(w, "wb") as out:
                        out.write(data)
                    code = 0
                finally:
                    os._exit(code)
            os.close(w)
            self.helpers.append((pid, r, share))
        return self

    def finish(self, progress=None):
        from hangdoc.readers import read_paths

        if not self.files:
            try:
                return read_paths(list(self.paths), rank_map=self.rank_map, progress=progress)
            except TypeError:  # a readers build without the progress hook
                return read_paths(list(self.paths), rank_map=self.rank_map)
        from hangdoc.readers import finish_job, read_files

        try:
            job = read_files(self.mine, progress, len(self.files))
            stacks: Dict[tuple, tuple] = {}
            for pid, r, share in self.helpers:
                data = _read_all(r)
                _, status = os.waitpid(pid, 0)
                decoded = False
                if status == 0 and data:
                    try:
                        _decode(data, job, stacks)
                        decoded = True
                    except Exception:  # a helper's garbled answer: read its files here instead
                        pass
                if not decoded:
                    more = read_files(share)
                    job.processes.extend(more.processes)
                    job.sources.extend(more.sources)
                    job.records.extend(more.records)
                    job.events.extend(more.events)
            self.helpers = []
        finally:
            for pid, r, _ in self.helpers:  # interrupted: leave no helper behind
                try:
                    os.kill(pid, 9)
                    os.waitpid(pid, 0)
                    os.close(r)
                except OSError:
                    pass
        finish_job(job, self.rank_map)
        return job


#: unreadable files named one by one on stderr before the rest are counted
MAX_WARNINGS = 20


def _warn_unread(job) -> None:
    """A file that could not be read at all (missing, unreadable, not a file, nothing in it) among
    good ones is said on stderr at once, not only counted at the end of the report."""
    bad = [e for s in job.sources for e in s.errors[:1] if (e.line == 0 or not (s.processes or s.records or s.events))
           and s.path != "rank map"]
    for e in bad[:MAX_WARNINGS]:
        where = f"{e}" if e.source != "evidence" else e.message  # a note on the whole evidence, not a file
        print(f"hangdoc aggregate: warning: {where}", file=sys.stderr)
    if len(bad) > MAX_WARNINGS:
        print(f"hangdoc aggregate: warning: … and {len(bad) - MAX_WARNINGS} more files not read", file=sys.stderr)


def _process_fields() -> List[str]:
    from dataclasses import fields

    from hangdoc.model import Process

    return [f.name for f in fields(Process)]


def _encode(job) -> bytes:
    import marshal

    names = _process_fields()
    ids: Dict[int, int] = {}
    table: List[tuple] = []

    def stack(frames) -> int:
        k = ids.get(id(frames))
        if k is None:
            k = ids[id(frames)] = len(table)
            table.append(tuple((f.function, f.file, f.line, f.native, f.locals) for f in frames))
        return k

    ti = names.index("threads")
    fields_of = operator.attrgetter(*names)  # one C call per process instead of 15 getattr
    procs = []
    for p in job.processes:
        row = fields_of(p)
        procs.append(row[:ti] + (tuple((t.ident, t.name, stack(t.frames), t.state, t.is_main) for t in p.threads),) + row[ti + 1:])
    sources = [(s.path, s.processes, s.records, list(s.formats), [(e.source, e.line, e.message) for e in s.errors],
                s.events, s.truncated) for s in job.sources]
    records = [r.to_json() for r in job.records]
    events = [e.to_json() for e in job.events]
    return marshal.dumps((tuple(names), table, procs, sources, records, events))


def _decode(data: bytes, job, stacks: Dict[tuple, tuple]) -> None:
    import marshal

    from hangdoc.model import CollectiveRecord, Frame, LogEvent, ParseError, Process, Source, Thread

    names, table, procs, sources, records, events = marshal.loads(data)
    if list(names) != _process_fields():
        raise ValueError("helper and parent disagree on the model")
    frames = []
    for raw in table:
        st = stacks.get(raw)
        if st is None:
            st = stacks[raw] = tuple(Frame(*f) for f in raw)
        frames.append(st)
    ti = names.index("threads")
    out = []
    for row in procs:
        row = list(row)
        row[ti] = [Thread(i, n, frames[k], s, m) for i, n, k, s, m in row[ti]]
        out.append(Process(*row))
    job.processes.extend(out)
    job.sources.extend(Source(path, n, r, list(fm), [ParseError(*e) for e in errs], events=ne, truncated=cut)
                       for path, n, r, fm, errs, ne, cut in sources)
    job.records.extend(CollectiveRecord.from_json(d) for d in records)
    job.events.extend(LogEvent(**d) for d in events)


def _read_all(fd: int) -> bytes:
    with os.fdopen(fd, "rb") as f:
        return f.read()


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _total_bytes(files) -> int:
    total = 0
    for path, _ in files:
        total += _size(path)
        if total >= PARALLEL_MIN_BYTES:
            break
    return total


def _free_cpus() -> int:
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return n


class Progress:
    """Stage names on stderr, only on a terminal and only once the run has taken over a second."""

    def __init__(self, after: float = 1.0) -> None:
        self.enabled = _is_tty(sys.stderr)
        self.start = time.monotonic()
        self.after = after
        self.current = ""
        self.shown = False
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        if self.enabled:
            self._thread = threading.Thread(target=self._loop, name="hangdoc-progress", daemon=True)
            self._thread.start()

    def stage(self, name: str) -> None:
        self.current = name

    def _loop(self) -> None:
        while not self._stop.wait(0.25):
            elapsed = time.monotonic() - self.start
            if elapsed >= self.after:
                try:
                    sys.stderr.write(f"\r\033[Khangdoc: {self.current}… {elapsed:.1f} s")
                    sys.stderr.flush()
                    self.shown = True
                except (OSError, ValueError):
                    return

    def done(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(1.0)
        if self.shown:
            try:
                sys.stderr.write("\r\033[K")
                sys.stderr.flush()
            except (OSError, ValueError):
                pass


def _is_tty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
