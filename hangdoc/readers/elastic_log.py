"""torchrun's (torch.distributed.elastic's) account of failed ranks.

The ``ChildFailedError`` table, one entry per failed rank::

    Failures:
    [1]:
      time      : 2024-03-21_02:17:08
      host      : gpu-node-1
      rank      : 1 (local_rank: 1)
      exitcode  : -6 (pid: 80747)
      error_file: <N/A>
      traceback : Signal 6 (SIGABRT) received by PID 80747
    ------------------------------------------------------------
    Root Cause (first observed failure):
    [0]:
      time      : 2024-03-21_02:17:05
      host      : gpu-node-1
      rank      : 0 (local_rank: 0)
      exitcode  : 1 (pid: 80746)
      error_file: /tmp/torchelastic_x/none_y/attempt_0/0/error.json
      traceback : Traceback (most recent call last):
        File "/w/train.py", line 12, in main
          loss.backward()
      RuntimeError: CUDA out of memory.

and the agent's one-liners (``failed (exitcode: -6) local_rank: 0 (pid: 2342) of binary: ...``).
Events: ``exit`` (host, rank, pid, ``local_rank``, ``exitcode``, ``signal``, ``root``: the table's
"Root Cause" entry, ``exc``/``at`` of an entry's traceback) and ``exception`` for an entry whose
traceback ends in one. "Root Cause" is only the first failure torchrun *observed*: the rules
weigh it against the times of everything else.

    >>> from hangdoc.readers import read_text
    >>> job = read_text("Root Cause (first observed failure):\\n[0]:\\n  time      : 2024-03-21_02:17:05\\n"
    ...                 "  host      : n1\\n  rank      : 2 (local_rank: 0)\\n  exitcode  : -6 (pid: 80746)\\n"
    ...                 "  error_file: <N/A>\\n  traceback : Signal 6 (SIGABRT) received by PID 80746\\n" + "=" * 20 + "\\n")
    >>> e = job.events[0]
    >>> (e.kind, e.host, e.rank, e.pid, e.fields["exitcode"], e.fields["signal"], e.fields["root"])
    ('exit', 'n1', 2, 80746, -6, 'SIGABRT', True)
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional

from hangdoc.readers._logbase import Identity, LineReader, line_time, number

FORMAT = "torchelastic"
KEYWORDS = ("ChildFailedError", "Failures:", "Root Cause", "failed (exitcode", "received by PID", "closing signal", "]:")
#: keywords with no anchor of their own (registry.ANCHORS), and the anchor their lines carry: the
#: agent logs them as torch.distributed.elastic.multiprocessing.api ("multip*rocess*ing")
LINE_ANCHORS = {"failed (exitcode": "rocess", "closing signal": "rocess"}
#: keywords read only inside a failure table that an anchored line opened ("Failures:", "Root
#: Cause"): the reader is active there, so no stretch of it is skipped
INNER_KEYWORDS = ("]:",)

#: lines of one entry's traceback kept
MAX_TB_LINES = 400

_ENTRY_RE = re.compile(r"\[(\d{1,9})\]:\s{0,8}$")
_FIELD_RE = re.compile(r"  (time|host|rank|exitcode|error_file|traceback) {0,16}: ?")
_RANK_RE = re.compile(r"(-?\d{1,9})(?: \(local_rank: (\d{1,9})\))?")
_EXIT_RE = re.compile(r"(-?\d{1,9})(?: \(pid: (\d{1,9})\))?")
_SIGNAL_RE = re.compile(r"Signal (\d{1,3}) \((SIG[A-Z0-9]{1,10})\) received by PID (\d{1,9})")
_AGENT_RE = re.compile(r"failed \(exitcode: (-?\d{1,9})\) local_rank: (\d{1,9}) \(pid: (\d{1,9})\)")
_TB_FILE_RE = re.compile(r'File "([^"]{1,4096})", line (\d{1,9})')
_CLOSING_RE = re.compile(r"Sending process (\d{1,9}) closing signal (SIG[A-Z]{1,8})")
_SIGNALS = {1: "SIGHUP", 2: "SIGINT", 6: "SIGABRT", 7: "SIGBUS", 9: "SIGKILL", 11: "SIGSEGV", 15: "SIGTERM"}


_EXC_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]{0,200}(?:Error|Exception|Exit|Interrupt|Failure|Fault)\b")


def _exception_line(lines: List[str]) -> Optional[str]:
    """The exception a traceback block ends in: its last ``Name: message`` line (not a caret line,
    a source line or a frame)."""
    for x in reversed(lines):
        t = x.strip()
        if not t or set(t) <= set("^~ ") or t.startswith("File "):
            continue
        if _EXC_RE.match(t):
            return t
    return None


class Reader(LineReader):
    def __init__(self, ctx) -> None:
        super().__init__(ctx, FORMAT)
        self.section = ""  # "failures" | "root"
        self.entry: Optional[Dict[str, object]] = None
        self.entry_line = 0
        self.ident: Identity = (None, None, None)
        self.tb: Optional[List[str]] = None
        self.alone = False  # the table says "<NO_OTHER_FAILURES>"
        self.entry_text: Optional[str] = None  # the last line read as an entry's head ("[7]:")

    def feed(self, lineno: int, text: str, ident: Identity) -> None:
        if not self.active:
            self._outside(lineno, text, ident)
            return
        if text.startswith("  "):
            m = _FIELD_RE.match(text)
            if m is not None and self.entry is not None:
                self.tb = None
                key, value = m.group(1), text[m.end():].strip()
                self.entry[key] = value
                if key == "traceback":
                    self.tb = [value]
                return
            if self.tb is not None:
                if len(self.tb) < MAX_TB_LINES:
                    self.tb.append(text)
                    self.entry["traceback_lines"] = self.tb  # type: ignore[index]
                return
            if not text.strip():
                return
        if text == self.entry_text or _ENTRY_RE.match(text) is not None:
            self.entry_text = text  # a run of "[1]:" lines is matched once
            self._end_entry()
            self.entry, self.entry_line, self.ident = {}, lineno, ident
            return
        stripped = text.strip()
        if not stripped or stripped.startswith("-----") or stripped.startswith("<NO_OTHER_FAILURES>"):
            self.tb = None
            if stripped.startswith("<NO_OTHER_FAILURES>"):
                self.alone = True
            return
        if stripped.startswith("Root Cause"):
            self._end_entry()
            self.section = "root"
            return
        if stripped.startswith("Failures:"):
            self._end_entry()
            self.section = "failures"
            return
        if self.entry is not None and self.tb is not None and stripped and not stripped.startswith("====="):
            # a traceback line a prefix ate the indentation of
            if len(self.tb) < MAX_TB_LINES:
                self.tb.append(text)
                self.entry["traceback_lines"] = self.tb
            return
        # "=====" or anything else: the table is over
        self._end_entry()
        self.active = False
        if not stripped.startswith("====="):
            self._outside(lineno, text, ident)

    def _outside(self, lineno: int, text: str, ident: Identity) -> None:
        s = text.strip()
        if s.startswith("Failures:") or s.startswith("Root Cause"):
            self.active = True
            self.section = "root" if s.startswith("Root Cause") else "failures"
            self.entry = None
            return
        if _ENTRY_RE.match(text) is not None:
            # a paste that starts inside the table: "[7]:" then its fields
            self.active, self.section = True, "failures"
            self.entry, self.entry_line, self.ident = {}, lineno, ident
            return
        m = _AGENT_RE.search(text)
        if m is not None:
            code = number(m.group(1))
            self.emit("exit", lineno, ident, text, pid=number(m.group(3)), exitcode=code,
                      signal=_SIGNALS.get(-code) if code is not None and code < 0 else None,
                      local_rank=number(m.group(2)), root=False)
            return
        m = _CLOSING_RE.search(text)
        if m is not None:
            # the agent tears the healthy workers down after one failed: their ends are fallout
            self.emit("exit", lineno, ident, text, pid=number(m.group(1)), signal=m.group(2), by_agent=True, root=False)
            return
        m = _SIGNAL_RE.search(text)
        if m is not None and "ChildFailedError" not in text:
            self.emit("exit", lineno, ident, text, pid=number(m.group(3)), signal=m.group(2), root=False)

    def close(self):
        self._end_entry()
        return self.events

    def _end_entry(self) -> None:
        entry, self.entry, self.tb = self.entry, None, None
        if not entry:
            return
        rank = local = pid = code = None
        m = _RANK_RE.match(str(entry.get("rank", "")))
        if m is not None:
            rank, local = number(m.group(1)), number(m.group(2)) if m.group(2) else None
            if rank is not None and rank < 0:
                rank = None
        m = _EXIT_RE.match(str(entry.get("exitcode", "")))
        if m is not None:
            code, pid = number(m.group(1)), number(m.group(2)) if m.group(2) else None
        tb_lines = [str(x) for x in entry.get("traceback_lines", [entry.get("traceback", "")]) or []]  # type: ignore[union-attr]
        tb_lines = [x for x in tb_lines if x.strip()]
        signal = None
        sm = _SIGNAL_RE.search(tb_lines[0]) if tb_lines else None
        if sm is not None:
            signal = sm.group(2)
            pid = pid or number(sm.group(3))
        elif code is not None and code < 0:
            signal = _SIGNALS.get(-code, f"signal {-code}")
        exc = at = None
        if tb_lines and tb_lines[0].startswith("Traceback"):
            exc = _exception_line(tb_lines[1:])
            files = [m2 for m2 in (_TB_FILE_RE.search(x) for x in tb_lines) if m2 is not None]
            if files:
                at = f"{files[-1].group(1)}:{files[-1].group(2)}"
        host = str(entry["host"]) if entry.get("host") else None
        t = line_time(str(entry.get("time", "")))
        text = f"rank {rank} exitcode {code}" + (f" ({signal})" if signal else "") + (f": {exc}" if exc else "")
        self.emit("exit", self.entry_line, self.ident, text, rank=rank, pid=pid, host=host, time=t, exitcode=code,
                  signal=signal, local_rank=local, root=self.section == "root", exc=exc, at=at,
                  alone=self.alone or None,
                  error_file=entry.get("error_file") if entry.get("error_file") not in (None, "<N/A>") else None)
        if exc is not None:
            self.emit("exception", self.entry_line, self.ident, exc, rank=rank, pid=pid, host=host, time=t,
                      exc=exc, at=at, via="torchelastic")
