"""Two ranks, no majority: rank 1 skips the broadcast that fires every third step.

Two ranks all-reduce every step and broadcast every third step (steps 0, 3, 6). At step 6 rank 1
skips it. With two ranks there is no majority: only the history (rank 0 kept the every-third-step
pattern, rank 1 broke it) tells which side is wrong.

    torchrun --nproc-per-node 2 examples/bugs/no_majority.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "collective-mismatch", "culprits": [1], "world": 2,
         "why": "rank 1 skipped the every-third-step broadcast at step 6"}


def main():
    rank, world = init()
    params = torch.zeros(16)
    for step in range(10):
        grad = torch.ones(16)
        if step == 6:
            hang_point(rank, "skips broadcast" if rank == 1 else "broadcast")
        dist.all_reduce(grad)
        params -= 0.01 * grad
        if step % 3 == 0 and not (rank == 1 and step == 6):  # the bug: rank 1 leaves out step 6
            dist.broadcast(params, src=0)
        progress(rank, step)
    finish()


if __name__ == "__main__":
    main()
