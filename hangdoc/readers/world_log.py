"""The job's world size, where a console log states it: torchrun's command line, the rendezvous
result of its agent, NCCL's communicator lines.

    $ /opt/torch/.venv/bin/python3 -m torch.distributed.run --nproc-per-node 4 --master-addr 127.0.0.1 ... slow_checkpoint.py
    [INFO] 2021-09-13 22:17:26,651 run: Running torch.distributed.run with args: [..., '--nnodes=2', '--nproc_per_node=2', ...]
      global_world_sizes=[4, 4, 4, 4]
    h100-...:1906:1906 [0] NCCL INFO comm 0x71379e0 rank 0 nranks 8 cudaDev 0 busId 18000 - Abort COMPLETE

One event ``world-size`` per statement: ``world_size``, ``how`` (``torchrun``: nodes times
processes a node, from a torchrun command line whose node count is fixed; ``rendezvous``: torchrun's
agent; ``nccl``: one communicator's size, at most the world's). A torchrun command line without
``--nnodes`` runs one node (torchrun's default); a node count that is a range (``1:4``) or a
process count that is not a number (``gpu``) says nothing. The log rules take the largest size
stated (:func:`hangdoc.analysis.log_rules.stated_world_size`), so a subgroup's communicator never
lowers it. Not read: "Using nproc_per_node=2." and the launch config's ``nproc_per_node : 2``
(they name no node count), a printed ``WORLD_SIZE`` (each keyword costs the skipping of big logs
an anchor, see registry.ANCHORS, and no real log here shows one).

    >>> from hangdoc.readers import read_text
    >>> job = read_text("$ torchrun --nnodes=2 --nproc-per-node 4 train.py\\n")
    >>> [(e.kind, e.fields["world_size"], e.fields["how"]) for e in job.events]
    [('world-size', 8, 'torchrun')]
"""

from __future__ import annotations

import re
from typing import Optional

from hangdoc.bounds import MAX_RANKS
from hangdoc.readers._logbase import Identity, LineReader, number

FORMAT = "world-size"
KEYWORDS = ("nproc", "world_sizes=", "NCCL INFO")

_LAUNCHER_RE = re.compile(r"\b(?:torchrun|torch\.distributed\.(?:run|launch))\b")
_NPROC_RE = re.compile(r"--nproc[-_]per[-_]node(?:=| {1,8})'?(\w{1,16})")
_NNODES_RE = re.compile(r"--nnodes(?:=| {1,8})'?(\d{1,7})(?::(\d{1,7}))?")
_RDZV_RE = re.compile(r"\bglobal_world_sizes=\[(\d{1,7})")
_NCCL_RE = re.compile(r"\bn[rR]anks (\d{1,7})\b")


def _size(n: Optional[int]) -> Optional[int]:
    return n if n is not None and 1 <= n <= MAX_RANKS else None


class Reader(LineReader):
    def __init__(self, ctx) -> None:
        super().__init__(ctx, FORMAT)

    def _emit(self, lineno: int, ident: Identity, text: str, n: Optional[int], how: str) -> None:
        n = _size(n)
        if n is not None:
            # the line's writer is not the subject: a world size is the job's, not a rank's
            self.emit("world-size", lineno, (ident[0], None, None), text, world_size=n, how=how)

    def feed(self, lineno: int, text: str, ident: Identity) -> None:
        if "nproc" in text and _LAUNCHER_RE.search(text):
            m = _NPROC_RE.search(text)
            per = number(m.group(1)) if m is not None and m.group(1).isdigit() else None
            nodes: Optional[int] = 1  # torchrun's default --nnodes is 1:1
            m2 = _NNODES_RE.search(text)
            if m2 is not None:
                lo, hi = number(m2.group(1)), number(m2.group(2)) if m2.group(2) else number(m2.group(1))
                nodes = lo if lo == hi else None
            if per is not None and nodes is not None:
                self._emit(lineno, ident, text, per * nodes, "torchrun")
            return
        m = _RDZV_RE.search(text)
        if m is not None:
            self._emit(lineno, ident, text, number(m.group(1)), "rendezvous")
            return
        if "NCCL" in text:
            m = _NCCL_RE.search(text)
            if m is not None:
                self._emit(lineno, ident, text, number(m.group(1)), "nccl")
                return
