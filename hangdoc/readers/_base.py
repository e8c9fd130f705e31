"""What every stack reader shares: the line stream, the per-file context, the frame caches.

A dump file is read once, line by line, in binary, so a file of ten million lines costs memory for
one line at a time. The format readers are *push* parsers: the dispatcher in
:mod:`hangdoc.readers` feeds each line to the block parser that is active for the line's channel
(a channel is one prefix such as ``[rank3]:``, so interleaved lines of several processes are taken
apart), and a parser says whether the line was its own. That keeps per-block format detection,
several formats per file and interleaving in one loop.

Speed comes from caches: a raw frame line maps to its :class:`~hangdoc.model.Frame` (the same line
text repeats across thousands of ranks), and a thread's tuple of raw lines maps to one interned
tuple of frames, so identical stacks share one tuple and memory grows with distinct stacks.
"""

from __future__ import annotations

import os
import re
from typing import BinaryIO, Callable, Dict, Iterator, List, Optional, Tuple

from hangdoc.analysis.normalize import normalize_file
from hangdoc.bounds import MAX_PID, MAX_RANK, bounded_int
from hangdoc.model import Frame, ParseError, Process, Source
from hangdoc.safeio import open_input
from hangdoc.textsafe import strip_ansi

#: a line longer than this is cut (and reported once per file): binary garbage has no newlines.
MAX_LINE = 1 << 16
#: bytes of one file read at most; the rest is reported, not read
MAX_FILE = 16 << 30
#: frame lines of one thread kept: the outermost and innermost half each; the middle of a deeper
#: stack (runaway recursion) is dropped and said so (a 1M-frame stack took 20 s and 2.6 GB)
MAX_DEPTH = 2_000
#: and at most this many characters of them (10,000 lines of 64 KiB would be 640 MB)
MAX_STACK_CHARS = 8 << 20
#: what stands for dropped lines in a thread's raw lines: NUL never reaches a reader's line
DROPPED = "\x00"


def _kept(raw: List[str], order: "range") -> int:
    """How many lines from one end of ``raw`` fit in half the depth and half the characters."""
    budget = MAX_STACK_CHARS // 2
    k = 0
    for i in order:
        budget -= len(raw[i])
        if k >= MAX_DEPTH // 2 or budget < 0:
            break
        k += 1
    return max(k, 1)


def squeeze(raw: List[str]) -> List[str]:
    """``raw`` (a thread's frame lines) with its middle replaced by one :data:`DROPPED` marker
    ``"\\x00N"`` when it holds more than :data:`MAX_DEPTH` lines or :data:`MAX_STACK_CHARS`
    characters; in place, and returned.

    >>> r = squeeze([str(i) for i in range(MAX_DEPTH + 10)])
    >>> len(r), r[MAX_DEPTH // 2], dropped(r)
    (2001, '\\x0010', 10)
    """
    n = len(raw)
    if n <= MAX_DEPTH + 1 and (n < 128 or sum(map(len, raw)) <= MAX_STACK_CHARS):
        return raw
    head = _kept(raw, range(n))
    tail = _kept(raw, range(n - 1, -1, -1))
    if head + tail >= n:
        return raw
    count = 0
    for x in raw[head:n - tail]:
        count += int(x[1:]) if x[:1] == DROPPED else 1
    raw[head:n - tail] = [DROPPED + str(count)]
    return raw


def dropped(raw: List[str]) -> int:
    """How many lines :func:`squeeze` dropped from ``raw``."""
    return sum(int(x[1:]) for x in raw if x[:1] == DROPPED)


def dropped_frame(n: int) -> Frame:
    """The frame that stands where ``n`` frame lines of a too deep stack were dropped."""
    return Frame(function=f"<{n} frames not read>", file="", line=None)


def report_squeezed(ctx: "FileContext", raw: List[str], at: int) -> List[str]:
    """:func:`squeeze` ``raw`` and report (once per file) what was dropped, against line ``at``."""
    squeeze(raw)
    n = dropped(raw)
    if n:
        ctx.error(at, f"stack deeper than {MAX_DEPTH} frames or {MAX_STACK_CHARS >> 20} MiB: {n} frame lines in its "
                      f"middle not read (kept {len(raw) - 1} outermost and innermost)")
    return raw


