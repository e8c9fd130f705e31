"""The NCCL ProcessGroup watchdog's lines, torch 1.10 to 2.13.

What the watchdog prints when a collective does not finish in time, in each generation::

    [E ProcessGroupNCCL.cpp:737] [Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=469508, OpType=ALLREDUCE, Timeout(ms)=1800000) ran for 1802212 milliseconds before timing out.
    [rank0]:[E321 02:07:08.408271257 ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1580, OpType=ALLREDUCE, NumelIn=466119168, NumelOut=466119168, Timeout(ms)=600000) ran for 600060 milliseconds before timing out.
    [rank0]:[E321 02:07:08.465150152 ProcessGroupNCCL.cpp:1664] [PG 1 Rank 0] Exception (either an error or timeout) detected by watchdog at work: 1580, last enqueued NCCL work: 1582, last completed NCCL work: 1579.
    [rank0]:[E709 17:05:38.162814866 ProcessGroupNCCL.cpp:2271] [PG ID 0 PG GUID 0(default_pg) Rank 0]  failure detected by watchdog at work sequence id: 20585 PG status: last enqueued work: 20589, last completed work: 20584

and the heartbeat monitor's (a dump signal from another rank, a watchdog that got stuck).

Events: ``timeout`` (group, seq, op, numel_in, numel_out, timeout_ms, ran_ms), ``watchdog-state``
(group, failed, last_enqueued, last_completed), ``heartbeat`` (what, from_rank, stuck_s). The
``Rank N`` inside the message is the rank *in its process group*: it is taken as the global rank
only for the default group (or a line that names none) and when no prefix says otherwise.

    >>> from hangdoc.readers import read_text
    >>> job = read_text("[rank3]:[E1206 18:44:13.275158817 ProcessGroupNCCL.cpp:607] [Rank 3] Watchdog caught collective "
    ...                 "operation timeout: WorkNCCL(SeqNum=7753, OpType=_REDUCE_SCATTER_BASE, NumelIn=544997376, "
    ...                 "NumelOut=68124672, Timeout(ms)=600000) ran for 600089 milliseconds before timing out.\\n")
    >>> e = job.events[0]
    >>> (e.kind, e.rank, e.fields["seq"], e.fields["op"], e.fields["numel_in"])
    ('timeout', 3, 7753, '_REDUCE_SCATTER_BASE', 544997376)
"""

from __future__ import annotations

import re
from typing import Optional, Tuple

from hangdoc.readers._logbase import Identity, LineReader, number

FORMAT = "nccl-watchdog"
KEYWORDS = ("Watchdog caught", "last enqueued", "Last enqueued", "dump signal", "global timeout", "watchdog got stuck",
            "Heartbeat monitor", "watchdog at work", "Stack trace of the failed collective",
            "terminated with exception")
#: keywords with no anchor of their own (registry.ANCHORS), and the anchor their lines carry: torch
#: prints them through glog with "ProcessGroupNCCL.cpp" in the head (a hard-wrapped line's rest is
#: read while the reader waits for it, active)
LINE_ANCHORS = {"last enqueued": "rocess", "Last enqueued": "rocess", "dump signal": "rocess",
                "global timeout": "rocess", "Heartbeat monitor": "rocess"}

#: frames kept of a failed collective's stack
MAX_FRAMES = 128

# "[Rank 0]", "[PG 1 Rank 0]", "[PG 0 (default_pg) Rank 7]", "[PG ID 0 PG GUID 0(default_pg) Rank 1]"
_WHO_RE = re.compile(r"\[(?:PG (?:ID )?(\d{1,9})(?: PG GUID \d{1,9})? ?(?:\(([^()\[\]]{0,128})\))? )?Rank (\d{1,9})\]")
_TIMEOUT_RE = re.compile(
    r"Watchdog caught collective operation timeout: WorkNCCL\(SeqNum=(\d{1,20}), OpType=(\w{1,64})"
    r"(?:, NumelIn=(-?\d{1,20}), NumelOut=(-?\d{1,20}))?(?:, Timeout\(ms\)=(\d{1,20}))?\)"
    r"(?: ran for (\d{1,20}) milliseconds)?")
_STATE_RE = re.compile(
    r"(?:detected by watchdog at work(?: sequence id)?|Timeout at NCCL work):? (\d{1,20})[ ,]"
    r"[^\n]{0,60}?last enqueued (?:NCCL )?work: (-?\d{1,20}),(?: last started (?:NCCL )?work: -?\d{1,20},)?"
    r" last completed (?:NCCL )?work: (-?\d{1,20})")
