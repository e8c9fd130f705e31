"""pystack ``remote PID`` / ``core FILE`` output, with or without ``--native``.

::

    Traceback for thread 12610 (python) [Has the GIL] (most recent call last):
        (C) File "???", line 0, in _start (/usr/bin/python3.11)
        (Python) File "/work/train.py", line 23, in sync_params
            dist.broadcast(params, src=0)
        (C) File "???", line 0, in c10d::Work::wait(std::chrono::duration<long, std::ratio<1l, 1000l> >) (/x/libtorch_cpu.so)

Frames are printed outermost first, as they are stored. A C frame's file is its library's base name
(the source file of a C frame says little about where a hang is), its line is dropped, and
``(inlined)`` and glibc symbol versions (``@@GLIBC_2.34``) are taken off the name. pystack prints
a process's threads newest first, the main thread last: the thread whose stack starts in
``_start``/``<module>`` ends its process, and its thread id is the pid. The ``[...]`` after the thread name (``Has the
GIL``, ``Dropped the GIL``, ``Garbage collecting``) is kept as the thread's state.

    >>> from hangdoc.readers import read_text
    >>> job = read_text('''Traceback for thread 42 (python) [] (most recent call last):
    ...     (Python) File "/w/train.py", line 9, in <module>
    ...         main()
    ...     (Python) File "/w/train.py", line 5, in main
    ...         time.sleep(100)
    ... ''')
    >>> p = job.processes[0]
    >>> (p.pid, [f.function for f in p.main_thread.frames])
    (42, ['<module>', 'main'])
"""

from __future__ import annotations

import os
import re
from typing import List, Optional, Tuple

from hangdoc.bounds import MAX_LINE_NO, MAX_PID, bounded_int
from hangdoc.model import Frame, Process, Thread
from hangdoc.readers._base import BlockParser, FileContext, make_frame

FORMAT = "pystack"

_HEADER_RE = re.compile(r"^Traceback for thread (\d+) \(([^)]*)\) \[([^\]]*)\] \(most recent call last\):\s*$")
_FRAME_RE = re.compile(r'^    \((Python|C)\) File "(.*?)", line (-?\d+|\?\?\?), in (.*)$')
_LIB_RE = re.compile(r"^(.*) \(([^()]*)\)$")
_ENTRY_NATIVE = ("_start", "__libc_start_main", "Py_BytesMain", "Py_RunMain")


def starts(line: str) -> bool:
    return line.startswith("Traceback for thread ") and bool(_HEADER_RE.match(line))


def parse_frame_line(text: str) -> Optional[Frame]:
    m = _FRAME_RE.match(text)
    if not m:
        return None
    kind, file, line, function = m.groups()
    if kind == "Python":
        return make_frame(function, file, bounded_int(line, 0, MAX_LINE_NO))
    lib = ""
    lm = _LIB_RE.match(function)
    if lm:
        function, lib = lm.group(1), os.path.basename(lm.group(2))
    if function.endswith(" (inlined)"):
        function = function[: -len(" (inlined)")]
    at = function.find("@")
    if at > 0 and "@GLIBC" in function:
        function = function[:at]  # pthread_cond_wait@@GLIBC_2.3.2: the symbol version, as py-spy drops it
    return make_frame(function, lib or file, None, native=True)


class PystackParser(BlockParser):
    format = FORMAT
    indent = "    ("

    def __init__(self, ctx: FileContext, lineno: int) -> None:
        super().__init__(ctx, lineno)
        self.processes: List[Process] = []
        self.threads: List[Thread] = []
        self._thread: Optional[Tuple[str, str, str]] = None
        self._raw: List[str] = []
        self.process_start = lineno
        self.notes: List[str] = []

    def feed(self, lineno: int, line: str) -> bool:
        if line.startswith("    "):
            if self._thread is None:
                return False
            if line.startswith("    (") :
                self._raw.append(line)
            return True  # source lines under a Python frame, locals with --locals
        if line.startswith("Traceback for thread "):
            m = _HEADER_RE.match(line)
            if not m:
                return False
            self._end_thread()
            if not self.threads:
                self.process_start = lineno
            self._thread = m.groups()
            self._thread_line = lineno
            self.sink = self._raw
            return True
        if not line.strip():
            return True
        if line.startswith("* ") and self._thread is not None:
            # "* - Unable to merge native stack due to insufficient native information - *":
            # pystack falls back to the Python frames, which follow
            self.notes.append(line.strip("* -"))
            return True
        return False

    def _end_thread(self) -> None:
        if self._thread is None:
            return
        tid, name, state = self._thread
        raw, self._raw, self._thread, self.sink = self._raw, [], None, None
        frames = self.stack_of(raw, parse_frame_line, False, self._thread_line)
        main = bool(frames) and (frames[0].function == "<module>" or (frames[0].native and frames[0].function in _ENTRY_NATIVE))
        t = Thread(ident=tid, name=name or None, frames=frames, state=state or None, is_main=main)
        self.threads.append(t)
        if main:
            self._end_process(bounded_int(tid, 0, MAX_PID))

    def _end_process(self, pid: Optional[int]) -> None:
        if not self.threads:
            return
        p = Process(pid=pid, format=FORMAT, source_line=self.process_start, threads=self.threads)
        if self.notes:
            p.meta["pystack_notes"] = sorted(set(self.notes))
            self.notes = []
        self.processes.append(p)
        self.threads = []

    def close(self) -> List[Process]:
        self._end_thread()
        self._end_process(None)
        return self.processes