class Interner:
    """Caches shared by all files of one ``read_paths`` call.

    ``stacks`` maps a thread's raw lines (as a tuple of the strings the dump printed, tagged with
    the format) to its tuple of frames: a hit costs one hash of strings whose hashes Python caches,
    and every process with that stack shares the tuple.
    """

    def __init__(self) -> None:
        self.frames: Dict[object, Optional[Frame]] = {}
        self.stacks: Dict[Tuple[object, ...], Tuple[Frame, ...]] = {}
        self.strings: Dict[str, str] = {}
        #: a tag line's text → its fields (shared, never changed)
        self.tags: Dict[str, Dict[str, str]] = {}
        #: (id of a stack, command) → what it says (rank local, role, the stack itself, kept alive
        #: so that its id is not reused)
        self.facts: Dict[Tuple[int, str], Tuple[object, ...]] = {}

    def stack(self, key: Tuple[object, ...], build: Callable[[], Tuple[Frame, ...]]) -> Tuple[Frame, ...]:
        s = self.stacks.get(key)
        if s is None:
            s = self.stacks[key] = build()
        return s

    def string(self, s: str) -> str:
        return self.strings.setdefault(s, s)


def frames_from_lines(ctx: "FileContext", raw: List[str], parse: Callable[[str], Optional[Frame]], reverse: bool,
                      what: str = "", at: int = 0) -> Tuple[Frame, ...]:
    """The frames of a thread's raw frame lines, each line parsed once per ``read_paths`` call.

    ``reverse`` for formats that print the innermost frame first; a line ``parse`` cannot read is
    reported (when ``what`` names the format) against line ``at``, the thread's header.
    """
    cache = ctx.interner.frames
    out: List[Frame] = []
    for text in raw:
        if text[:1] == DROPPED:
            out.append(dropped_frame(int(text[1:])))
            continue
        f = cache.get(text)
        if f is None and text not in cache:
            f = cache[text] = parse(text)
            if f is None and what:
                ctx.error(at, f"unreadable {what} frame line in this thread: {text.strip()[:80]!r}")
        if f is not None:
            out.append(f)
    if reverse:
        out.reverse()
    return tuple(out)


def make_frame(function: str, file: str, line: Optional[int], native: bool = False,
               locals: Tuple[Tuple[str, str], ...] = ()) -> Frame:
    return Frame(function=function, file=normalize_file(file) if file else "", line=line, native=native, locals=locals)


class FileContext:
    """What is known about one file while it is read: where processes go, the identity hints."""

    def __init__(self, path: str, source: Source, interner: Interner) -> None:
        self.path = path
        self.source = source
        self.interner = interner
        self.processes: List[Process] = []
        base = os.path.basename(path)
        self.host_from_name, self.rank_from_name, self.pid_from_name = identity_from_name(base)
        self._errors_seen: Dict[str, int] = {}
        #: the number of the last line when it has no newline (the file was cut off mid-line)
        self.cut_off = 0
        #: distinct problems past MAX_ERRORS, counted, not listed
        self.more_errors = 0

    def error(self, line: int, message: str) -> None:
        # one ParseError per problem: the same message on many lines is reported once, with a count
        # added to the first one at the end of the file (see finish()).
        n = self._errors_seen.get(message)
        if n is not None:
            self._errors_seen[message] = n + 1
            return
        if len(self._errors_seen) >= MAX_ERRORS:
            self.more_errors += 1
            return
        self._errors_seen[message] = 1
        self.source.errors.append(ParseError(self.path, line, message))

    def finish(self) -> None:
        if self.more_errors:
            self.source.errors.append(ParseError(self.path, 0, f"{self.more_errors} more problems (the first {MAX_ERRORS} are listed)"))
            self.more_errors = 0
        repeated = {m: n for m, n in self._errors_seen.items() if n > 1}
        if not repeated:
            return
        for i, e in enumerate(self.source.errors):
            if e.message in repeated:
                self.source.errors[i] = ParseError(e.source, e.line, f"{e.message} (and {repeated[e.message] - 1} more like it)")

    def add(self, process: Process) -> None:
        process.source = self.path
        if process.format and process.format not in self.source.formats:
            self.source.formats.append(process.format)
        self.processes.append(process)


_TRACE_NAME_RE = re.compile(r"^trace-(.+?)\.(?:out|txt|log)$")
# NicerTrace's own trace-{host}-{local_rank}-{pid}.txt (hangdoc.runtime.options.KINDS)
_NICERTRACE_NAME_RE = re.compile(r"^trace-(.+)-(\d+)-(\d+)\.txt$")
_HANGDOC_NAME_RE = re.compile(r"^(?:stacks|trace|collectives|fatal)-(.+)-r(\d+)-(\d+)\.(?:txt|jsonl|out)$")
_RANK_NAME_RE = re.compile(r"(?:^|[^a-z])rank[-_]?(\d+)(?:[^\d]|$)", re.I)


