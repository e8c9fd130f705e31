"""A 4-stage pipeline whose rebalanced stage map sends rank 2's input from rank 0 (off by one).

Stage ``i`` receives its activations from stage ``i - 1`` and sends them to ``i + 1``, micro-batch
by micro-batch. Steps 0-1 use the default map; at step 2 the load balancer moves layers and
rank 0 broadcasts the new layer split. ``upstream_of`` finds the owner of the layer before the
stage's first one with ``bisect_left`` where it needs ``bisect_right``: off by one stage exactly
when that layer is the first of its stage, i.e. when the stage before has a single layer. After
the rebalance stage 1 keeps only layer 3, so stage 2 (first layer 4) gets upstream 0. Rank 2 waits in ``recv(src=0)`` for data that rank 0 sends to rank 1; rank 3 waits in
``recv(src=2)``; ranks 0 and 1 wait in sends that nobody receives.

    torchrun --nproc-per-node 4 examples/bugs/pipeline3_wrong_peer.py
"""

import bisect
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "p2p-stall", "culprits": [2], "world": 4,
         "why": "rank 2 receives from rank 0 (wrong peer after the rebalance); its upstream stage is rank 1"}

MICRO = 4


def upstream_of(rank, starts):
    """The stage that owns the layer just before this stage's first layer (``starts``: first layer of each stage)."""
    if rank == 0:
        return None
    return bisect.bisect_left(starts, starts[rank] - 1) - 1  # the bug: bisect_right is the owner


def main():
    rank, world = init()
    starts = [0, 3, 6, 9]  # 12 layers, 3 a stage
    weight = torch.ones(16) * (rank + 1)
    for step in range(6):
        if step == 2:  # the load balancer: stage 1 is slow, it keeps one layer
            split = torch.tensor([0, 3, 4, 8]) if rank == 0 else torch.zeros(4, dtype=torch.int64)
            dist.broadcast(split, src=0)
            starts = split.tolist()
        src = upstream_of(rank, starts)
        dst = rank + 1 if rank < world - 1 else None
        if step == 2:
            hang_point(rank, " then ".join(f"{op}({k}={p})" for op, k, p in (("recv", "src", src), ("send", "dst", dst)) if p is not None))
        for mb in range(MICRO):
            act = torch.full((16,), float(mb))
            if src is not None:
                dist.recv(act, src=src)
            act = torch.tanh(act * weight)
            if dst is not None:
                dist.send(act, dst=dst)
        dist.all_reduce(weight)
        weight /= world
        progress(rank, step)
    finish()


if __name__ == "__main__":
    main()
