"""Rank 1 issues one all_reduce more than the others (a metric it logs only when its loss spikes).

Every step all-reduces the gradients; at step 3 rank 1 sees a "loss spike" and all-reduces its
loss for the log, a collective no other rank issues. gloo pairs it with the others' gradient all_reduce (the same
slot) and, the sizes differing (4 bytes against 256), aborts a process with an enforce failure
("Received data size doesn't match expected size"): measured here, the job dies within a second of
the extra call rather than hanging.

    torchrun --nproc-per-node 4 examples/bugs/extra_collective.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "collective-mismatch", "culprits": [1], "world": 4,
         "why": "rank 1 issued an extra all_reduce (of a [1] loss) at step 3"}


def log_loss_spike(loss):
    dist.all_reduce(loss)  # the bug: only the rank that saw the spike gets here


def main():
    rank, world = init()
    grads = torch.ones(64)
    for step in range(8):
        if step == 3:
            hang_point(rank, "extra all_reduce" if rank == 1 else "all_reduce")
            if rank == 1:
                log_loss_spike(torch.tensor([float(step)]))
        dist.all_reduce(grads)
        dist.all_reduce(grads)  # a second bucket
        grads /= world * world
        progress(rank, step)
    finish()


if __name__ == "__main__":
    main()
