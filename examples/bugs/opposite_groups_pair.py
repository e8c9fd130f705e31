"""Two groups used in opposite orders on two ranks: rank 0 reduces on A then B, rank 1 on B then A.

Both groups hold both ranks (created by both, in the same order), as a tensor-parallel and a
data-parallel group of one pair of GPUs do. With gloo each call blocks its rank: rank 0 waits in A
for rank 1, which waits in B for rank 0. With NCCL neither call blocks the host: both ranks issue
both calls, and on each GPU the second waits on the stream behind the first, which waits for the
other GPU's second. Neither rank alone is wrong: both ranks and both call sites are the answer.

    torchrun --nproc-per-node 2 examples/bugs/opposite_groups_pair.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress, timeout  # noqa: E402

TRUTH = {"kind": "collective-mismatch", "culprits": [0, 1], "world": 2,
         "why": "rank 0 all_reduces on group A then B; rank 1 on B then A"}


def main():
    rank, world = init()
    both = list(range(world))
    group_a = dist.new_group(both, timeout=timeout())
    group_b = dist.new_group(both, timeout=timeout())
    a, b = torch.ones(8), torch.ones(24)
    for step in range(3):
        dist.all_reduce(a, group=group_a)
        dist.all_reduce(b, group=group_b)
        progress(rank, step)
    hang_point(rank, "A then B" if rank == 0 else "B then A")
    if rank == 0:
        dist.all_reduce(a, group=group_a)
        dist.all_reduce(b, group=group_b)
    else:  # the bug: the other rank reduces in the opposite order
        dist.all_reduce(b, group=group_b)
        dist.all_reduce(a, group=group_a)
    finish()


if __name__ == "__main__":
    main()
