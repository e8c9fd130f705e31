"""gdb ``thread apply all bt`` and ``thread apply all py-bt`` output (``gdb -p PID -batch -ex "thread apply all bt"``).

::

    Thread 2 (Thread 0x7f46d083e6c0 (LWP 18070) "gloo_tcp_loop"):
    #0  0x00007f1853326f36 in epoll_wait (epfd=6, events=0x7f18, maxevents=64, timeout=10) at ../sysdeps/unix/sysv/linux/epoll_wait.c:30
    #1  0x00007f1844d7d62d in gloo::transport::tcp::Loop::run() () from /x/torch/lib/libtorch_cpu.so

    Thread 1 (Thread 0x7f46f006db80 (LWP 18005) "python"):
    #0  __futex_abstimed_wait_common64 (private=0, ...) at ./nptl/futex-internal.c:57
    ...
    [Inferior 1 (process 18005) detached]

``bt`` frames are C frames (``native``), printed innermost first (stored outermost first). The
function keeps its C++ signature when gdb prints one; the file is the source file (``at
file:line``, with its line) or the library's base name (``from lib.so``). gdb numbers threads
downwards and ends with thread 1, the main thread, whose LWP is the pid; ``[Inferior 1 (process
N) detached]`` names the pid too. gdb's chatter (``[New LWP ...]``, warnings) is skipped.

``py-bt`` (the interpreter's gdb extension, what ``hangdoc dump`` falls back to) prints, under the
same thread lines, ``Traceback (most recent call first):`` and one ``File "f", line N, in func``
per Python frame (its source line under it is skipped), a C function called from Python as
``<built-in method sleep of module object at remote 0x...>`` (a native frame ``sleep``), and
``Unable to locate python frame`` for a thread that runs no Python (no frames).

    >>> from hangdoc.readers import read_text
    >>> job = read_text('''Thread 1 (Thread 0x7f46f006db80 (LWP 18005) "python"):
    ... #0  0x00007f18 in epoll_wait (epfd=6) at ../sysdeps/unix/sysv/linux/epoll_wait.c:30
    ... #1  0x00007f18 in gloo::transport::tcp::Loop::run() () from /x/libtorch_cpu.so
    ... ''')
    >>> p = job.processes[0]
    >>> (p.pid, [f.label() for f in p.main_thread.frames])
    (18005, ['gloo::transport::tcp::Loop::run() (libtorch_cpu.so)', 'epoll_wait (../sysdeps/unix/sysv/linux/epoll_wait.c:30)'])
    >>> job = read_text('''Thread 1 (Thread 0x7f46f006db80 (LWP 18005) "python"):
    ... Traceback (most recent call first):
    ...   <built-in method sleep of module object at remote 0x7f2a21dc7330>
    ...   File "/tmp/train.py", line 5, in step
    ...     time.sleep(1000)
    ...   File "/tmp/train.py", line 9, in <module>
    ...     step()
    ... ''')
    >>> [f.label() for f in job.processes[0].main_thread.frames]
    ['<module> (/tmp/train.py:9)', 'step (/tmp/train.py:5)', 'sleep']
"""

from __future__ import annotations

import os
import re
from typing import List, Optional, Tuple

from hangdoc.bounds import MAX_LINE_NO, MAX_PID, MAX_SEQ, bounded_int
from hangdoc.model import Frame, Process, Thread
from hangdoc.readers._base import BlockParser, FileContext, make_frame

FORMAT = "gdb"

_THREAD_RE = re.compile(r'^Thread (\d+) \((?:Thread (0x[0-9a-fA-F]+) )?\(?LWP (\d+)\)?(?: "(.*)")?\)?:\s*$')
_FRAME_NO_RE = re.compile(r"^#(\d+)\s+(?:0x[0-9a-fA-F]+ in )?(.*)$")
_INFERIOR_RE = re.compile(r"^\[Inferior \d+ \(process (\d+)\) detached\]")
_AT_RE = re.compile(r"^(.*) at (\S+):(\d+)$")
_FROM_RE = re.compile(r"^(.*) from (\S+)$")
# py-bt (CPython's Tools/gdb/libpython.py): frame lines are indented by two spaces, a frame's
# source line under it by four
_PY_HEADER = "Traceback (most recent call first):"
# "(.+?)\s*$" would be quadratic on a line with a long run of spaces: the name is stripped instead
_PY_FILE_RE = re.compile(r'^  File "(.*)", line (\d+), in (.+)$')
_PY_BUILTIN_RE = re.compile(r"^  <built-in (?:method|function) ([^\s>]+)")
# what py-bt and gdb's Python print for what they cannot show: no frame of ours
_PY_NOTES = ("Unable to locate python frame", "Python Exception ", "Error occurred in Python")


def starts(line: str) -> bool:
    return line.startswith("Thread ") and "LWP" in line and bool(_THREAD_RE.match(line))


def _strip_args(text: str) -> str:
    """``func (a=1, b=(x)) `` → ``func``: drop the last balanced parenthesised group."""
    text = text.rstrip()
    if not text.endswith(")"):
        return text
    depth = 0
    for i in range(len(text) - 1, -1, -1):
        c = text[i]
        if c == ")":
            depth += 1
        elif c == "(":
            depth -= 1
            if depth == 0:
                return text[:i].rstrip() or text
    return text


