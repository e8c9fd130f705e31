"""py-spy ``dump`` output: plain, ``--native``, ``--locals``, ``--subprocesses``, ``--json``, errors.

Plain text, one process::

    Process 12610: /usr/bin/python -u train.py
    Python v3.11.7 (/usr/bin/python3.11)

    Thread 12610 (idle): "MainThread"
        broadcast (torch/distributed/distributed_c10d.py:3151)
        _exception_logger.<locals>.wrapper (torch/distributed/c10d_logger.py:83)
        main (train.py:43)
        <module> (train.py:48)

Frames are printed innermost first; they are stored outermost first. ``--native`` adds C/C++
frames (``c10d::Work::wait (libtorch_cpu.so)``, ``0x7f18532a3f16 (libc.so.6)``: an address alone
becomes ``??`` so that address-space randomisation does not split groups). ``--locals`` adds
``Arguments:`` / ``Locals:`` blocks under a frame, kept on ``Frame.locals``. ``--subprocesses``
adds ``Parent Process N: ...`` lines (the parent pid is kept) and dashed separators. When py-spy
cannot read a process it prints ``Error: ...`` (with a Rust backtrace when ``RUST_BACKTRACE`` is
set); that process is kept, with status ``unresponsive`` and the error as ``status_detail``.

    >>> from hangdoc.readers import read_text
    >>> job = read_text('''Process 7: python train.py
    ... Python v3.11.7 (/usr/bin/python3.11)
    ...
    ... Thread 7 (active+gil): "MainThread"
    ...     step (train.py:9)
    ...     <module> (train.py:20)
    ... ''')
    >>> p = job.processes[0]
    >>> (p.pid, p.main_thread.state, [f.function for f in p.main_thread.frames])
    (7, 'active+gil', ['<module>', 'step'])
"""

from __future__ import annotations

import json
import re
from typing import Dict, List, Optional, Tuple

from hangdoc.bounds import MAX_LINE_NO, MAX_PID, bounded, bounded_int
from hangdoc.model import STATUS_OK, STATUS_STOPPED, STATUS_UNRESPONSIVE, Frame, Process, Thread
from hangdoc.readers._base import DROPPED, MAX_DEPTH, BlockParser, FileContext, dropped_frame, make_frame, report_squeezed

FORMAT = "py-spy"
FORMAT_JSON = "py-spy-json"

_PROCESS_RE = re.compile(r"^Process (\d+): ?(.*)$")
_PARENT_RE = re.compile(r"^Parent Process (\d+): ?(.*)$")
_THREAD_RE = re.compile(r'^Thread (0x[0-9A-Fa-f]+|\d+) \(([a-z+]*)\)(?:: "(.*)")?\s*$')
_PYTHON_VERSION_RE = re.compile(r"^Python v(\d+\.\d+\S*)")
_ADDRESS_RE = re.compile(r"^0x[0-9a-fA-F]+$")
_ERROR_PID_RE = re.compile(r"Pid\((\d+)\)|\b(?:process|pid) (\d+)\b", re.I)
_GROUP_STOP_RE = re.compile(r"PtraceEvent\(Pid\(\d+\), SIG(?:STOP|TSTP|TTIN|TTOU), 128\)")
_ERROR_PREFIXES = ("Error: ", "error: ")
#: lines after a ``Process`` header that are py-spy's own or a block's start, never more of its argv
_NOT_ARGV = ("Python v", "Thread ", "Process ", "Parent Process ", "Error: ", "error: ", "# hangdoc ", "-" * 20)
#: lines of one command line read on after its ``Process`` header (an argv holding newlines)
MAX_ARGV_LINES = 64
#: characters of a command line kept
MAX_COMMAND = 8192


def _is_python_file(file: str) -> bool:
    return file.endswith(".py") or file.startswith("<")


def parse_frame_line(text: str) -> Optional[Frame]:
    """``function (file:line)`` or ``function (library)`` (already stripped of its indentation)."""
    if not text.endswith(")"):
        return None
    cut = text.rfind(" (")
    if cut <= 0:
        return None
    function, where = text[:cut], text[cut + 2:-1]
    file, line = where, None
    colon = where.rfind(":")
    if colon > 0 and where[colon + 1:].isdigit():
        file, line = where[:colon], bounded_int(where[colon + 1:], 0, MAX_LINE_NO)
    native = not _is_python_file(file)
    if native and _ADDRESS_RE.match(function):
        function = "??"
    return make_frame(function, file, line, native)


