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
_CUDA_RE = re.compile(r"(CUDA error: an illegal memory access was encountered)")


def _assertion(text: str):
    """``file.c:756: func: Assertion `x' failed.`` (glibc's assert), found with two finds, no regex."""
    i = text.find("Assertion `")
    if i < 0:
        return None
    j = text.find("' failed.", i, i + 400)
    if j < 0:
        return None
    start = max(text.rfind(" ", 0, max(i - 300, 0)) + 1, i - 300, 0)
    head = text[start:i]
    # "python: src/psm2_nccl_net.c:756: mq_progress_loop: " -> from the file name on
    k = head.find(": ")
    if k >= 0 and ":" in head[k + 2:]:
        head = head[k + 2:]
    return (head + text[i:j + len("' failed.")]).strip()


class Reader(LineReader):
    def __init__(self, ctx) -> None:
        super().__init__(ctx, FORMAT)

    def feed(self, lineno: int, text: str, ident: Identity) -> None:
        m = _FATAL_RE.search(text)
        if m is not None:
            self.emit("exception", lineno, ident, text, exc=f"Fatal Python error: {m.group(1).strip()}", via="crash")
            return
        exc = _assertion(text)
        if exc is not None:
            self.emit("exception", lineno, ident, text, exc=exc, via="crash")
            return
        m = _CUDA_RE.search(text)
        if m is not None and "terminated with exception" not in text and not text.lstrip().startswith("what()"):
            self.emit("exception", lineno, ident, text, exc=m.group(1), via="crash")