def parse_frame_line(text: str) -> Optional[Frame]:
    """One frame line of ``bt`` (``#3  0x... in func (args) at file:line``) or of ``py-bt``."""
    if not text.startswith("#"):
        return _parse_py_line(text)
    m = _FRAME_NO_RE.match(text)
    if not m:
        return None
    rest = m.group(2)
    file, line = "", None
    am = _AT_RE.match(rest)
    if am:
        rest, file, line = am.group(1), am.group(2), bounded_int(am.group(3), 0, MAX_LINE_NO)
    else:
        fm = _FROM_RE.match(rest)
        if fm:
            rest, file = fm.group(1), os.path.basename(fm.group(2))
    function = _strip_args(rest)
    return make_frame(function, file, line, native=True)


def _parse_py_line(text: str) -> Optional[Frame]:
    m = _PY_FILE_RE.match(text)
    if m:
        return make_frame(m.group(3).rstrip() or m.group(3), m.group(1), bounded_int(m.group(2), 0, MAX_LINE_NO))
    m = _PY_BUILTIN_RE.match(text)
    if m:
        return make_frame(m.group(1), "", None, native=True)
    return None


class GdbParser(BlockParser):
    format = FORMAT
    indent = "#"

    def __init__(self, ctx: FileContext, lineno: int) -> None:
        super().__init__(ctx, lineno)
        self.processes: List[Process] = []
        self.threads: List[Thread] = []
        self._thread: Optional[Tuple[str, str, Optional[str]]] = None
        self._raw: List[str] = []
        self.process_start = lineno
        self.last_number: Optional[int] = None
        #: the current thread is py-bt's (``Traceback (most recent call first):`` seen)
        self._py = False
        #: a thread line that ended a process of that thread alone, folded as a repeat (see feed)
        self._rep: Optional[str] = None
        self._thread_text: Optional[str] = None

    def feed(self, lineno: int, line: str) -> bool:
        if line.startswith("#"):
            if self._thread is None:
                return False
            self._raw.append(line)
            return True
        if self._py and line.startswith("  "):
            if line.startswith(("  File ", "  <built-in ")):
                self._raw.append(line)
            # else a frame's source line (four spaces), or py-bt's notes:
            # "(frame information optimized out)", "Waiting for the GIL", "Garbage-collecting"
            return True
        if line.startswith("Thread "):
            m = _THREAD_RE.match(line)
            if not m:
                return False
            if line == self._rep and self._thread_text == line and not self._raw and not self.threads \
                    and not self._py:
                # the thread line again with nothing since: the process of it alone that it would end
                # is the one just folded again (8 MB of one thread line), counted, not built
                self.repeat(self.processes, lineno)
                return True
            self._end_thread()
            self._rep = None
            number = bounded_int(m.group(1), 0, MAX_SEQ)
            if number is None:
                return False
            if self.last_number is not None and number >= self.last_number:
                if self._end_process(None):  # numbering starts again: another process
                    q = self.processes[-1]
                    if (len(q.threads) == 1 and not q.threads[0].frames and q.threads[0].ident == m.group(3)
                            and q.threads[0].name == m.group(4) and q.threads[0].is_main == (m.group(1) == "1")):
                        self._rep = line
            if not self.threads:
                self.process_start = lineno
            self.last_number = number
            self._thread_text = line
            self._thread = (m.group(1), m.group(3), m.group(4))
            self._thread_line = lineno
            self.sink = self._raw
            return True
        if line.startswith("[Inferior "):
            m = _INFERIOR_RE.match(line)
            self._end_thread()
            self._end_process(bounded_int(m.group(1), 0, MAX_PID) if m else None)
            return True
        if not line.strip():
            self._end_thread()
            return True
        if self._thread is not None and line == _PY_HEADER:
            self._py = True
            return True
        if self._thread is not None and line.startswith(_PY_NOTES):
            return True
        if line.startswith(("    ", "\t")) and self._thread is not None:
            return True  # a wrapped argument list
        return False

    def _end_thread(self) -> None:
        if self._thread is None:
            return
        number, lwp, name = self._thread
        raw, self._raw, self._thread, self.sink, self._py = self._raw, [], None, None, False
        frames = self.stack_of(raw, parse_frame_line, True, self._thread_line)
        # gdb lines carry addresses and argument values that differ from process to process:
        # intern by the frames themselves too, so equal stacks still share one tuple
        frames = self.ctx.interner.stacks.setdefault(("gdb-frames",) + frames, frames)
        self.threads.append(Thread(ident=lwp, name=name, frames=frames, is_main=number == "1"))

    def _end_process(self, pid: Optional[int]) -> bool:
        """The process read so far is complete; True when it was folded as a repeat (see keep)."""
        self.last_number = None
        if not self.threads:
            return False
        if pid is None:
            main = next((t for t in self.threads if t.is_main), None)
            pid = bounded_int(main.ident, 0, MAX_PID) if main is not None else None
        p = Process(pid=pid, format=FORMAT, source_line=self.process_start, threads=self.threads)
        self.threads = []
        return self.keep(self.processes, p)

    def close(self) -> List[Process]:
        self._end_thread()
        self._end_process(None)
        return self.processes
