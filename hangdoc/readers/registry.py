"""Which formats exist: the stack formats' block detection and the log readers' discovery.

Stack formats start a block at a recognisable first line (:func:`detect`, dispatched on the first
character: it runs on every line that no parser claims). Log formats are found by module name:
every ``hangdoc/readers/*_log.py`` with ``FORMAT``, ``KEYWORDS`` and ``Reader`` is one, so a new
log format is one new file. :func:`markers_re` is what a walked file's 64 KB head must hold to be
read; :data:`ANCHORS` what a 256 KB stretch must hold to be read line by line.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from typing import List, Optional, Tuple

from hangdoc.readers import c10_backtrace as _c10
from hangdoc.readers import faulthandler as _faulthandler
from hangdoc.readers import gdb as _gdb
from hangdoc.readers import pyspy as _pyspy
from hangdoc.readers import pystack as _pystack
from hangdoc.readers import traceback as _traceback
from hangdoc.readers._base import BlockParser, FileContext
from hangdoc.tags import PREFIX as _TAG_PREFIX

__all__ = ["detect", "log_modules", "new_log_readers", "keyword_re", "has_keyword", "markers", "markers_re"]

# The first line of a stack block, per format (a walked file's head must hold one, see files.py).
STACK_MARKERS: Tuple[bytes, ...] = (
    b"Thread ",
    b"Traceback (most recent call last)",
    b"Process ",
    b"Current thread 0x",
    b"Stack (most recent call first)",
    b"Traceback for thread ",
    _TAG_PREFIX.strip().encode(),
    b'"thread_name"',
    b"Error: Failed",
    b"Fatal Python error",
    b'  File "',
    b"=== Rank ",
    b"frame #",
)


def detect(ctx: FileContext, lineno: int, line: str) -> Optional[BlockParser]:
    """The parser for a block that starts at ``line``, or None when no block starts there."""
    c = line[:1]
    if c == "T":
        if line.startswith("Thread "):
            if _faulthandler.starts(line):
                return _faulthandler.FaulthandlerParser(ctx, lineno)
            if _gdb.starts(line):
                return _gdb.GdbParser(ctx, lineno)
            if _pyspy.starts(line):
                return _pyspy.PySpyParser(ctx, lineno)
        elif _traceback.starts(line):
            return _traceback.TracebackParser(ctx, lineno)
        elif _pystack.starts(line):
            return _pystack.PystackParser(ctx, lineno)
    elif c == "P":
        if _pyspy.starts(line):
            return _pyspy.PySpyParser(ctx, lineno)
    elif c in ("C", "S", "F"):
        if _faulthandler.starts(line):
            return _faulthandler.FaulthandlerParser(ctx, lineno)
    elif c in ("[", "{"):
        if _pyspy.starts_json(line):
            return _pyspy.PySpyJsonParser(ctx, lineno)
    elif c in ("E", "e"):
        if _pyspy.starts(line):
            return _pyspy.PySpyParser(ctx, lineno)
        if _c10.starts(line):
            return _c10.C10BacktraceParser(ctx, lineno)
    elif c == "f":
        if _c10.starts(line):
            return _c10.C10BacktraceParser(ctx, lineno)
    elif c == " ":
        if _traceback.starts_fragment(line):
            return _traceback.TracebackParser(ctx, lineno, fragment=True)
    return None


_LOG_MODULES: Optional[List[object]] = None


def log_modules() -> List[object]:
    """Every log reader module (``hangdoc.readers.*_log``), in name order."""
    global _LOG_MODULES
    if _LOG_MODULES is None:
        import hangdoc.readers as pkg

        found = []
        for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
            if info.name.endswith("_log") and not info.name.startswith("_"):
                mod = importlib.import_module(f"hangdoc.readers.{info.name}")
                if hasattr(mod, "Reader") and hasattr(mod, "KEYWORDS"):
                    found.append(mod)
        _LOG_MODULES = found
    return _LOG_MODULES


def new_log_readers(ctx: FileContext) -> list:
    return [m.Reader(ctx) for m in log_modules()]  # type: ignore[attr-defined]


_KEYWORD_RE = None
_MARKERS_RE = None
#: has_keyword's answers, by the text (an ASCII one as bytes with its digits made 0: no keyword holds
#: a digit, so that changes no answer, and the header lines of 131,072 processes, which differ in
#: their pids, are searched once): at most _SEEN_TEXTS texts of up to 512 characters, forgotten all
#: at once when full
_SEEN: dict = {}
_SEEN_TEXTS = 1 << 14
_ZEROS = bytes.maketrans(b"123456789", b"000000000")
_DIGIT_FREE: Optional[bool] = None


def keyword_re():
    """One pattern of every log reader's keywords (literal alternation: linear)."""
    global _KEYWORD_RE
    if _KEYWORD_RE is None:
        words = sorted({w for m in log_modules() for w in m.KEYWORDS}, key=len, reverse=True)  # type: ignore[attr-defined]
        _KEYWORD_RE = re.compile("|".join(re.escape(w) for w in words))
    return _KEYWORD_RE