_DUMP_FROM_RE = re.compile(r"dump signal (?:due to a collective timeout )?from (?:rank (\d{1,9})|this local rank)")
_STUCK_RE = re.compile(r"watchdog got stuck for (\d{1,9}) seconds")
# torch 2.4-2.5: "Received a dump signal ... from this local rank ... Last enqueued NCCL work: 9387, last completed NCCL work: 9386."
_LAST_RE = re.compile(r"[Ll]ast enqueued (?:NCCL )?work: (-?\d{1,20}), last completed (?:NCCL )?work: (-?\d{1,20})")
# "[PG 2 Rank 1] Process group watchdog thread terminated with exception: CUDA error: an illegal memory access ..."
_TERMINATED_RE = re.compile(r"(?:watchdog|NCCL) (?:thread )?terminated with exception: ?(.{1,400})")
#: a watchdog line cut by a hard-wrapped paste is joined with at most this many following lines
MAX_JOIN = 2

# Flight Recorder's stack of the collective that failed, printed under the watchdog's lines:
# "#2 train from /work/examples/gpu/nccl_skip_broadcast.py:18"
_FR_FRAME_RE = re.compile(r"#(\d{1,4}) (\S{1,512}) from (\S{1,4096}):(\d{1,9})\s*$")


def _who(text: str, end: int) -> Tuple[Optional[str], Optional[int], Optional[int]]:
    """(group, rank in the message, PG id) of the ``[... Rank N]`` nearest before ``end``."""
    best = None
    for m in _WHO_RE.finditer(text, 0, end):
        best = m
    if best is None:
        m = _WHO_RE.search(text, end)
        best = m
    if best is None:
        return None, None, None
    pg_id, name, rank = best.group(1), best.group(2), best.group(3)
    pid = number(pg_id) if pg_id is not None else None
    if name:
        group: Optional[str] = name
    elif pid is not None:
        group = "default_pg" if pid == 0 else f"pg{pid}"
    else:
        group = None
    return group, number(rank), pid


def _global_rank(group: Optional[str], rank: Optional[int]) -> Optional[int]:
    return rank if group in (None, "default_pg") else None


def _user_site(frames):
    """The innermost frame outside torch: where the user's code issued the collective."""
    for fn, file, line in frames:
        if "/torch/" not in file and not file.startswith("torch/"):
            return f"{fn} ({file}:{line})"
    return None


