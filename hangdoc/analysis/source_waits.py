"""What a user's source line blocks in, when the stack alone cannot say.

A stack from faulthandler, a traceback or the watchdog shows only Python frames: a thread blocked
in ``with STATS_LOCK:`` (a C-level lock acquire) or in ``os.waitpid(pid, 0)`` looks like one that
computes at that line. When the source is readable here (the usual case for the in-job watchdog
and for an aggregate on the training host), the line says what it waits for.

    >>> blocking_call_in("    with STATS_LOCK:  # the stats")
    ('a lock', 'with STATS_LOCK:')
    >>> blocking_call_in("    os.waitpid(pid, 0)")
    ('a child process', 'os.waitpid(pid, 0)')
    >>> blocking_call_in("    loss = model(x).sum()") is None
    True
"""

from __future__ import annotations

import functools
import re
from typing import Optional, Tuple

from hangdoc.safeio import read_source

#: the largest source file read (torch's biggest, a test helper, is 1.4 MB; beyond it: unknown)
MAX_SOURCE = 4 << 20
#: the longest line looked at
MAX_LINE = 400

# (what it waits for, pattern): each pattern is linear (no nested quantifiers) and anchored on a name
_WAITS = [
    ("a lock", re.compile(r"^\s*(?:async\s+)?with\s+[\w.\[\]]*(?:lock|mutex|_lk|rlock|cond|condition|semaphore|sem)\w*\s*(?:\(\s*\))?\s*(?:as\s+\w+\s*)?:", re.I)),
    ("a lock", re.compile(r"\.acquire\(")),
    ("a child process", re.compile(r"\b(?:os\.)?wait(?:pid|4)?\(|\.communicate\(|\bsubprocess\.(?:run|call|check_call|check_output)\(")),
    ("a thread or process to end", re.compile(r"\.join\(\s*\)")),
    ("an event or condition", re.compile(r"\b\w*(?:event|cond|condition|done|ready|barrier)\w*\.wait(?:_for)?\(", re.I)),
]


def blocking_call_in(text: str) -> Optional[Tuple[str, str]]:
    """``(what it waits for, the statement)`` when the line ``text`` blocks on a primitive."""
    text = text[:MAX_LINE]
    code = text.split("#", 1)[0]
    for what, pattern in _WAITS:
        if pattern.search(code):
            return what, code.strip()
    return None


@functools.lru_cache(maxsize=8)
def source_bytes(file: str) -> Optional[bytes]:
    """The source of ``file`` as this machine has it, read as input (the name comes from a dump): a
    regular file only (a FIFO would block, ``/dev/zero`` never end), at most :data:`MAX_SOURCE`
    bytes; None otherwise. Shared by every rule that looks at a call site's source."""
    return read_source(file, MAX_SOURCE)


@functools.lru_cache(maxsize=1024)
def blocking_call(file: str, line: int) -> Optional[Tuple[str, str]]:
    """:func:`blocking_call_in` of ``file:line``; None when the file is not a readable regular file here."""
    if line is None or line < 1:
        return None
    data = source_bytes(file)
    if data is None:
        return None
    start = 0
    for _ in range(line - 1):
        start = data.find(b"\n", start) + 1
        if start == 0:
            return None
    end = data.find(b"\n", start)
    return blocking_call_in(data[start:end if end >= 0 else len(data)].decode("utf-8", "replace"))
