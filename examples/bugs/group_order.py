"""Groups created in different orders: rank 3 creates the "grad" group before the "param" group.

Both groups hold all four ranks; groups are named by creation order, so rank 3's "param" group is
the others' "grad" group and the other way round. At step 3 every rank all-reduces on "param":
ranks 0-2 on the first group created, rank 3 on the second. Nobody matches.

    torchrun --nproc-per-node 4 examples/bugs/group_order.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress, timeout  # noqa: E402

TRUTH = {"kind": "collective-mismatch", "culprits": [3], "world": 4,
         "why": "rank 3 created the groups in the opposite order (grad, then param) to ranks 0-2"}


def make_groups(rank):
    ranks = list(range(dist.get_world_size()))
    if rank == 3:  # the bug: another code path builds them the other way round
        grad = dist.new_group(ranks, timeout=timeout())
        param = dist.new_group(ranks, timeout=timeout())
    else:
        param = dist.new_group(ranks, timeout=timeout())
        grad = dist.new_group(ranks, timeout=timeout())
    return param, grad


def main():
    rank, world = init()
    x = torch.ones(8)
    for step in range(3):
        dist.all_reduce(x)
        x /= world
        progress(rank, step)
    param, grad = make_groups(rank)
    p, g = torch.ones(4), torch.ones(16)
    for step in range(3, 8):
        if step == 3:
            hang_point(rank, "all_reduce on param")
        dist.all_reduce(p, group=param)
        dist.all_reduce(g, group=grad)
        progress(rank, step)
    finish()


if __name__ == "__main__":
    main()
