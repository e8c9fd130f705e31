"""Ranks 5 and 6 of 8 both skip a broadcast: two culprits, both must be named.

Eight ranks all-reduce then broadcast every step; at step 3 ranks 5 and 6 (the two that hold no
shard of the embedding in this layout) skip the broadcast.

    torchrun --nproc-per-node 8 examples/bugs/two_culprits.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "collective-mismatch", "culprits": [5, 6], "world": 8,
         "why": "ranks 5 and 6 skipped the broadcast of step 3"}

SKIPPERS = (5, 6)


def main():
    rank, world = init()
    params = torch.zeros(8)
    for step in range(8):
        if step == 3:
            hang_point(rank, "skips broadcast" if rank in SKIPPERS else "broadcast")
        grad = torch.ones(8)
        dist.all_reduce(grad)
        params -= 0.01 * grad
        if rank in SKIPPERS and step == 3:
            continue  # the bug
        dist.broadcast(params, src=0)
        progress(rank, step)
    finish()


if __name__ == "__main__":
    main()
