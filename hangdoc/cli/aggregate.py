"""``hangdoc aggregate PATHS...``: read every rank's dumps and records, merge, diagnose, report.

Wires readers → analysis → renderer; holds no logic of its own. Exit status 0 when a report was
produced (parse errors are listed in it), 2 for a usage error or when nothing could be read.

    hangdoc aggregate trace-*.out hangdoc-out/
    hangdoc aggregate dumps/ --format json -o report.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import threading
import time
from typing import Dict, Optional

from hangdoc.cli import UsageError

FORMATS = ("text", "json", "markdown", "html", "dot", "svg")
_BY_SUFFIX = {".json": "json", ".md": "markdown", ".markdown": "markdown", ".html": "html", ".htm": "html", ".dot": "dot", ".gv": "dot", ".svg": "svg", ".txt": "text"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="+", metavar="PATH", help="dump files, record files, globs or directories (searched recursively)")
    parser.add_argument("--format", "-f", choices=FORMATS, default=None, help="output format (default: from -o's suffix, else text)")
    parser.add_argument("-o", "--output", metavar="FILE", help="write the report to FILE (atomically) instead of stdout")
    parser.add_argument("--granularity", choices=("function+line", "function"), default="function+line", help="how frames are compared when grouping (default: function+line)")
    parser.add_argument("--rank-map", metavar="FILE", help="map processes to ranks: JSON {\"host:pid\": rank} or lines 'KEY RANK' (KEY is host:pid or pid)")
    parser.add_argument("--show-plumbing", action="store_true", help="show library plumbing frames (launcher wrappers, torch internals) instead of folding them")
    parser.add_argument("--color", choices=("auto", "always", "never"), default="auto", help="colour the text report (auto: only when stdout is a terminal)")
    parser.add_argument("--max-groups", type=int, default=None, metavar="N", help="groups shown in text/markdown/html (default 20)")


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

    # Hundreds of thousands of small acyclic objects: the cyclic collector would rescan them again
    # and again (measured: grouping 1.6 s -> 0.2 s, rules 5.7 s -> 3.3 s at 131,072 ranks). This is
    # a short-lived command, so the collector stays off until it exits.
    gc.disable()
    umask = _umask()  # read before the progress thread exists: os.umask is process-wide
    progress = Progress()
    try:
        progress.stage(f"reading {len(args.paths)} path{'s' if len(args.paths) != 1 else ''}")
        from hangdoc.readers import read_paths

        def on_file(i: int, n: int, path: str) -> None:
            progress.stage(f"reading file {i + 1}/{n}")

        try:
            job = read_paths(list(args.paths), rank_map=rank_map, progress=on_file if progress.enabled else None)
        except TypeError:  # a readers build without the progress hook
            job = read_paths(list(args.paths), rank_map=rank_map)
        if not job.processes and not job.records:
            errors = job.errors
            first = f"; first: {errors[0]}" if errors else ""
            n = len(job.sources)
            raise UsageError(f"nothing readable in {', '.join(args.paths)} ({n} file{'s' if n != 1 else ''}, {len(errors)} parse error{'s' if len(errors) != 1 else ''}{first})")
        progress.stage(f"analysing {len(job.processes)} processes")
        from hangdoc.analysis import analyse

        report = analyse(job, granularity=args.granularity)
        progress.stage("rendering")
        from hangdoc.renderers import RenderOptions, render

        color = args.color == "always" or (args.color == "auto" and not args.output and _is_tty(sys.stdout) and "NO_COLOR" not in os.environ)
        options = RenderOptions(color=color and fmt == "text", show_plumbing=args.show_plumbing, max_groups=args.max_groups)
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
            # the temporary file was created 0600; a report is an ordinary file, readable as the umask allows
            os.chmod(args.output, 0o666 & ~umask)
        except OSError as e:
            raise UsageError(f"cannot write {args.output}: {e.strerror or e}")
        return 0
    _write_stdout(text)
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
    try:
        with open(path, "rb") as f:
            data = f.read()
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
                out[parts[0]] = int(parts[1])
            elif len(parts) == 3:  # "host pid rank"
                out[f"{parts[0]}:{int(parts[1])}"] = int(parts[2])
            else:
                raise ValueError
        except ValueError:
            raise UsageError(f"{path}:{n}: expected 'KEY RANK' (KEY is host:pid or pid), got {line[:60]!r}")
    return out


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


def _umask() -> int:
    old = os.umask(0o022)
    os.umask(old)
    return old


def _is_tty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _write_stdout(text: str) -> None:
    try:
        try:
            sys.stdout.reconfigure(errors="replace")  # a terminal that cannot show '←' still gets the report
        except (AttributeError, ValueError):
            pass
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        # `hangdoc aggregate ... | head`: the reader is gone, which is fine; keep Python from
        # complaining about the flush at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