def starts(line: str) -> bool:
    """Does ``line`` open a py-spy block?"""
    if line.startswith("Process ") and _PROCESS_RE.match(line):
        return True
    if line.startswith("Thread ") and _THREAD_RE.match(line):
        return True
    # any "Error: ..." may be py-spy's; close() keeps a headerless one only when it reads like py-spy
    return line.startswith(_ERROR_PREFIXES)


# What only py-spy's own error reports say (a log's "Error: failed to load x" must not become an
# unresponsive process).
_PYSPY_ERROR_MARKS = ("Failed to get stack traces", "Failed to suspend process", "python version", "Python version",
                      "Permission Denied", "py_spy::", "py-spy", "Failed to get process executable name",
                      "Failed to find python", "No python processes found")


class PySpyParser(BlockParser):
    """Plain py-spy output: one process, or several back to back (``pgrep | xargs py-spy dump``).

    A ``Process`` line after a complete process starts the next one in the same parser: one
    parser per block of processes rather than one per process (131,072 of them in a big job).
    """

    format = FORMAT
    indent = "    "

    def __init__(self, ctx: FileContext, lineno: int, after_tag: bool = False) -> None:
        super().__init__(ctx, lineno)
        self._done: List[Process] = []
        #: a Process line that ended a dump of that line alone, folded as a repeat (see feed)
        self._rep: Optional[str] = None
        self._start(lineno, after_tag)

    def _start(self, lineno: int, after_tag: bool) -> None:
        #: a tag line came just before: whatever error follows is the dumper's
        self.after_tag = after_tag
        self.process = Process(format=FORMAT, source_line=lineno)
        self.threads: List[Thread] = []
        self._thread: Optional[Tuple[str, Optional[str], Optional[str]]] = None
        self._raw: List[str] = []
        self._seen_header = False
        self._argv_lines = 0
        self._in_error = False
        self._error_lines: List[str] = []
        self._idents: set = set()  # the threads' identifiers so far
        self._thread_text: Optional[str] = None  # the line of the thread being read

    def _again(self, lineno: int) -> bool:
        """A thread identifier came again: the process was dumped again without its header (it
        cannot have two threads of one identifier). The next process begins with the same header;
        True when the one that ended was folded as a repeat (see keep)."""
        head, seen = self.process, self._seen_header
        folded = self._finish()
        self._start(lineno, False)
        p = self.process
        p.pid, p.command, p.ppid = head.pid, head.command, head.ppid
        if "python" in head.meta:
            p.meta["python"] = head.meta["python"]
        self._seen_header = seen
        return folded

    def feed(self, lineno: int, line: str) -> bool:
        if self._seen_header and self._thread is None and not self.threads and not self._in_error \
                and "python" not in self.process.meta and line.strip() and not line.startswith(_NOT_ARGV) \
                and self._argv_lines < MAX_ARGV_LINES:
            # py-spy prints the command line as it is: an argument holding a newline goes on
            # until the "Python v" line (without this, the process would split in two)
            self._argv_lines += 1
            if len(self.process.command) < MAX_COMMAND:
                self.process.command = self.ctx.interner.string((self.process.command + "\n" + line)[:MAX_COMMAND])
            return True
        if line.startswith("    "):
            if self._in_error:
                self._error_lines.append(line.strip())
                return True
            if self._thread is None:
                return False
            self._raw.append(line)
            return True
        if line.startswith("Thread "):
            m = _THREAD_RE.match(line)
            if m:
                if line == self._rep and self._thread_text == line and not self._raw and not self.threads \
                        and not self._in_error:
                    # the thread line again with nothing since: the process of it alone that it would
                    # end is the one just folded again (8 MB of one thread line), counted, not built
                    self.repeat(self._done, lineno)
                    return True
                self._end_thread()
                self._in_error = False
                self._rep = None
                ident, state, name = m.groups()
                if ident in self._idents and self._again(lineno):
                    q = self._done[-1]
                    if (len(q.threads) == 1 and not q.threads[0].frames and q.threads[0].ident == ident
                            and q.threads[0].name == name and q.threads[0].state == (state or None)
                            and q.status == STATUS_OK and not set(q.meta) - {"python"}):
                        self._rep = line
                self._idents.add(ident)
                self._thread_text = line
                self._thread = (ident, name, state or None)
                self._thread_line = lineno
                self.sink = self._raw
                return True
            return False
        if not line.strip():
            self._end_thread()
            return True
        if line.startswith("Process "):
            m = _PROCESS_RE.match(line)
            if not m:
                return False
            if line == self._rep and self._seen_header and not self.threads and self._thread is None \
                    and not self._in_error and not self.process.meta and not self._argv_lines:
                # the header again with nothing since: the dump of it alone that it would end is the
                # one just folded again (8 MB of one Process line), counted without being built
                self.repeat(self._done, lineno)
                return True
            self._rep = None
            folded = False
            if self._seen_header or self.threads or self._thread or self._in_error:
                if self._in_error and not self._seen_header:
                    return False  # a headerless error: close() decides whether it is py-spy's
                # the next process of the same block
                folded = self._finish()
                self._start(lineno, False)
            self._seen_header = True
            self.process.pid = bounded_int(m.group(1), 0, MAX_PID)
            self.process.command = self.ctx.interner.string(m.group(2).strip())
            if folded:
                q = self._done[-1]
                if (not q.threads and q.pid == self.process.pid and q.command == self.process.command
                        and not q.meta and q.ppid is None):
                    self._rep = line
            return True
        if line.startswith("Python v") and self._seen_header and not self.threads:
            m = _PYTHON_VERSION_RE.match(line)
            if m:
                self.process.meta["python"] = self.ctx.interner.string(m.group(1))
            return True
        if line.startswith("Parent Process "):
            m = _PARENT_RE.match(line)
            if m and self._seen_header and not self.threads:
                self.process.ppid = bounded_int(m.group(1), 0, MAX_PID)
                return True
            return False
        if line.startswith("-" * 20) and not line.strip("-"):
            # --subprocesses separates processes with a dashed line: it ends this one
            self._end_thread()
            return True
        if line.startswith(_ERROR_PREFIXES):
            if self.threads or self._thread or self._in_error:
                return False  # py-spy prints one "Error:" per process
            self._in_error = True
            self._error_lines.append(line.strip())
            return True
        if self._in_error:
            # py-spy's error report: "Reason: ...", "Caused by:", "Stack backtrace:", numbered frames
            if line[:1] in (" ", "\t") or line.startswith(("Reason:", "Caused by:", "Stack backtrace:")):
                self._error_lines.append(line.strip())
                return True
            return False
        return False

    def _end_thread(self) -> None:
        if self._thread is None:
            return
        ident, name, state = self._thread
        raw = self._raw
        self._thread, self._raw, self.sink = None, [], None
        if len(raw) >= 128:
            report_squeezed(self.ctx, raw, self._thread_line)
        interner = self.ctx.interner
        frames = interner.stack((FORMAT,) + tuple(raw), lambda: self._build(raw))
        is_main = name == "MainThread"
        self.threads.append(Thread(ident=ident, name=name, frames=frames, state=state, is_main=is_main))

    def _build(self, raw: List[str]) -> Tuple[Frame, ...]:
        frames: List[Frame] = []
        cache = self.ctx.interner.frames
        pending: List[Tuple[str, str]] = []
        section = None
        for text in raw:
            if text[:1] == DROPPED:
                if pending and frames:
                    frames[-1] = _with_locals(frames[-1], pending)
                pending, section = [], None
                frames.append(dropped_frame(int(text[1:])))
                continue
            if text.startswith("        "):
                body = text.strip()
                if text.startswith("            ") and frames and section is not None:
                    name, sep, value = body.partition(": ")
                    if not sep and body.endswith(":"):
                        name, value = body[:-1], ""
                    pending.append((name, value))
                    continue
                if body in ("Arguments:", "Locals:"):
                    section = body
                    continue
                continue  # any other deeper line: py-spy's continuation of a long value
            if pending:
                frames[-1] = _with_locals(frames[-1], pending)
                pending = []
            section = None
            key = text
            f = cache.get(key)
            if f is None and key not in cache:
                f = cache[key] = parse_frame_line(text.strip())
            if f is None:
                self.ctx.error(self._thread_line, f"unreadable py-spy frame line in this thread: {text.strip()[:80]!r}")
                continue
            frames.append(f)
        if pending and frames:
            frames[-1] = _with_locals(frames[-1], pending)
        frames.reverse()
        return tuple(frames)

    def close(self) -> List[Process]:
        self._finish()
        return self._done

    def _finish(self) -> bool:
        """The current process is complete: keep it (or drop it when it is no py-spy output); True
        when it was folded as a repeat of the one before it (see keep)."""
        self._end_thread()
        if not self._seen_header and not self._error_lines and sum(t.name == "MainThread" for t in self.threads) > 1:
            self._split_collapsed()
            return False
        p = self.process
        p.threads = self.threads
        if self._error_lines:
            if not self._seen_header and not self.after_tag:
                text = "\n".join(self._error_lines)
                if not any(m in text for m in _PYSPY_ERROR_MARKS):
                    return False
            p.status = STATUS_UNRESPONSIVE
            p.status_detail = self._error_lines[0]
            p.meta["error"] = "\n".join(self._error_lines[:40])
            if _GROUP_STOP_RE.search(p.meta["error"]):
                # PTRACE_EVENT_STOP (128) with SIGSTOP: ptrace met a process in group-stop, i.e.
                # stopped by SIGSTOP/SIGTSTP (kill -STOP, a debugger, a scheduler's suspend)
                p.status = STATUS_STOPPED
                p.status_detail += "; the process is stopped (ptrace saw a SIGSTOP group-stop)"
            if p.pid is None:
                # --json prints no "Process N:" header; the error may still name the pid
                m = _ERROR_PID_RE.search(p.meta["error"])
                if m:
                    p.pid = bounded_int(next(g for g in m.groups() if g), 0, MAX_PID)
        elif not self.threads:
            if not self._seen_header:
                return False
            p.status = STATUS_UNRESPONSIVE
            p.status_detail = "py-spy printed no threads"
        if p.pid is None and self.threads:
            main = p.main_thread
            if main is not None and main.ident.isdigit():
                p.pid = bounded_int(main.ident, 0, MAX_PID)  # py-spy's thread id is the OS one; the main thread's is the pid
        if p.status == STATUS_OK and self.threads and not any(t.is_main for t in self.threads):
            for t in self.threads:
                if p.pid is not None and t.ident == str(p.pid):
                    t.is_main = True
        return self.keep(self._done, p)

    def _split_collapsed(self) -> None:
        """Several ``Thread N (idle): "MainThread"`` headers and no ``Process`` line: a listing
        someone collapsed by hand, one header per process (a process has one main thread)."""
        pids: Dict[str, Optional[int]] = {}  # each thread id read once (8 MB of one header: 270,000 processes)
        for t in _collapsed(self.threads):
            p = Process(format=FORMAT, source_line=self.process.source_line)
            # a 5,000-digit (or "²") thread id is no pid: int() raised and the block's other
            # processes were lost with it
            pid = pids.get(t.ident, -1)
            if pid == -1:
                pid = pids[t.ident] = bounded_int(t.ident, 0, MAX_PID) if t.ident.isdigit() else None
            p.pid = pid
            p.threads = [Thread(ident=t.ident, name=t.name, frames=t.frames, state=t.state, is_main=True)]
            p.meta["collapsed"] = True
            self._done.append(p)


