"""A process that crashed in native code: what it printed on its way down.

    [default3]:python: src/psm2_nccl_net.c:756: mq_progress_loop: Assertion `r->used' failed.
    [default3]:Fatal Python error: Segmentation fault
    [rank0]:[E1122 00:06:07 ProcessGroupNCCL.cpp:1423] CUDA error: an illegal memory access was encountered

Events: ``exception`` with ``exc`` the crash (``Fatal Python error: Segmentation fault``, the failed
assertion, the CUDA fault) and ``via`` ``crash``. A segmentation fault or a failed assertion is a
rank's own failure, never fallout of another's.

    >>> from hangdoc.readers import read_text
    >>> e = read_text("[default3]:Fatal Python error: Segmentation fault\\n").events[0]
    >>> (e.kind, e.fields["exc"])
    ('exception', 'Fatal Python error: Segmentation fault')
"""

from __future__ import annotations

import re

from hangdoc.readers._logbase import Identity, LineReader

FORMAT = "crash"
KEYWORDS = ("Fatal Python error", "Assertion `", "illegal memory access")

_FATAL_RE = re.compile(r"Fatal Python error: (.{1,300})")
_ASSERT_RE = re.compile(r"([^\s:]{1,512}:\d{1,9}: (?:[^:]{1,200}: )?Assertion `.{1,300}' failed\.)")
_CUDA_RE = re.compile(r"(CUDA error: an illegal memory access was encountered)")


class Reader(LineReader):
    def __init__(self, ctx) -> None:
        super().__init__(ctx, FORMAT)

    def feed(self, lineno: int, text: str, ident: Identity) -> None:
        m = _FATAL_RE.search(text)
        if m is not None:
            self.emit("exception", lineno, ident, text, exc=f"Fatal Python error: {m.group(1).strip()}", via="crash")
            return
        m = _ASSERT_RE.search(text)
        if m is not None:
            self.emit("exception", lineno, ident, text, exc=m.group(1), via="crash")
            return
        m = _CUDA_RE.search(text)
        if m is not None and "terminated with exception" not in text and not text.lstrip().startswith("what()"):
            self.emit("exception", lineno, ident, text, exc=m.group(1), via="crash")
