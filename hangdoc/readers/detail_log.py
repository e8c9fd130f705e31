"""``TORCH_DISTRIBUTED_DEBUG=DETAIL``'s verdicts: mismatched collectives, a failed monitored barrier.

    RuntimeError: Detected mismatch between collectives on ranks. Rank 0 is running collective: CollectiveFingerPrint(SequenceNumber=12, OpType=BROADCAST, TensorShape=[10], TensorDtypes=Float, TensorDeviceTypes=TensorOptions(dtype=float (default), device=cpu, ...)), but Rank 1 is running collective: CollectiveFingerPrint(SequenceNumber=12, OpType=ALLREDUCE, TensorShape=[10], ...).
    RuntimeError: Ranks 1, 3 failed to pass monitoredBarrier in 10000 ms

Events: ``mismatch`` (``ranks``: the two ranks compared, ``sides``: each one's seq, op, shape and
dtype as printed) and ``barrier`` (``ranks`` that did not reach it, ``timeout_ms``).

    >>> from hangdoc.readers import read_text
    >>> e = read_text("RuntimeError: Detected mismatch between collectives on ranks. Rank 0 is running collective: "
    ...               "CollectiveFingerPrint(SequenceNumber=3, OpType=BROADCAST, TensorShape=[4], TensorDtypes=Float), "
    ...               "but Rank 1 is running collective: CollectiveFingerPrint(SequenceNumber=3, OpType=ALLREDUCE, "
    ...               "TensorShape=[4], TensorDtypes=Float).\\n").events[0]
    >>> (e.kind, e.rank, e.fields["ranks"], [s["op"] for s in e.fields["sides"]])
    ('mismatch', 0, [0, 1], ['BROADCAST', 'ALLREDUCE'])
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional

from hangdoc.readers._logbase import Identity, LineReader, number

FORMAT = "detail"
KEYWORDS = ("Detected mismatch between collectives", "monitoredBarrier", "Error when verifying shape tensors")
#: keywords with no anchor of their own (registry.ANCHORS), and the anchor their lines carry: DETAIL's
#: errors are raised exceptions ("RuntimeError: ", "DistBackendError: ")
LINE_ANCHORS = {"Detected mismatch between collectives": "rror", "monitoredBarrier": "rror"}

_SIDE_RE = re.compile(r"Rank (\d{1,9}) is running (?:inconsistent )?collective: CollectiveFingerPrint\(")
_FIELD_RES = {
    "seq": re.compile(r"SequenceNumber=(\d{1,20})"),
    "op": re.compile(r"OpType=(\w{1,64})"),
    "shape": re.compile(r"TensorShape=\[([\d, ]{0,256})\]"),
    "dtype": re.compile(r"TensorDtypes=(\w{1,64})"),
}
_BARRIER_RE = re.compile(r"Ranks? ([\d, ]{1,4096}) failed to pass monitoredBarrier in (\d{1,20}) ms")
_BARRIER_PEER_RE = re.compile(r"waiting for send/recv from rank (\d{1,9})")
_SHAPE_RE = re.compile(r"Error when verifying shape tensors for collective (\w{1,64}) on rank (\d{1,9})")
_DIFFER_RE = re.compile(r"Collectives differ in the following aspects: ?(.{0,200})")


def _side(text: str) -> Dict[str, object]:
    out: Dict[str, object] = {}
    for k, rx in _FIELD_RES.items():
        m = rx.search(text)
        if m is not None:
            out[k] = number(m.group(1)) if k == "seq" else m.group(1).strip()
    return out


def _ranks(text: str) -> List[int]:
    out = []
    for part in text.split(",")[:4096]:
        n = number(part.strip())
        if n is not None and n >= 0:
            out.append(n)
    return out


class Reader(LineReader):
    def __init__(self, ctx) -> None:
        super().__init__(ctx, FORMAT)

    def feed(self, lineno: int, text: str, ident: Identity) -> None:
        if "Detected mismatch between collectives" in text:
            starts = list(_SIDE_RE.finditer(text))
            sides = []
            ranks: List[int] = []
            for i, m in enumerate(starts[:2]):
                end = starts[i + 1].start() if i + 1 < len(starts) else len(text)
                side = _side(text[m.end():end])
                r = number(m.group(1))
                side["rank"] = r
                sides.append(side)
                if r is not None:
                    ranks.append(r)
            differ = _DIFFER_RE.search(text)
            self.emit("mismatch", lineno, ident, text, rank=ranks[0] if ranks else None, ranks=ranks, sides=sides,
                      differ=differ.group(1).strip() if differ else None)
            return
        m = _SHAPE_RE.search(text)
        if m is not None:
            # DETAIL's shape check: this rank's input shape differs from some other rank's
            self.emit("mismatch", lineno, ident, text, rank=number(m.group(2)), ranks=[], sides=[], op=m.group(1),
                      check="shape")
            return
        m = _BARRIER_RE.search(text)
        if m is not None:
            self.emit("barrier", lineno, ident, text, ranks=_ranks(m.group(1)), timeout_ms=number(m.group(2)))
            return
        m = _BARRIER_PEER_RE.search(text)
        if m is not None and "monitoredBarrier" in text:
            peer: Optional[int] = number(m.group(1))
            self.emit("barrier", lineno, ident, text, ranks=[peer] if peer is not None else [])