def _collapsed(threads: List[Thread]) -> List[Thread]:
    """Threads of a hand-collapsed listing, each header with the stack printed under the next
    header that has one (several headers over one stack: every one of them waits there)."""
    out: List[Thread] = []
    pending: List[Thread] = []
    for t in threads:
        if not t.frames:
            pending.append(t)
            continue
        for q in pending:
            out.append(Thread(ident=q.ident, name=q.name, frames=t.frames, state=q.state, is_main=q.is_main))
        pending = []
        out.append(t)
    return out + pending


def _with_locals(frame: Frame, pairs: List[Tuple[str, str]]) -> Frame:
    return Frame(function=frame.function, file=frame.file, line=frame.line, native=frame.native, locals=tuple(pairs))


# --- JSON ---------------------------------------------------------------------------------------

#: a py-spy JSON dump longer than this many lines is not one (a runaway block would eat memory).
MAX_JSON_LINES = 500_000
#: and at most this many characters
MAX_JSON_BYTES = 64 << 20


def starts_json(line: str) -> bool:
    """The first line of a py-spy JSON dump, or of what looks like a broken one (reported, not dropped)."""
    return (line == "[" or line.startswith('[{"pid"') or line.startswith('[ {')
            or line.startswith(('{"pid"', '{"thread_id"', '[{"thread_id"')))


