"""What ``hangdoc run --detect`` decided in the job: ``divergence.json``.

    {
     "hangdoc": "divergence",
     "version": 1,
     "group": "default_pg",
     "index": 41,
     "deviants": [1],
     "agreeing": [0],
     "deviant": ["22fc982cd449b914", "all_reduce([256] float32)", "nccl_silent_skip.py:56", 0],
     "expected": ["28c7c5add9993b43", "broadcast([256] float32, src=0)", "nccl_silent_skip.py:61", 1],
     "basis": "tie",
     ...
    }

One event ``divergence`` with the document's fields. The detector must name one side in the job
(on a tie it names the higher rank); the aggregate names both sides when there was no majority.

    >>> from hangdoc.readers import read_text
    >>> e = read_text('{\\n "hangdoc": "divergence",\\n "version": 1,\\n "group": "default_pg",\\n "index": 3,\\n'
    ...               ' "deviants": [2],\\n "agreeing": [0, 1, 3],\\n "basis": "majority"\\n}\\n').events[0]
    >>> (e.kind, e.fields["index"], e.fields["deviants"], e.fields["agreeing"])
    ('divergence', 3, [2], [0, 1, 3])
"""

from __future__ import annotations

import json
from typing import List

from hangdoc.readers._logbase import Identity, LineReader, number

FORMAT = "hangdoc-divergence"
KEYWORDS = ('"divergence"',)

#: lines of one document read at most
MAX_LINES = 10000
#: ranks kept per side
MAX_RANKS = 1 << 16


def _ranks(v) -> List[int]:
    if not isinstance(v, list):
        return []
    return [r for r in v[:MAX_RANKS] if type(r) is int and 0 <= r < (1 << 31)]


class Reader(LineReader):
    def __init__(self, ctx) -> None:
        super().__init__(ctx, FORMAT)
        self.buf: List[str] = []
        self.start = 0

    def feed(self, lineno: int, text: str, ident: Identity) -> None:
        if not self.active:
            if text.strip().replace(" ", "").startswith(('"hangdoc":"divergence"', '{"hangdoc":"divergence"')):
                self.active, self.start = True, lineno
                self.buf = [text if text.lstrip().startswith("{") else "{" + text]
                if text.rstrip().endswith("}"):
                    self._end(ident)
            return
        self.buf.append(text)
        if text.rstrip() == "}" or len(self.buf) > MAX_LINES:
            self._end(ident)

    def _end(self, ident: Identity) -> None:
        self.active = False
        text, self.buf = "\n".join(self.buf), []
        try:
            d = json.loads(text)
        except ValueError as e:
            self.ctx.error(self.start, f"bad divergence.json: {e}")
            return
        if not isinstance(d, dict) or d.get("hangdoc") != "divergence":
            return
        self.emit("divergence", self.start, ident, str(d.get("summary", ""))[:300], group=str(d.get("group", ""))[:200],
                  index=number(str(d.get("index"))), exact=bool(d.get("exact", True)),
                  deviants=_ranks(d.get("deviants")), agreeing=_ranks(d.get("agreeing")),
                  deviant=d.get("deviant") if isinstance(d.get("deviant"), list) else None,
                  expected=d.get("expected") if isinstance(d.get("expected"), list) else None,
                  basis=str(d.get("basis", ""))[:40], summary=str(d.get("summary", ""))[:400])

    def close(self):
        if self.active:
            self.ctx.error(self.start, "divergence.json cut off")
            self.active = False
        return self.events
