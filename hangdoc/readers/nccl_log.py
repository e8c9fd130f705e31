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
KEYWORDS = ("Watchdog caught", "last enqueued", "dump signal", "global timeout", "got stuck",
            "Heartbeat monitor", "watchdog at work", "Stack trace of the failed collective")

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
        self.stack_of = None  # the rank whose failed collective's stack is being read
        self.frames = []

    def _end_stack(self) -> None:
        self.active = False
        frames, self.frames = self.frames, []
        if not frames:
            return
        # the stack belongs to the newest timeout (and watchdog state) of that writer
        done = set()
        for e in reversed(self.events):
            if e.kind in ("timeout", "watchdog-state") and e.kind not in done and \
                    (self.stack_of is None or e.rank == self.stack_of):
                done.add(e.kind)
                e.fields.setdefault("stack", [f"{fn} ({file}:{line})" for fn, file, line in frames])
                site = _user_site(frames)
                if site is not None:
                    e.fields.setdefault("call_site", site)

    def feed(self, lineno: int, text: str, ident: Identity) -> None:
        if self.active:
            m = _FR_FRAME_RE.match(text.strip())
            if m is not None:
                if len(self.frames) < MAX_FRAMES:
                    self.frames.append((m.group(2), m.group(3), m.group(4)))
                return
            self._end_stack()
        if "Stack trace of the failed collective" in text:
            if "not found" not in text:
                self.active = True
                self.stack_of = ident[1]
                if self.stack_of is None:
                    self.stack_of = _who(text, len(text))[1]
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
        self._end_stack()
        return self.events