def identity_from_name(base: str) -> Tuple[Optional[str], Optional[int], Optional[int]]:
    """(host, rank, pid) that a file's name says.

    ``stacks-node1-r3-42.txt`` (hangdoc's own) → ``('node1', 3, 42)``; ``trace-node7.out`` (as
    ``srun --output=trace-%N.out`` writes it) → ``('node7', None, None)``; ``stderr-rank2.log`` →
    ``(None, 2, None)``.

    >>> identity_from_name("trace-node7.out")
    ('node7', None, None)
    >>> identity_from_name("stacks-iam01-r12-4242.txt")
    ('iam01', 12, 4242)
    >>> identity_from_name("stderr-rank2.log")
    (None, 2, None)
    >>> identity_from_name("trace-iam01-3-4242.txt")  # NicerTrace's own trace file
    ('iam01', None, 4242)
    """
    m = _HANGDOC_NAME_RE.match(base)
    if m:
        return m.group(1), bounded_int(m.group(2), 0, MAX_RANK), bounded_int(m.group(3), 0, MAX_PID)
    m = _NICERTRACE_NAME_RE.match(base)
    if m:
        return m.group(1), None, bounded_int(m.group(3), 0, MAX_PID)
    m = _TRACE_NAME_RE.match(base)
    if m:
        return m.group(1), None, None
    m = _RANK_NAME_RE.search(base)
    if m:
        return None, bounded_int(m.group(1), 0, MAX_RANK), None
    return None, None, None


#: distinct problems of one file listed; the rest are counted
MAX_ERRORS = 1000

#: bytes read at a time; a file is never held in memory whole.
CHUNK = 1 << 22


def chunks(path: str, ctx: FileContext, fileobj: Optional[BinaryIO] = None,
           skip: Optional[Callable[[bytes], bool]] = None, size: Optional[int] = None) -> Iterator[Tuple[int, List[str]]]:
    """``(number of the first line, lines)`` of a file, decoded a few megabytes at a time.

    ``skip(block)``, when given, is asked about every block of whole lines but the first: a block
    it says True for is counted (its lines keep their numbers) and never decoded. ``size`` is the
    number of bytes read at a time (default :data:`CHUNK`): smaller blocks let ``skip`` pass over more.

    The lines have no newline. Bytes that are not UTF-8 are replaced (U+FFFD) and reported once per
    file, with the first line they occur on; NUL bytes are dropped; lines longer than
    :data:`MAX_LINE` bytes are cut and reported once. When the last line has no newline,
    ``ctx.cut_off`` is its number (a dump that was still being written).
    """
    if fileobj is None:
        try:
            f: BinaryIO = open_input(path)
        except OSError as e:
            ctx.error(0, f"cannot read: {e.strerror or e}")
            return
    else:
        f = fileobj
    state = {"bad_utf8": False, "long": False, "nul": False}
    n = 1
    rest = b""
    total = 0
    with f:
        while True:
            try:
                chunk = f.read(size or CHUNK)
            except OSError as e:
                ctx.error(n, f"read error: {e.strerror or e}")
                return
            if not chunk:
                break
            total += len(chunk)
            if total > MAX_FILE:
                ctx.error(n, f"file larger than {MAX_FILE >> 30} GiB: the rest not read")
                break
            data = rest + chunk if rest else chunk
            cut = data.rfind(b"\n")
            if cut < 0:
                rest = data
                if len(rest) > MAX_LINE:
                    rest = _cut_long(ctx, state, n, rest[:MAX_LINE], f)
                    out = _decode(ctx, state, n, rest)
                    yield n, out
                    n += len(out)
                    rest = b""
                continue
            block, rest = data[:cut], data[cut + 1:]
            if skip is not None and n > 1 and skip(block):
                n += block.count(b"\n") + 1
                continue
            out = _decode(ctx, state, n, block)
            if len(block) > MAX_LINE and max(map(len, out)) > MAX_LINE:
                out = _cut_lines(ctx, state, n, out)
            yield n, out
            n += len(out)
        if rest:
            out = _decode(ctx, state, n, rest)
            if any(len(x) > MAX_LINE for x in out):
                out = _cut_lines(ctx, state, n, out)
            ctx.cut_off = n + len(out) - 1
            yield n, out


def _decode(ctx: FileContext, state: dict, first: int, block: bytes) -> List[str]:
    try:
        text = block.decode("utf-8")
    except UnicodeDecodeError:
        parts = block.split(b"\n")
        out = []
        for i, raw in enumerate(parts):
            try:
                out.append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                out.append(raw.decode("utf-8", "replace"))
                if not state["bad_utf8"]:
                    state["bad_utf8"] = True
                    ctx.error(first + i, "bytes that are not UTF-8 (replaced; first such line)")
        text = "\n".join(out)
    if "\x00" in text:
        if not state["nul"]:
            state["nul"] = True
            at = first + text[:text.index("\x00")].count("\n")
            ctx.error(at, "NUL bytes: a hole (the file was cut or overwritten while being written); read around it")
        text = text.replace("\x00", "")
    if "\x1b" in text or "\x9b" in text:
        text = strip_ansi(text)
    if "\r" not in text:
        return text.split("\n")
    out = text.replace("\r\n", "\n").split("\n")
    if out[-1].endswith("\r"):  # the block was cut at the "\n" of a "\r\n"
        out[-1] = out[-1][:-1]
    return out


