"""Ranks 1 and 4 of 6 each skip the token-count all-reduce at step 3 (a padding-only batch).

Every step all-reduces the gradients, then all-reduces the (loss sum, token count) pair for
logging, but only ``if tokens > 0``: a rank whose batch is all padding has "nothing to report";
then rank 0 broadcasts its stop flag (early stopping). At step 3 the batches of ranks 1 and 4 are
all padding: both skip the token all-reduce and wait in the broadcast of the stop flag; ranks 0,
2, 3, 5 wait in the token all-reduce.

    torchrun --nproc-per-node 6 examples/bugs/two_culprits_6.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "collective-mismatch", "culprits": [1, 4], "world": 6,
         "why": "ranks 1 and 4 skipped the token-count all_reduce of step 3 (padding-only batches, `if tokens > 0`)"}

PAD = 0


def batch_for(rank, step):
    if step == 3 and rank in (1, 4):
        return torch.full((4, 12), PAD)  # the tail of two shards: padding only
    return torch.randint(1, 100, (4, 12))


def main():
    rank, world = init()
    torch.manual_seed(rank)
    w = torch.zeros(100)
    for step in range(8):
        batch = batch_for(rank, step)
        mask = batch != PAD
        grad = torch.bincount(batch[mask], minlength=100).float()
        if step == 3:
            hang_point(rank, "skips token all_reduce, broadcast" if rank in (1, 4) else "token all_reduce")
        dist.all_reduce(grad)
        w -= 0.01 * grad
        tokens = int(mask.sum())
        if tokens > 0:  # the bug: the all_reduce below must run on every rank
            stats = torch.tensor([float(grad.sum()), float(tokens)])
            dist.all_reduce(stats)
        stop = torch.tensor([float(rank == 0 and float(w.norm()) > 1e6)])
        dist.broadcast(stop, src=0)
        if stop.item():
            break
        progress(rank, step)
    finish()


if __name__ == "__main__":
    main()
