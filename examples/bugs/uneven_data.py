"""Uneven data: rank 3's shard has 3 batches, the others' 6; rank 3 leaves the loop first.

Each rank iterates over its own shard and all-reduces the gradients per batch; rank 3 runs out of
batches after 3 steps and goes to the end-of-epoch barrier while ranks 0-2 all-reduce batch 4.

    torchrun --nproc-per-node 4 examples/bugs/uneven_data.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "collective-mismatch", "culprits": [3], "world": 4,
         "why": "rank 3 ran out of data after 3 batches and waits in the epoch-end barrier"}


def shard(rank):
    n = 3 if rank == 3 else 6  # the bug: shards of unequal length
    return [torch.ones(8) * i for i in range(n)]


def main():
    rank, world = init()
    for step, batch in enumerate(shard(rank)):
        if step == 2:
            hang_point(rank, "barrier after 3 batches" if rank == 3 else "all_reduce batch 4")
        dist.all_reduce(batch)
        progress(rank, step)
    dist.barrier()  # end of epoch
    finish()


if __name__ == "__main__":
    main()