class Reader(LineReader):
    def __init__(self, ctx) -> None:
        super().__init__(ctx, FORMAT)
        self.in_stack = False  # reading Flight Recorder's stack of a failed collective
        self.stack_of = None  # the rank it belongs to
        self.frames = []
        # a watchdog line a paste wrapped at the terminal's width: (lineno, text, ident, joins)
        self.pending = None
        # (kind, None) and (kind, rank, True): the newest timeout / watchdog-state event, overall and
        # of one rank, over self.events[:self.indexed]
        self.newest = {}
        self.indexed = 0

    def _end_stack(self) -> None:
        self.in_stack = self.active = False
        frames, self.frames = self.frames, []
        if not frames:
            return
        # the stack belongs to the newest timeout (and watchdog state) of that writer; the newest of
        # each is kept as events come (a scan back over every event per stack was quadratic on a
        # log of thousands of stacks)
        newest = self.newest
        for e in self.events[self.indexed:]:
            if e.kind in ("timeout", "watchdog-state"):
                newest[(e.kind, None)] = newest[(e.kind, e.rank, True)] = e
        self.indexed = len(self.events)
        for kind in ("timeout", "watchdog-state"):
            e = newest.get((kind, None) if self.stack_of is None else (kind, self.stack_of, True))
            if e is not None:
                e.fields.setdefault("stack", [f"{fn} ({file}:{line})" for fn, file, line in frames])
                site = _user_site(frames)
                if site is not None:
                    e.fields.setdefault("call_site", site)

    def feed(self, lineno: int, text: str, ident: Identity) -> None:
        if self.pending is not None:
            first, head, hid, joins = self.pending
            self.pending = None
            self.active = self.in_stack
            # a wrapped line's rest carries no rank (a launcher's host prefix may still be on it)
            if (ident[1] is None and ident[2] is None) or ident == hid:
                if self._line(first, head + text, hid, joins + 1):
                    return
            # not its continuation: the cut line says what it can; this line is read afresh
            self._line(first, head, hid, MAX_JOIN)
        if self.in_stack:
            m = _FR_FRAME_RE.match(text.strip())
            if m is not None:
                if len(self.frames) < MAX_FRAMES:
                    self.frames.append((m.group(2), m.group(3), m.group(4)))
                return
            self._end_stack()
        self._line(lineno, text, ident, 0)

    def _line(self, lineno: int, text: str, ident: Identity, joins: int) -> bool:
        """Read one (possibly joined) line; True when it said something."""
        wrapped_signal = ("dump signal" in text and "nqueued" not in text and len(text) >= 100
                          and not text.rstrip().endswith("."))
        if joins < MAX_JOIN and ("Watchdog caught" in text or "enqueued" in text or "watchdog at work" in text
                                 or wrapped_signal) \
                and _TIMEOUT_RE.search(text) is None and _STATE_RE.search(text) is None and \
                (_LAST_RE.search(text) is None or text.rstrip().endswith(",")):
            # cut mid-way (no closing of its numbers): wait for the rest of it
            self.pending = (lineno, text, ident, joins)
            self.active = True
            return True
        before = self.emitted
        self._read(lineno, text, ident)
        return self.emitted > before

    def _read(self, lineno: int, text: str, ident: Identity) -> None:
        if "Stack trace of the failed collective" in text:
            if "not found" not in text:
                self.active = self.in_stack = True
                self.stack_of = ident[1]
                if self.stack_of is None:
                    self.stack_of = _who(text, len(text))[1]
            return
        m = _TERMINATED_RE.search(text)
        if m is not None and "Watchdog caught" not in m.group(1) and not re.match(r"\s*\[(?:PG|Rank) ", m.group(1)):
            # the watchdog died of an error of its own rank (a CUDA fault), not of a timeout
            group, grank, _ = _who(text, m.start())
            self.emit("exception", lineno, ident, text, rank=_global_rank(group, grank), exc=m.group(1).strip(),
                      via="nccl-watchdog")
            return
        m = _TIMEOUT_RE.search(text)
        if m is not None:
            group, grank, _ = _who(text, m.start())
            self.emit("timeout", lineno, ident, text, rank=_global_rank(group, grank), group=group,
                      group_rank=grank, seq=number(m.group(1)), op=m.group(2), numel_in=number(m.group(3)),
                      numel_out=number(m.group(4)), timeout_ms=number(m.group(5)), ran_ms=number(m.group(6)))
            return
        m = _STATE_RE.search(text)
        if m is not None:
            group, grank, _ = _who(text, m.start())
            self.emit("watchdog-state", lineno, ident, text, rank=_global_rank(group, grank), group=group,
                      group_rank=grank, failed=number(m.group(1)), last_enqueued=number(m.group(2)),
                      last_completed=number(m.group(3)))
            return
        m = _LAST_RE.search(text)
        if m is not None and ("dump signal" in text or "global timeout" in text):
            group, grank, _ = _who(text, m.start())
            last, done = number(m.group(1)), number(m.group(2))
            # the collective it waits in is the first one not completed
            self.emit("watchdog-state", lineno, ident, text, rank=_global_rank(group, grank), group=group,
                      group_rank=grank, failed=done + 1 if done is not None else None, inferred=True,
                      last_enqueued=last, last_completed=done)
            return
        m = _DUMP_FROM_RE.search(text)
        if m is not None:
            group, grank, _ = _who(text, m.start())
            self.emit("heartbeat", lineno, ident, text, rank=_global_rank(group, grank), what="dump-signal",
                      from_rank=number(m.group(1)) if m.group(1) else None)
            return
        m = _STUCK_RE.search(text)
        if m is not None:
            group, grank, _ = _who(text, m.start())
            self.emit("heartbeat", lineno, ident, text, rank=_global_rank(group, grank), what="watchdog-stuck",
                      stuck_s=number(m.group(1)))
            return
        if "global timeout" in text or "Heartbeat monitor timed out" in text:
            group, grank, _ = _who(text, len(text))
            self.emit("heartbeat", lineno, ident, text, rank=_global_rank(group, grank),
                      what="global-timeout" if "global timeout" in text else "monitor-timeout")

    def close(self):
        if self.pending is not None:
            first, head, hid, _ = self.pending
            self.pending = None
            self._line(first, head, hid, MAX_JOIN)
        self._end_stack()
        return self.events
