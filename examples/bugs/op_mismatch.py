"""Rank 2 calls all_gather where the others call all_reduce (a different collective, same tensor).

At step 3 rank 2 runs an evaluation branch that gathers its metrics (``all_gather``) while ranks
0, 1, 3 all-reduce theirs.

    torchrun --nproc-per-node 4 examples/bugs/op_mismatch.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "collective-mismatch", "culprits": [2], "world": 4,
         "why": "rank 2 called all_gather where ranks 0, 1, 3 called all_reduce (step 3)"}


def main():
    rank, world = init()
    for step in range(8):
        metrics = torch.ones(32) * rank
        if step == 3:
            hang_point(rank, "all_gather" if rank == 2 else "all_reduce")
        if rank == 2 and step == 3:
            out = [torch.empty(32) for _ in range(world)]
            dist.all_gather(out, metrics)  # the bug
        else:
            dist.all_reduce(metrics)
        progress(rank, step)
    finish()


if __name__ == "__main__":
    main()
