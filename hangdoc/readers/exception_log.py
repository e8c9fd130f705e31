"""An exception line on its own: what a rank raised when its traceback is not in the log.

    [1]<stderr>:RuntimeError: ncclCommInitRank failed: unhandled cuda error (run with NCCL_DEBUG=INFO for details)
    [rank3]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.

A paste cut before the traceback's frames, or a framework that logs only the exception, leaves this
line alone. Event: ``exception`` (``exc``), merged with the same exception of a traceback of the
same rank when there is one (which adds where it was raised).

    >>> from hangdoc.readers import read_text
    >>> e = read_text("[rank3]: torch.OutOfMemoryError: CUDA out of memory.\\n").events[0]
    >>> (e.kind, e.rank, e.fields["exc"])
    ('exception', 3, 'torch.OutOfMemoryError: CUDA out of memory.')
"""

from __future__ import annotations

import re
from typing import Optional

from hangdoc.readers._logbase import Identity, LineReader

FORMAT = "exception"
KEYWORDS = ("Error: ", "Exception: ", "Error(", "Interrupt")

# at the start of the line (behind its prefixes): "pkg.mod.NameError: message"
_EXC_RE = re.compile(r"(?:[A-Za-z_][A-Za-z0-9_]{0,64}\.){0,8}[A-Z][A-Za-z0-9_]{0,64}(?:Error|Exception|Interrupt)(?::|$)")


class Reader(LineReader):
    def __init__(self, ctx) -> None:
        super().__init__(ctx, FORMAT)
        self.last_text: Optional[str] = None  # the last line read, and its exception (None: none)
        self.last_exc: Optional[str] = None

    def feed(self, lineno: int, text: str, ident: Identity) -> None:
        if text != self.last_text:
            m = _EXC_RE.match(text)
            self.last_text = text
            # "Error: Failed...": py-spy's own
            self.last_exc = None if m is None or text.startswith("Error: Failed") else text.strip()[:400]
        if self.last_exc is not None:
            self.emit("exception", lineno, ident, text, exc=self.last_exc, via="line")
