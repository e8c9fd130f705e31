"""C++ backtraces that torch prints under a ``c10::Error`` (and ``DistBackendError``)::

    Exception raised from checkTimeout at ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:565 (most recent call first):
    frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x57 (0x7f4b7d5b5d87 in /usr/lib/python3/dist-packages/torch/lib/libc10.so)
    frame #1: c10d::ProcessGroupNCCL::WorkNCCL::checkTimeout(std::optional<std::chrono::duration<long, std::ratio<1l, 1000l> > >) + 0x1e6 (0x7f4b2e39e6e6 in /usr/lib/python3/dist-packages/torch/lib/libtorch_cuda.so)
    frame #2: <unknown function> + 0xdc253 (0x7f4b7cf36253 in /lib/x86_64-linux-gnu/libstdc++.so.6)

One block is one thread of native frames (``c10-backtrace``), innermost first as printed and stored
outermost first. A frame wrapped over two lines (a terminal or a paste cut it) is joined. The
``raised from`` place is kept in ``meta["raised_from"]``. The stream attaches the thread to the
process printed just before it on the same channel (the traceback that carried the error), so
a rank's Python stack and its C++ one stay one process.

    >>> from hangdoc.readers import read_text
    >>> job = read_text("frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x57 (0x7f in /t/libc10.so)\\n"
    ...                 "frame #1: <unknown function> + 0xdc253 (0x7f4b in /lib/libstdc++.so.6)\\n")
    >>> [f.function for f in job.processes[0].threads[0].frames]
    ['<unknown function>', 'c10::Error::Error(c10::SourceLocation, std::string)']
"""

from __future__ import annotations

import re
from typing import List, Optional

from hangdoc.model import Frame, Process, Thread
from hangdoc.readers._base import BlockParser, FileContext, make_frame

FORMAT = "c10-backtrace"

_RAISED_RE = re.compile(r"Exception raised from (\S{1,512}) at (\S{1,4096}) \(most recent call first\):")
_FRAME_RE = re.compile(r"frame #(\d{1,6}): ")
# "func + 0x57 (0x7f... in /lib/x.so)" | "func (0x7f... in /lib/x.so)" | "0x7f... (unknown)"
_TAIL_RE = re.compile(r"(?: \+ 0x[0-9a-fA-F]{1,16})? \((?:0x[0-9a-fA-F]{1,16} in )?([^()]{0,4096})\)$")
#: frames kept per backtrace
MAX_FRAMES = 512


def starts(line: str) -> bool:
    return line.startswith("frame #0: ") or (line.startswith("Exception raised from ") and
                                             _RAISED_RE.match(line) is not None)


def parse_frame_line(text: str) -> Optional[Frame]:
    m = _FRAME_RE.match(text)
    if m is None:
        return None
    rest = text[m.end():]
    t = _TAIL_RE.search(rest)
    if t is None:
        return make_frame(rest.strip()[:512] or "??", "", None, native=True)
    lib = t.group(1).strip()
    return make_frame(rest[:t.start()].strip()[:512] or "??", lib.rsplit("/", 1)[-1], None, native=True)


class C10BacktraceParser(BlockParser):
    format = FORMAT

    def __init__(self, ctx: FileContext, lineno: int) -> None:
        super().__init__(ctx, lineno)
        self.raw: List[str] = []
        self.raised_from: Optional[str] = None

    def feed(self, lineno: int, line: str) -> bool:
        if not self.raw and self.raised_from is None:
            m = _RAISED_RE.match(line)
            if m is not None:
                self.raised_from = f"{m.group(1)} at {m.group(2)}"
                return True
        if line.startswith("frame #"):
            if _FRAME_RE.match(line) is None:
                return False
            if len(self.raw) < MAX_FRAMES:
                self.raw.append(line)
            return True
        if self.raw and not self.raw[-1].rstrip().endswith(")") and line.strip() and not line.startswith(" " * 8):
            # a frame wrapped over two lines
            self.raw[-1] = self.raw[-1] + line.strip()
            return True
        return False

    def close(self) -> List[Process]:
        if not self.raw:
            return []
        frames = self.stack_of(self.raw, parse_frame_line, True, self.start)
        p = Process(format=FORMAT, source_line=self.start)
        p.threads = [Thread(ident="", name="c10::Error (native)", frames=frames, is_main=True)]
        if self.raised_from:
            p.meta["raised_from"] = self.raised_from
        return [p]
