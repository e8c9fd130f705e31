"""A two-stage pipeline whose last stage skips the pipeline-wide all_reduce once (rank 1 of 2).

Rank 0 (stage 0) sends its activation to rank 1 and receives the gradient back; rank 1 (stage 1)
receives, sends the gradient back; then both all_reduce the gradient norm across the pipeline (for
clipping). At step 3 rank 1 takes a "no overflow, no clipping" shortcut and skips that all_reduce.
With gloo rank 0 waits in the all_reduce for rank 1, which waits for rank 0's next activation. With
NCCL neither host blocks: both issue every call, and on the GPUs rank 0's next send waits behind
its all_reduce, which waits for rank 1's, queued behind the receive of that send.

    torchrun --nproc-per-node 2 examples/bugs/pp_skip_pair.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "collective-mismatch", "culprits": [1], "world": 2,
         "why": "rank 1 skipped the all_reduce of the gradient norm at step 3"}


def main():
    rank, world = init()
    for step in range(8):
        if step == 3:
            hang_point(rank, "skips all_reduce" if rank == 1 else "stage 0 step 3")
        if rank == 0:
            act = torch.ones(16) * step
            dist.send(act, dst=1)                   # to the next pipeline stage
            grad = torch.empty(16)
            dist.recv(grad, src=1)                  # backward from stage 1
        else:
            act = torch.empty(16)
            dist.recv(act, src=0)
            grad = act * 0.5
            dist.send(grad, dst=0)
        norm = grad.norm().reshape(1)
        if not (rank == 1 and step == 3):           # the bug: a shortcut on one stage
            dist.all_reduce(norm)                   # the pipeline-wide gradient norm
        progress(rank, step)
    finish()


if __name__ == "__main__":
    main()
