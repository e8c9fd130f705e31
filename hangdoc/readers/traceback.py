"""Python tracebacks (``Traceback (most recent call last):``), also from a launcher's console.

A rank that dies of a collective timeout leaves a traceback ending in the call that hung::

    [rank0]: Traceback (most recent call last):
    [rank0]:   File "/work/train.py", line 23, in sync_params
    [rank0]:     dist.broadcast(params, src=0)
    [rank0]: RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 10000ms

Each traceback becomes one process with one (main) thread; the exception line is kept in
``meta["exception"]``. A chained traceback (``During handling of the above exception ...``,
``The above exception was the direct cause ...``) stays with the process of the first one, whose
frames show where it was when things went wrong. Prefixes such as ``[rank3]:``, ``[default3]:``
(torchrun ``--tee``) or ``[host:3]`` (hangdoc) are taken off by the dispatcher, which also keeps
lines of different ranks apart when they interleave.

    >>> from hangdoc.readers import read_text
    >>> job = read_text('''[rank1]: Traceback (most recent call last):
    ... [rank1]:   File "/w/train.py", line 9, in <module>
    ... [rank1]:     main()
    ... [rank1]: RuntimeError: timed out
    ... ''')
    >>> p = job.processes[0]
    >>> (p.rank, p.main_thread.top.function, p.meta["exception"])
    (1, '<module>', 'RuntimeError: timed out')
"""

from __future__ import annotations

import re
from typing import List, Optional

from hangdoc.bounds import MAX_LINE_NO, bounded_int
from hangdoc.model import Frame, Process, Thread
from hangdoc.readers._base import BlockParser, FileContext, make_frame

FORMAT = "traceback"

HEADER = "Traceback (most recent call last):"
_FRAME_RE = re.compile(r'^  File "(.*)", line (\d+), in (.*)$')
_CHAIN = (
    "During handling of the above exception, another exception occurred:",
    "The above exception was the direct cause of the following exception:",
)


def starts(line: str) -> bool:
    return line.startswith(HEADER)


def starts_fragment(line: str) -> bool:
    """A frame line with no header before it: a traceback pasted from its middle."""
    return line.startswith('  File "') and _FRAME_RE.match(line) is not None


def parse_frame_line(text: str) -> Optional[Frame]:
    m = _FRAME_RE.match(text)
    if not m:
        return None
    return make_frame(m.group(3), m.group(1), bounded_int(m.group(2), 0, MAX_LINE_NO))


class TracebackParser(BlockParser):
    format = FORMAT

    def __init__(self, ctx: FileContext, lineno: int, fragment: bool = False) -> None:
        super().__init__(ctx, lineno)
        self.raw: List[str] = []
        self.exceptions: List[str] = []
        self.state = "frames" if fragment else "header"  # header → frames → done (→ chain → header ...)
        self.chained = False
        self.fragment = fragment

    def feed(self, lineno: int, line: str) -> bool:
        if self.state == "header":
            if line.startswith(HEADER):
                self.state = "frames"
                return True
            return False
        if self.state == "frames":
            if line.startswith("  "):
                if line.startswith('  File "') and not self.chained:
                    self.raw.append(line)
                return True  # source lines, ^^^ markers, "[Previous line repeated N more times]"
            if not line.strip():
                return True
            if line.startswith(HEADER):
                # never an exception line: before any frame, the same header again (read as one; 8 MB
                # of it were 120,000 tracebacks whose exception was the header); after frames, this
                # traceback was cut off and another begins
                return not self.raw
            self.exceptions.append(line.strip())
            self.state = "done"
            return True
        # done: a chained traceback may follow
        if not line.strip():
            return True
        if line.strip() in _CHAIN:
            self.chained = True
            self.state = "header"
            return True
        return False

    def close(self) -> List[Process]:
        if not self.raw and not self.exceptions:
            return []
        raw = self.raw
        # tracebacks print outermost first already
        frames = self.stack_of(raw, parse_frame_line, False, self.start)
        p = Process(format=FORMAT, source_line=self.start)
        p.threads = [Thread(ident="", name="MainThread", frames=frames, is_main=True)]
        if self.fragment:
            p.meta["fragment"] = True
        if self.exceptions:
            p.meta["exception"] = self.exceptions[0]
            if len(self.exceptions) > 1:
                p.meta["exceptions"] = list(self.exceptions)
        if self.state == "frames" and not self.fragment:
            self.ctx.error(self.start, "traceback cut off (no exception line)")
        return [p]
