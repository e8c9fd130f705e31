"""A group created by only some ranks: ``new_group([0, 1])`` under ``if rank in (0, 1)``.

``new_group`` must be called by every rank of the job, members or not. Ranks 0 and 1 create a
group for their pair under an ``if``; ranks 2 and 3 skip the call. Groups are numbered in creation
order, so the group of all ranks created next is group 2 on ranks 0, 1 and group 1 on ranks 2, 3
(the name of the pair's group): the first ``all_reduce`` on it cannot match. (torch 2.13 does not
block in ``new_group`` itself: measured here, the subset call alone returns at once.)

    torchrun --nproc-per-node 4 examples/bugs/partial_group.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress, timeout  # noqa: E402

TRUTH = {"kind": "collective-mismatch", "culprits": [2, 3], "world": 4,
         "why": "ranks 2 and 3 skipped new_group([0, 1]) (called under `if rank in (0, 1)`), so their next group is numbered differently"}


def main():
    rank, world = init()
    x = torch.ones(8)
    for step in range(2):
        dist.all_reduce(x)
        progress(rank, step)
    hang_point(rank, "new_group([0, 1]), new_group(all)" if rank in (0, 1) else "new_group(all)")
    pair = None
    if rank in (0, 1):
        pair = dist.new_group([0, 1], timeout=timeout())  # the bug: not called by ranks 2, 3
    everyone = dist.new_group(list(range(world)), timeout=timeout())  # 2nd group on 0, 1; 1st on 2, 3
    for step in range(2, 6):
        dist.all_reduce(x, group=everyone)
        if pair is not None:
            dist.all_reduce(x, group=pair)
        progress(rank, step)
    finish()


if __name__ == "__main__":
    main()
