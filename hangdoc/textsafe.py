"""Text from input made safe to print: no terminal escapes, no forged lines, no hidden reordering.

Frame names, call sites and file names come from dumps anyone may have written. Printed raw, a
newline in a call site starts a line that looks like hangdoc's own (a forged headline), an ANSI
escape repaints the terminal, and a Unicode bidi override (U+202E) shows text in another order
than it is. :func:`visible` escapes all of them as Python would (``\\n``, ``\\x1b``, ``\\u202e``).
:func:`strip_ansi` removes colour codes (CSI and OSC sequences) from a line before a reader looks
at it: py-spy and launchers colour their output when they think they talk to a terminal.

    >>> visible("main\\n» collective-mismatch: rank 0")
    'main\\\\n» collective-mismatch: rank 0'
    >>> visible("evil\\u202etxt.py")
    'evil\\\\u202etxt.py'
    >>> strip_ansi("\\x1b[1;33mThread 42\\x1b[0m (idle)")
    'Thread 42 (idle)'
"""

from __future__ import annotations

import re

# Bidi embeddings/overrides/isolates and marks that reorder what follows them on screen.
_BIDI = "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f\u061c"
# C0 (but tab), DEL, C1, the line/paragraph separators some terminals break at, and bidi controls.
_UNSAFE_RE = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029" + _BIDI + "]")
# CSI (ESC [ params intermediates final), OSC (ESC ] ... BEL or ESC \), and two-byte escapes.
# Each alternative is a run of one character class followed by one terminator: linear.
_ANSI_RE = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]?"
    r"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?"
    r"|\x1b[@-Z\\-_]"
    r"|\x9b[0-?]*[ -/]*[@-~]?"
)
_NAMED = {"\n": "\\n", "\r": "\\r", "\x1b": "\\x1b"}


def _escape(m: "re.Match[str]") -> str:
    c = m.group(0)
    named = _NAMED.get(c)
    if named is not None:
        return named
    o = ord(c)
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}"


def visible(text: str) -> str:
    """``text`` with control characters, line separators and bidi controls shown as escapes."""
    if _UNSAFE_RE.search(text) is None:
        return text
    return _UNSAFE_RE.sub(_escape, text)


def strip_ansi(text: str) -> str:
    """``text`` without ANSI escape sequences (colours, cursor moves, OSC titles and links)."""
    if "\x1b" not in text and "\x9b" not in text:
        return text
    return _ANSI_RE.sub("", text)


_ANSI_BYTES_RE = re.compile(_ANSI_RE.pattern.replace("\\x9b", "\\xc2\\x9b").encode("latin-1"))


def strip_ansi_bytes(data: bytes) -> bytes:
    """:func:`strip_ansi` of bytes (a file's head, before it is decoded).

    >>> strip_ansi_bytes(b"\\x1b[32mThread\\x1b[0m 1")
    b'Thread 1'
    """
    if b"\x1b" not in data and b"\xc2\x9b" not in data:
        return data
    return _ANSI_BYTES_RE.sub(b"", data)
