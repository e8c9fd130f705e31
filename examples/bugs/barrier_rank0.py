"""A barrier under ``if rank == 0``: rank 0 waits in it, the others go on to the next all_reduce.

Rank 0 saves a checkpoint at step 3 and then, "to be safe", calls ``dist.barrier()`` inside the
``if rank == 0:`` block.

    torchrun --nproc-per-node 4 examples/bugs/barrier_rank0.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "collective-mismatch", "culprits": [0], "world": 4,
         "why": "rank 0 called barrier() inside `if rank == 0:` at step 3"}


def save_checkpoint(state):
    torch.save(state, os.devnull)
    dist.barrier()  # the bug: only rank 0 gets here


def main():
    rank, world = init()
    w = torch.ones(16)
    for step in range(8):
        if step == 3:
            hang_point(rank, "barrier" if rank == 0 else "all_reduce")
            if rank == 0:
                save_checkpoint({"w": w})
        dist.all_reduce(w)
        w /= world
        progress(rank, step)
    finish()


if __name__ == "__main__":
    main()