class PySpyJsonParser(BlockParser):
    """``py-spy dump --json``: one JSON array of threads per process, printed over many lines."""

    format = FORMAT_JSON

    def __init__(self, ctx: FileContext, lineno: int) -> None:
        super().__init__(ctx, lineno)
        self.buf: List[str] = []
        self.size = 0
        self.done = False
        self.processes: List[Process] = []

    def feed(self, lineno: int, line: str) -> bool:
        if self.done:
            return False
        self.buf.append(line)
        self.size += len(line) + 1
        if self.size > MAX_JSON_BYTES:
            self.ctx.error(self.start, f"py-spy JSON dump larger than {MAX_JSON_BYTES >> 20} MiB; skipped")
            self.buf = []
            self.done = True
        elif line.rstrip() == "]" or (len(self.buf) == 1 and line.rstrip().endswith(("]", "}"))):
            self._parse(lineno)
            self.done = True
        elif len(self.buf) > MAX_JSON_LINES:
            self.ctx.error(self.start, f"py-spy JSON dump longer than {MAX_JSON_LINES} lines; skipped")
            self.buf = []
            self.done = True
        return True

    def _parse(self, lineno: int) -> None:
        text = "\n".join(self.buf)
        self.buf = []
        try:
            data = json.loads(text)
        except RecursionError:
            self.ctx.error(self.start, "bad py-spy JSON: nested too deeply")
            return
        except ValueError as e:
            self.ctx.error(self.start, f"bad py-spy JSON: {e}")
            return
        if not isinstance(data, list):
            self.ctx.error(self.start, "bad py-spy JSON: not a list of threads")
            return
        p = Process(format=FORMAT_JSON, source_line=self.start)
        interner = self.ctx.interner
        for t in data:
            if not isinstance(t, dict):
                self.ctx.error(self.start, "bad py-spy JSON: a thread is not an object")
                continue
            if p.pid is None:
                p.pid = bounded(t.get("pid"), 0, MAX_PID)
            frames: List[Frame] = []
            tframes = t.get("frames") or ()
            if not isinstance(tframes, list):
                tframes = ()
            cut = 0
            if len(tframes) > MAX_DEPTH:
                keep = MAX_DEPTH // 2
                cut = len(tframes) - 2 * keep
                self.ctx.error(self.start, f"stack deeper than {MAX_DEPTH} frames: {cut} frames in its middle not read "
                                           f"(kept the outermost and innermost {keep})")
                tframes = tframes[:keep] + [None] + tframes[-keep:]
            for fr in tframes:
                if fr is None and cut:
                    frames.append(dropped_frame(cut))
                    continue
                if not isinstance(fr, dict):
                    continue
                name = str(fr.get("name") or "??")
                file = str(fr.get("filename") or fr.get("short_filename") or "")
                line_no = bounded(fr.get("line"), 0, MAX_LINE_NO)
                native = bool(file) and not _is_python_file(file)
                if native and _ADDRESS_RE.match(name):
                    name = "??"
                locs: Tuple[Tuple[str, str], ...] = ()
                if isinstance(fr.get("locals"), list):
                    locs = tuple((str(v.get("name")), str(v.get("repr"))) for v in fr["locals"] if isinstance(v, dict))
                key = ("json", name, file, line_no, native)
                f = interner.frames.get(key)
                if f is None:
                    f = interner.frames[key] = make_frame(name, file, line_no, native)
                frames.append(_with_locals(f, list(locs)) if locs else f)
            frames.reverse()
            fr_t = tuple(frames)
            fr_t = interner.stack(("json",) + tuple((f, f.locals) for f in fr_t), lambda: fr_t)
            active, gil = t.get("active"), t.get("owns_gil")
            state = None if active is None else ("idle" if not active else ("active+gil" if gil else "active"))
            ident = t.get("os_thread_id") or t.get("thread_id") or ""
            name = t.get("thread_name") if isinstance(t.get("thread_name"), str) else None
            p.threads.append(Thread(ident=str(ident), name=name, frames=fr_t, state=state, is_main=name == "MainThread"))
        self.processes.append(p)

    def close(self) -> List[Process]:
        if not self.done and self.buf:
            self.ctx.error(self.start, "py-spy JSON dump cut off (no closing ']')")
        return self.processes
