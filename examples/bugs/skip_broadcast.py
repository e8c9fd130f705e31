"""Rank 2 skips a broadcast: the others wait for it, it waits in the next step's all_reduce.

Every step is ``all_reduce`` (gradients) then ``broadcast`` (parameters from rank 0); at step 3 rank
2 takes ``if rank == 2 and step == 3: continue`` and jumps over the broadcast.

    torchrun --nproc-per-node 4 examples/bugs/skip_broadcast.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "collective-mismatch", "culprits": [2], "world": 4,
         "why": "rank 2 skipped the broadcast of step 3"}


def main():
    rank, world = init()
    params = torch.zeros(8)
    for step in range(8):
        grad = torch.ones(8) * (rank + step)
        if step == 3:
            hang_point(rank, "skips broadcast" if rank == 2 else "broadcast")
        dist.all_reduce(grad)
        params -= 0.01 * grad
        if rank == 2 and step == 3:
            continue  # the bug
        dist.broadcast(params, src=0)
        progress(rank, step)
    finish()


if __name__ == "__main__":
    main()
