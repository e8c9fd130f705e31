"""Tensor-parallel and pipeline groups (Megatron-style 2 x 2): rank 3 skips its TP all_reduce.

Four ranks: pipeline stage 0 is ranks 0, 1 and stage 1 is ranks 2, 3; the tensor-parallel groups are
{0, 1} and {2, 3}; rank r of stage 0 sends its activation to rank r + 2 and gets the gradient back
from it. Each step: stage 0 all-reduces its partial output in its TP group and sends it on; stage 1
receives, all-reduces in its TP group, and sends the gradient back. At step 3 rank 3 takes a
"sequence-parallel" shortcut that skips the TP all_reduce: rank 2 waits in it for ever, rank 0
waits for rank 2's gradient, rank 1 for rank 0 in the next TP all_reduce, rank 3 for rank 1's
next activation.

    torchrun --nproc-per-node 4 examples/bugs/tp_pp_skip.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress, timeout  # noqa: E402

TRUTH = {"kind": "collective-mismatch", "culprits": [3], "world": 4,
         "why": "rank 3 skipped the all_reduce of its tensor-parallel group {2, 3} at step 3"}


def main():
    rank, world = init()
    stage, tp_rank = divmod(rank, 2)
    # every rank creates every group, in one order (new_group's contract)
    tp_groups = [dist.new_group([0, 1], timeout=timeout()), dist.new_group([2, 3], timeout=timeout())]
    tp = tp_groups[stage]
    peer = rank + 2 if stage == 0 else rank - 2
    for step in range(8):
        if step == 3:
            hang_point(rank, "skips TP all_reduce" if rank == 3 else f"stage {stage} step 3")
        if stage == 0:
            act = torch.ones(16) * (rank + step)
            dist.all_reduce(act, group=tp)          # row-parallel output
            dist.send(act, dst=peer)                # to the next pipeline stage
            grad = torch.empty(16)
            dist.recv(grad, src=peer)               # backward from stage 1
        else:
            act = torch.empty(16)
            dist.recv(act, src=peer)
            if not (rank == 3 and step == 3):       # the bug: a shortcut on one TP rank
                dist.all_reduce(act, group=tp)
            dist.send(act * 0.5, dst=peer)
        progress(rank, step)
    finish()


if __name__ == "__main__":
    main()
