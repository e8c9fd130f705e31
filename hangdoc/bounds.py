"""Bounds on every number read from input, and the one way to turn input text into an int.

A dump, a log or a record file is whatever was on disk: a tag line may say
``world_size=9999999999999`` and a frame line may carry a 5,000-digit line number (beyond Python's
4,300-digit ``int()`` limit). Numbers are read with :func:`bounded_int`, which looks at the length
of the text before converting it and gives None for anything outside the bounds below, so a bad
number costs that value, never the file, the memory or the time of ``hangdoc aggregate``.

    >>> bounded_int("42", 0, MAX_PID)
    42
    >>> bounded_int("9" * 5000, 0, MAX_PID) is None, bounded_int("-1", 0, MAX_RANK) is None
    (True, True)
    >>> bounded_int("0x7f", 0, MAX_IDENT, base=16), bounded_int(" 7 ", 0, 9), bounded_int("1_0", 0, 99)
    (127, 7, None)
"""

from __future__ import annotations

from typing import Any, Optional

#: ranks (and world sizes, group ranks, local ranks) are below this: no job has more processes
MAX_RANKS = 1 << 20
MAX_RANK = MAX_RANKS - 1
#: pids, parent pids and OS thread ids (Linux's pid_max is at most 2**22; room for other kernels)
MAX_PID = (1 << 31) - 1
#: collective sequence numbers, record ids
MAX_SEQ = (1 << 63) - 1
#: source line numbers printed in a stack
MAX_LINE_NO = (1 << 31) - 1
#: tensor sizes, byte counts
MAX_SIZE = (1 << 63) - 1
#: thread idents printed in hex (0x7f...): 64-bit addresses
MAX_IDENT = (1 << 64) - 1

_DIGITS = frozenset("0123456789")
_HEX = frozenset("0123456789abcdefABCDEF")


def bounded_int(text: Any, lo: int, hi: int, base: int = 10) -> Optional[int]:
    """``int(text)`` when ``text`` is a plain integer (optional sign, ``0x`` for base 16, digits
    only: no ``_``, no spaces inside) within ``lo..hi``; None otherwise. Never raises, and never
    converts more digits than ``hi`` has, so it costs O(digits of ``hi``) whatever ``text`` is."""
    if type(text) is str and base == 10 and len(text) <= 18 and text.isdigit() and text.isascii():
        # the common case, a few plain digits: what the checks below would say (a number longer
        # than ``hi`` is above it), without them
        v = int(text)
        return v if lo <= v <= hi else None
    if isinstance(text, bool):
        return None
    if isinstance(text, int):
        return text if lo <= text <= hi else None
    if not isinstance(text, str):
        return None
    s = text.strip()
    neg = s[:1] == "-"
    if s[:1] in "+-" and s:
        s = s[1:]
    if base == 16 and s[:2] in ("0x", "0X"):
        s = s[2:]
    if not s:
        return None
    width = len(format(max(abs(lo), abs(hi), 1), "x" if base == 16 else "d"))
    if len(s.lstrip("0")) > width:
        return None
    allowed = _HEX if base == 16 else _DIGITS
    if not all(c in allowed for c in s):
        return None
    v = int(s, base)
    if neg:
        v = -v
    return v if lo <= v <= hi else None


def bounded(value: Any, lo: int, hi: int) -> Optional[int]:
    """An int already parsed (JSON) within ``lo..hi``, else None (bools are no ints here).

    >>> bounded(3, 0, 7), bounded(True, 0, 7), bounded(10**30, 0, MAX_SEQ), bounded(2.0, 0, 7)
    (3, None, None, None)
    """
    if isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi:
        return value
    return None
