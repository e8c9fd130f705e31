"""What every console-log reader shares.

A log reader is one module named ``*_log.py`` in this package with ``FORMAT``, ``KEYWORDS`` and a
``Reader(ctx)`` class (a :class:`LineReader`); :mod:`hangdoc.readers.registry` finds them by name, so a
new log format is one new file. The stream shows a reader only the lines (prefixes already peeled)
that hold one of its ``KEYWORDS``, or every line while the reader says it is ``active`` (inside a
multi-line block such as torchrun's failure table). Readers never see a line twice and keep no
more than one block of state.
"""

from __future__ import annotations

import re
from typing import Any, List, Optional, Tuple

from hangdoc.model import LogEvent
from hangdoc.readers._base import FileContext

#: (host, rank, local_rank) of the line's writer, from its prefixes
Identity = Tuple[Optional[str], Optional[int], Optional[int]]

#: a number read from a log larger than this is not believed (the field is left unset)
MAX_NUMBER = 10 ** 15
#: characters of a line kept with its event
TEXT_CHARS = 300

# glog, as torch's C++ prints it: "E1206 18:44:12.715298746" (month, day, clock; no year)
_GLOG_TIME_RE = re.compile(r"\b[EWIF](\d{2})(\d{2}) (\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?\b")
# a date and clock anywhere near the start: "2024-05-01 10:00:00,123", "2023-01-01_10:00:00"
_ISO_TIME_RE = re.compile(r"\d{4}-(\d{2})-(\d{2})[T _](\d{2}):(\d{2}):(\d{2})(?:[.,](\d{1,9}))?")
#: the types of field values an event may share with the next event of the same line
_PLAIN = (str, int, float, bool)
_DAYS_BEFORE_MONTH = (0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334)


def number(text: Optional[str]) -> Optional[int]:
    """An integer read from a log, None when absent or past :data:`MAX_NUMBER` (never raises)."""
    if text is None or not text or len(text) > 16:
        return None
    try:
        n = int(text)
    except ValueError:
        return None
    return n if -MAX_NUMBER <= n <= MAX_NUMBER else None


def _seconds(month: str, day: str, h: str, m: str, s: str, frac: Optional[str]) -> Optional[float]:
    mo, d = int(month), int(day)
    if not (1 <= mo <= 12 and 1 <= d <= 31):
        return None
    t = (_DAYS_BEFORE_MONTH[mo - 1] + d - 1) * 86400 + int(h) * 3600 + int(m) * 60 + int(s)
    return t + (float("0." + frac) if frac else 0.0)


def line_time(text: str) -> Optional[float]:
    """Seconds since the start of the year that a log line says it was printed at, or None.

    >>> line_time("[E1206 18:44:12.715298746 ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog ...")
    29357052.715298746
    """
    m = _GLOG_TIME_RE.search(text, 0, 80)
    if m is None:
        m = _ISO_TIME_RE.search(text, 0, 80)
    if m is None:
        return None
    return _seconds(*m.groups())


class LineReader:
    """A reader of one log format in one file; the stream calls :meth:`feed` and :meth:`close`."""

    #: the stream feeds every line (not only those with a keyword) while this is True
    active = False

    def __init__(self, ctx: FileContext, format: str) -> None:
        self.ctx = ctx
        self.format = format
        self.events: List[LogEvent] = []
        #: the last event emitted: (its arguments, its given fields, the event)
        self._last: Optional[Tuple[Any, ...]] = None
        #: lines that emitted an event (one repeated is emitted once: see emit)
        self.emitted = 0

    def feed(self, lineno: int, text: str, ident: Identity) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def close(self) -> List[LogEvent]:
        return self.events

    def emit(self, kind: str, lineno: int, ident: Identity, text: str, rank: Optional[int] = None,
             pid: Optional[int] = None, host: Optional[str] = None, time: Optional[float] = None,
             **fields: Any) -> LogEvent:
        """Record one event; the line's prefix identity wins over what its message says."""
        last = self._last
        if last is not None and last[0] == (kind, ident, text, rank, pid, host, time) and last[1] == fields:
            # the same line again, right after it (a log of one line repeated): the same event, which
            # join_events would keep once anyway (the first), so it is kept once here (8 MB of one
            # "Fatal Python error" line made 160,000 events to drop there)
            self.emitted += 1
            return last[2]
        key = (kind, ident, text, rank, pid, host, time)
        given = dict(fields)
        h, r, local = ident
        if r is None and local is not None and rank is None:
            fields.setdefault("local_rank", local)
        kept = {k: v for k, v in fields.items() if v is not None}
        e = LogEvent(kind=kind, source=self.ctx.path, line=lineno, host=h if h is not None else host,
                     rank=r if r is not None else rank, pid=pid,
                     time=time if time is not None else line_time(text),
                     fields=kept, text=text.strip()[:TEXT_CHARS])
        self.events.append(e)
        self.emitted += 1
        # only events of plain values are taken for a repeat (a list in an event's fields may change
        # after: nccl_log adds a stack to its last timeout)
        self._last = (key, given, e) if all(type(v) in _PLAIN for v in kept.values()) else None
        return e
