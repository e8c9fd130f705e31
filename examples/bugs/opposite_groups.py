"""Two groups used in opposite orders: ranks 0, 1 reduce on A then B; ranks 2, 3 on B then A.

Both groups hold all four ranks (created by everyone, in the same order). The two halves of the
job run their two reductions in opposite orders, so ranks 0, 1 wait in A for ranks 2, 3, which
wait in B for ranks 0, 1. Neither side alone is wrong: both sides and both call sites are the
answer.

    torchrun --nproc-per-node 4 examples/bugs/opposite_groups.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress, timeout  # noqa: E402

TRUTH = {"kind": "collective-mismatch", "culprits": [0, 1, 2, 3], "world": 4,
         "why": "ranks 0, 1 all_reduce on group A then B; ranks 2, 3 on B then A"}


def main():
    rank, world = init()
    everyone = list(range(world))
    group_a = dist.new_group(everyone, timeout=timeout())
    group_b = dist.new_group(everyone, timeout=timeout())
    a, b = torch.ones(8), torch.ones(24)
    for step in range(2):
        dist.all_reduce(a, group=group_a)
        dist.all_reduce(b, group=group_b)
        progress(rank, step)
    hang_point(rank, "A then B" if rank < 2 else "B then A")
    if rank < 2:
        dist.all_reduce(a, group=group_a)
        dist.all_reduce(b, group=group_b)
    else:  # the bug: the other half reduces in the opposite order
        dist.all_reduce(b, group=group_b)
        dist.all_reduce(a, group=group_a)
    finish()


if __name__ == "__main__":
    main()
