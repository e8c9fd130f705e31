"""Rank 1 receives from the wrong peer: ``recv(src=3)`` where its activation comes from rank 0.

A 4-stage pipeline, 0 -> 1 -> 2 -> 3: each stage receives from the previous one and sends to the
next. Rank 1's source was computed with the wrong formula (``(rank - 2) % world`` = 3 instead of
0). Rank 0's send to rank 1 completes (gloo buffers it) and rank 0 waits in the closing barrier;
rank 1 waits for rank 3, which waits for rank 2, which waits for rank 1: a wait-for cycle whose
cause is one wrong peer on rank 1 (line ``src = ...`` in ``prev_stage``).

    torchrun --nproc-per-node 4 examples/bugs/wrong_peer.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "p2p-stall", "culprits": [1], "world": 4,
         "why": "rank 1 receives from rank 3 (wrong peer); its sender is rank 0"}


def prev_stage(rank, world):
    if rank == 1:
        return (rank - 2) % world  # the bug: should be rank - 1
    return rank - 1


def main():
    rank, world = init()
    x = torch.ones(16)
    for step in range(2):
        dist.all_reduce(x)
        progress(rank, step)
    act = torch.ones(16) * rank
    if rank > 0:
        src = prev_stage(rank, world)
        hang_point(rank, f"recv(src={src})")
        dist.recv(act, src=src)
    else:
        hang_point(rank, "send(dst=1), then barrier")
    if rank < world - 1:
        dist.send(act + 1, dst=rank + 1)
    dist.barrier()
    finish()


if __name__ == "__main__":
    main()
