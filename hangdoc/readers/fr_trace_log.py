"""What PyTorch's Flight Recorder analyser (``fr_trace`` / ``torchfrtrace``) printed about a hang.

    Not all ranks joining collective, sequence number: 4
    internal record id: 4
    group info: main_comm:gloo
    collective: nccl:all_reduce
    missing ranks: {1}
    input sizes: [[1024]]
    output sizes: [[1024]]
    world size: 2
    expected ranks: {0, 1}
    collective state: scheduled
    collective stack trace:
      all_reduce at /torch/distributed/distributed_c10d.py:2707
      <module> at /home/u/test/crash.py:44

One event ``missing`` per report: ``seq``, ``group``, ``op``, ``missing`` (ranks that did not join),
``expected`` (the ranks that should have, or their number), ``world_size``, ``call_site``. fr_trace
names the ranks *missing* from a collective; whether they skipped it or the others issued one too
many, only the sizes of the two sides can suggest (see the log rules).

    >>> from hangdoc.readers import read_text
    >>> job = read_text("Not all ranks joining collective 5 at entry 4\\ngroup info: 0:default_pg\\n"
    ...                 "collective: nccl:all_reduce\\nmissing ranks: {1}\\nexpected ranks: 2\\n")
    >>> e = job.events[0]
    >>> (e.kind, e.fields["seq"], e.fields["missing"], e.fields["expected"], e.fields["op"])
    ('missing', 5, [1], [0, 1], 'all_reduce')
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional

from hangdoc.readers._logbase import Identity, LineReader, number

FORMAT = "fr_trace"
KEYWORDS = ("Not all ranks joining collective",)

#: ranks listed in one set ({0, 1, ...}) at most
MAX_RANKS = 1 << 16

_START_RE = re.compile(r"Not all ranks joining collective(?:[,:]? sequence number:? (\d{1,20})| (\d{1,20}) at entry (\d{1,20}))?")
_FIELD_RE = re.compile(r"^([a-z][a-z ]{1,40}): ?(.{0,4096})$")
_FRAME_RE = re.compile(r"^(\S{1,512}) at (\S{1,4096}):(\d{1,9})$")


def _ranks(text: str) -> Optional[List[int]]:
    text = text.strip()
    if text.startswith("{") and text.endswith("}"):
        out = []
        for part in text[1:-1].split(",")[:MAX_RANKS]:
            n = number(part.strip())
            if n is not None and 0 <= n < MAX_RANKS:
                out.append(n)
        return sorted(set(out))
    n = number(text)
    if n is not None and 0 < n <= MAX_RANKS:
        return list(range(n))  # "expected ranks: 2": the group's size
    return None


class Reader(LineReader):
    def __init__(self, ctx) -> None:
        super().__init__(ctx, FORMAT)
        self.block: Optional[Dict[str, object]] = None
        self.start = 0
        self.ident: Identity = (None, None, None)
        self.frames: List[str] = []
        self.in_stack = False

    def feed(self, lineno: int, text: str, ident: Identity) -> None:
        t = text.strip()
        m = _START_RE.search(t)
        if m is not None:
            self._end()
            self.block = {"seq": number(m.group(1) or m.group(2))}
            self.start, self.ident, self.active = lineno, ident, True
            return
        if self.block is None:
            return
        if self.in_stack:
            fm = _FRAME_RE.match(t)
            if fm is not None:
                if len(self.frames) < 128:
                    self.frames.append(f"{fm.group(1)} ({fm.group(2)}:{fm.group(3)})")
                return
            self.in_stack = False
        fm = _FIELD_RE.match(t)
        if fm is None:
            self._end()
            return
        key, value = fm.group(1).strip(), fm.group(2).strip()
        if key == "collective stack trace":
            self.in_stack = True
        elif key == "group info":
            self.block["group"] = value.split(":", 1)[-1] if ":" in value else value
        elif key == "collective":
            self.block["op"] = value.split(":", 1)[-1]
        elif key == "missing ranks":
            self.block["missing"] = _ranks(value)
        elif key == "expected ranks":
            self.block["expected"] = _ranks(value)
        elif key == "world size":
            self.block["world_size"] = number(value)
        elif key == "input sizes":
            self.block["input_sizes"] = value[:200]
        elif key == "collective state":
            self.block["state"] = value[:40]

    def _end(self) -> None:
        block, self.block = self.block, None
        self.active = self.in_stack = False
        frames, self.frames = self.frames, []
        if block is None:
            return
        site = next((f for f in reversed(frames) if "/torch/" not in f), None) if frames else None
        if frames:
            # printed outermost last: the user's frame is the last one outside torch
            site = next((f for f in frames if "/torch/distributed/" not in f and "c10d_logger" not in f), site)
        block["call_site"] = site
        self.emit("missing", self.start, self.ident, f"Not all ranks joining collective {block.get('seq')}",
                  **{k: v for k, v in block.items() if v is not None})

    def close(self):
        self._end()
        return self.events
