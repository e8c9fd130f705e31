"""An evaluation group created only by its members; the bug bites at the next group made after it.

Set-up makes the data-parallel group of all ranks (every rank: fine), then the evaluation group
``[0, 1]`` inside ``if rank in EVAL_RANKS:`` (the bug: ``new_group`` must be called by every rank of
the job, members or not). Training all-reduces on the data-parallel group and evaluation on the
pair works for a while. At step 3 the checkpointer makes its own group of all ranks: on ranks 0, 1
it is the third group made, on ranks 2, 3 the second (the name ranks 0, 1 gave the evaluation
group), so its first ``all_gather`` (the shard sizes of the checkpoint) cannot match.

    torchrun --nproc-per-node 4 examples/bugs/subgroup_only_some.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress, timeout  # noqa: E402

TRUTH = {"kind": "collective-mismatch", "culprits": [2, 3], "world": 4,
         "why": "ranks 2 and 3 skipped new_group([0, 1]) (the evaluation group, under `if rank in EVAL_RANKS`), so the checkpointer's group is numbered differently on them"}

EVAL_RANKS = [0, 1]


def setup_groups(rank, world):
    dp = dist.new_group(list(range(world)), timeout=timeout())
    evaluation = None
    if rank in EVAL_RANKS:
        evaluation = dist.new_group(EVAL_RANKS, timeout=timeout())  # the bug: ranks 2, 3 skip it
    return dp, evaluation


def save_checkpoint(rank, world, w):
    ckpt = dist.new_group(list(range(world)), timeout=timeout())  # 3rd group on 0, 1; 2nd on 2, 3
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([w.numel()]), group=ckpt)
    return sum(int(s) for s in sizes)


def main():
    rank, world = init()
    dp, evaluation = setup_groups(rank, world)
    w = torch.ones(32)
    for step in range(8):
        grad = torch.full((32,), float(rank))
        dist.all_reduce(grad, group=dp)
        w -= 0.01 * grad / world
        if evaluation is not None:
            acc = torch.tensor([float(w.mean())])
            dist.all_reduce(acc, group=evaluation)
        if step == 3:
            hang_point(rank, "new_group(all) [3rd], all_gather" if rank in EVAL_RANKS else "new_group(all) [2nd], all_gather")
            save_checkpoint(rank, world, w)
        progress(rank, step)
    finish()


if __name__ == "__main__":
    main()