def _cut_lines(ctx: FileContext, state: dict, first: int, out: List[str]) -> List[str]:
    for i, x in enumerate(out):
        if len(x) > MAX_LINE:
            out[i] = x[:MAX_LINE]
            if not state["long"]:
                state["long"] = True
                ctx.error(first + i, f"line longer than {MAX_LINE} characters, cut")
    return out


def _cut_long(ctx: FileContext, state: dict, n: int, head: bytes, f: BinaryIO) -> bytes:
    """A line with no newline in sight: keep its head, skip the rest of it."""
    if not state["long"]:
        state["long"] = True
        ctx.error(n, f"line longer than {MAX_LINE} characters, cut")
    while True:
        more = f.readline(CHUNK)
        if not more or more.endswith(b"\n"):
            return head
    return head


def lines(path: str, ctx: FileContext, fileobj: Optional[BinaryIO] = None) -> Iterator[Tuple[int, str]]:
    """``(line number, text)`` one at a time (see :func:`chunks`, which is faster)."""
    for first, block in chunks(path, ctx, fileobj):
        for i, text in enumerate(block, first):
            yield i, text


def same_dump(a: Process, b: Process) -> bool:
    """``b`` is ``a`` dumped again: everything but where it was read is the same, and there is
    something to say it is one process (a pid, thread identifiers) or nothing at all (a header with
    no stack). Two ranks' identical tracebacks in one log name neither: they stay two processes.
    (py-spy or faulthandler dumping one process in a loop into one log; 8 MB of one dump header
    repeated was 160,000 processes.)"""
    # the cheap fields first: the next process of a block nearly always has another pid
    return (a.pid == b.pid and a.format == b.format and a.threads == b.threads and a.command == b.command
            and a.status == b.status and a.status_detail == b.status_detail and a.meta == b.meta
            and a.host == b.host and a.rank == b.rank and a.local_rank == b.local_rank and a.ppid == b.ppid
            and a.role == b.role and a.parent_rank == b.parent_rank
            and (a.pid is not None or any(t.ident for t in a.threads) or not any(t.frames for t in a.threads)))


class BlockParser:
    """A push parser for one block (one or more processes) of one format.

    ``feed`` returns False for a line that is not part of the block (the dispatcher then ends the
    block and looks at the line afresh); ``close`` returns the finished processes.
    """

    format = ""
    #: fast path: while ``sink`` is a list, the dispatcher appends every line that starts with
    #: ``indent`` to it without calling ``feed`` (frame lines are nearly all lines of a dump).
    indent = "\x00"
    sink: Optional[List[str]] = None

    def __init__(self, ctx: FileContext, lineno: int) -> None:
        self.ctx = ctx
        self.start = lineno
        #: id(process) -> the dumps folded into it by :meth:`keep` (the stream adds them up)
        self.repeats: Dict[int, int] = {}

    def keep(self, out: List[Process], p: Process) -> bool:
        """Append ``p`` to ``out``, or fold it into the process before it there when it is that
        process dumped again (:func:`same_dump`): True when folded."""
        if out and same_dump(out[-1], p):
            q = out[-1]
            q.source_line = max(q.source_line, p.source_line)
            self.repeats[id(q)] = self.repeats.get(id(q), 0) + 1
            return True
        out.append(p)
        return False

    def repeat(self, out: List[Process], lineno: int) -> None:
        """One more repeat of ``out[-1]``, read at ``lineno`` (a header repeated, see its callers).
        The parser's state is as it was: the same line next does the same (:meth:`repeat_again`,
        which the stream calls without feeding the line)."""
        q = out[-1]
        q.source_line = lineno
        self.repeats[id(q)] += 1
        self.repeated_at = lineno
        self._repeat_out = out

    #: the line :meth:`repeat` was last called for
    repeated_at = 0

    def repeat_again(self, lineno: int) -> None:
        self.repeat(self._repeat_out, lineno)

    def stack_of(self, raw: List[str], parse: Callable[[str], Optional[Frame]], reverse: bool,
                 at: int) -> Tuple[Frame, ...]:
        """The interned frames of one thread's raw frame lines: equal lists of lines, which most
        threads of a job have, are parsed once; unreadable lines are reported against line ``at``."""
        if len(raw) >= 128:
            report_squeezed(self.ctx, raw, at)
        return self.ctx.interner.stack((self.format,) + tuple(raw),
                                       lambda: frames_from_lines(self.ctx, raw, parse, reverse, self.format, at))

    def feed(self, lineno: int, line: str) -> bool:  # pragma: no cover - interface
        raise NotImplementedError

    def close(self) -> List[Process]:  # pragma: no cover - interface
        raise NotImplementedError