def has_keyword(text: str) -> bool:
    """Does ``text`` hold any log reader's keyword (``keyword_re().search``), remembered per text?"""
    global _DIGIT_FREE
    if _DIGIT_FREE is None:
        _DIGIT_FREE = not any(c.isdigit() for m in log_modules() for w in m.KEYWORDS for c in w)  # type: ignore[attr-defined]
    if len(text) > 512:
        return keyword_re().search(text) is not None
    # (bytes.translate: str.translate took longer than the search it saves)
    key = text.encode("ascii").translate(_ZEROS) if _DIGIT_FREE and text.isascii() else text
    hit = _SEEN.get(key)
    if hit is None:
        hit = keyword_re().search(text) is not None
        if len(_SEEN) >= _SEEN_TEXTS:
            _SEEN.clear()
        _SEEN[key] = hit
    return hit


def markers_re():
    """Bytes pattern of every marker and keyword: is a file's head worth reading at all?"""
    global _MARKERS_RE
    if _MARKERS_RE is None:
        words = set(STACK_MARKERS) | {w.encode() for m in log_modules() for w in m.KEYWORDS}  # type: ignore[attr-defined]
        _MARKERS_RE = re.compile(b"|".join(re.escape(w) for w in sorted(words, key=len, reverse=True)))
    return _MARKERS_RE


#: What a stretch of a file must hold to be read line by line: a few short strings that every line
#: starting a stack block or carrying a log event contains in the forms torch, py-spy, faulthandler,
#: gdb, pystack and torchrun print (``rror`` is in ``RuntimeError:``, ``error_file:``, py-spy's
#: ``Error:``; ``rocess`` in ``ProcessGroupNCCL.cpp`` of every watchdog line, ``Process N:``,
#: ``multiprocessing``; ``hread`` in ``Thread``/``thread``). Each is one ``bytes.find`` (a dozen
#: passes at memory speed instead of one regex alternation at 60 MB/s); tests/test_readers_skip.py
#: reads every fixture a line at a time with skipping on and checks nothing is lost.
ANCHORS: Tuple[bytes, ...] = (
    b"hread", b"rocess", b"Traceback", b'File "', b"rror", b"atchdog", b"Stack", b"=== Rank", b"frame #",
    b"# hangdoc", b"by peer", b"Timed out", b"ssertion", b"joining collective", b"illegal memory",
    b"xception", b"Interrupt", b"Failures:", b"Root Cause", b"by PID", b'"divergence"',
    b"nproc", b"world_sizes", b"NCCL INFO",  # world_log's statements of the world size
)


def has_anchor(data: bytes) -> bool:
    for a in ANCHORS:
        if a in data:
            return True
    return False


def markers() -> Tuple[bytes, ...]:
    return STACK_MARKERS + tuple(w.encode() for m in log_modules() for w in m.KEYWORDS)  # type: ignore[attr-defined]
