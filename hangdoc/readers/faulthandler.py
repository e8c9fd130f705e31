"""Python's ``faulthandler`` output (``faulthandler.dump_traceback``, ``register(signum)``, fatal errors).

::

    Thread 0x00007f2d4713b6c0 (most recent call first):
      File "/work/train.py", line 44 in metrics_flusher
      File "/usr/lib/python3.11/threading.py", line 982 in run

    Current thread 0x00007f2d6808cb80 (most recent call first):
      File "/work/train.py", line 60 in main
      File "/work/train.py", line 67 in <module>

One process is a run of thread blocks; a process ends at a line that belongs to none, or where a
thread identifier repeats (a forked DataLoader worker inherits its rank's thread identifier and
often writes to the same stderr, right after it). ``Stack (most recent call first):`` (one thread,
``all_threads=False``) and ``Fatal Python error: ...`` headers are understood, ``  ...`` (more
frames than faulthandler prints) marks the thread truncated, ``  <no Python frame>`` gives an
empty stack. faulthandler names no process: pid, rank and host come from a tag line, the file's
name or a rank map. The main thread is the one whose outermost frame is ``<module>``, else the
last one printed (faulthandler prints the newest thread first).

    >>> from hangdoc.readers import read_text
    >>> job = read_text('''Current thread 0x00007f2d6808cb80 (most recent call first):
    ...   File "/usr/lib/python3.11/selectors.py", line 415 in select
    ...   File "/home/u/train.py", line 60 in main
    ... ''')
    >>> [f.label() for f in job.processes[0].main_thread.frames]
    ['main (~/train.py:60)', 'select (selectors.py:415)']
"""

from __future__ import annotations

import re
from typing import List, Optional, Tuple

from hangdoc.bounds import MAX_LINE_NO, bounded_int
from hangdoc.model import STATUS_TRUNCATED, Frame, Process, Thread
from hangdoc.readers._base import BlockParser, FileContext, make_frame

FORMAT = "faulthandler"

_HEADER_RE = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+) \(most recent call first\):\s*$")
_STACK_HEADER = "Stack (most recent call first):"
_FRAME_RE = re.compile(r'^  File "(.*)", line (\d+|\?\?\?) in (.*)$')
_FATAL = "Fatal Python error: "


def starts(line: str) -> bool:
    if line.startswith(("Thread 0x", "Current thread 0x")):
        return bool(_HEADER_RE.match(line))
    return line.startswith(_STACK_HEADER) or line.startswith(_FATAL)


def parse_frame_line(text: str) -> Optional[Frame]:
    m = _FRAME_RE.match(text)
    if not m:
        return None
    line = bounded_int(m.group(2), 0, MAX_LINE_NO)
    return make_frame(m.group(3), m.group(1), line)


class FaulthandlerParser(BlockParser):
    format = FORMAT
    indent = '  File "'

    def __init__(self, ctx: FileContext, lineno: int) -> None:
        super().__init__(ctx, lineno)
        self.processes: List[Process] = []
        self._new_process(lineno)
        self._thread: Optional[Tuple[str, bool]] = None
        self._raw: List[str] = []
        self._truncated = False
        #: a header line that ended a dump of that header alone, folded as a repeat (see feed)
        self._rep: Optional[str] = None

    def _new_process(self, lineno: int) -> None:
        self.process = Process(format=FORMAT, source_line=lineno)
        self.threads: List[Thread] = []
        self.idents: set = set()
        self.has_current = False

    def feed(self, lineno: int, line: str) -> bool:
        if line.startswith("  "):
            if self._thread is None:
                return False
            if line.startswith('  File "'):
                self._raw.append(line)
                return True
            stripped = line.strip()
            if stripped == "...":
                self._truncated = True
                return True
            if stripped == "<no Python frame>":
                return True
            return False
        if not line.strip():
            self._end_thread()
            return True
        m = _HEADER_RE.match(line) if line[:1] in ("T", "C") else None
        if m or line.startswith(_STACK_HEADER):
            if line == self._rep and not self._raw and not self.threads and not self._truncated \
                    and not self.process.meta:
                # the header again with nothing since: the dump of it alone that it would end is the
                # one just folded again (8 MB of one thread line), counted without being built
                self.repeat(self.processes, lineno)
                return True
            self._end_thread()
            ident = m.group(2) if m else "0x0"
            current = not m or m.group(1) == "Current thread"
            self._rep = None
            if ident in self.idents or (current and self.has_current):
                if self._end_process(lineno):
                    q = self.processes[-1]
                    if (len(q.threads) == 1 and not q.threads[0].frames and q.threads[0].ident == ident
                            and not q.meta and q.threads[0].state == ("current" if current else None)):
                        self._rep = line
            self.idents.add(ident)
            self.has_current = self.has_current or current
            self._thread = (ident, current)
            self._thread_line = lineno
            self.sink = self._raw
            return True
        if line.startswith(_FATAL):
            self._end_thread()
            if self.threads:
                self._end_process(lineno)
            self.process.meta["fatal_error"] = line[len(_FATAL):].strip()
            return True
        if line.startswith(("Python runtime state:", "Extension modules:")) and not self._thread:
            return True
        return False

    def _end_thread(self) -> None:
        if self._thread is None:
            return
        ident, current = self._thread
        raw, self._raw, self._thread, self.sink = self._raw, [], None, None
        frames = self.stack_of(raw, parse_frame_line, True, self._thread_line)
        t = Thread(ident=ident, frames=frames, state="current" if current else None)
        if self._truncated:
            t.name = None
            self.process.meta.setdefault("truncated_threads", []).append(ident)
            self._truncated = False
        self.threads.append(t)

    def _end_process(self, lineno: int) -> bool:
        """The process read so far is complete; True when it was folded as a repeat (see keep)."""
        folded = False
        if self.threads:
            p = self.process
            p.threads = self.threads
            _mark_main(self.threads)
            if p.meta.get("truncated_threads"):
                main = p.main_thread
                if main is not None and main.ident in p.meta["truncated_threads"]:
                    p.status = STATUS_TRUNCATED
                    p.status_detail = "faulthandler printed '...': the main thread has more frames than it shows"
            folded = self.keep(self.processes, p)
        self._new_process(lineno)
        return folded

    def close(self) -> List[Process]:
        self._end_thread()
        self._end_process(0)
        return self.processes


def _mark_main(threads: List[Thread]) -> None:
    for t in threads:
        if t.frames and t.frames[0].function == "<module>":
            t.is_main = True
            return
    # faulthandler walks the interpreter's thread list, newest first: the main thread comes last
    threads[-1].is_main = True
