"""Rank 3 raises ``ValueError`` in its data step at step 4 and exits; the others wait in all_reduce.

Each rank tokenizes its own shard of records. At step 4 rank 3's shard has a malformed record (a
label outside the class range) and ``make_batch`` raises ``ValueError``: the exception is not
caught, rank 3's process exits with a traceback, and ranks 0, 1, 2 are left in the all-reduce of
step 4's gradients until the launcher tears the job down.

    torchrun --nproc-per-node 4 examples/bugs/exception_in_collective_loop.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "rank-failed", "culprits": [3], "world": 4,
         "why": "rank 3 raised ValueError in make_batch at step 4 (a label out of range) and exited"}

CLASSES = 10


def records(rank, step):
    labels = [(rank * 7 + step * 3 + i) % CLASSES for i in range(8)]
    if rank == 3 and step == 4:
        labels[5] = CLASSES  # a malformed record in rank 3's shard
    return labels


def make_batch(labels):
    for i, y in enumerate(labels):
        if not 0 <= y < CLASSES:
            raise ValueError(f"record {i}: label {y} outside [0, {CLASSES})")
    return torch.nn.functional.one_hot(torch.tensor(labels), CLASSES).float()


def main():
    rank, world = init()
    w = torch.zeros(CLASSES, CLASSES)
    for step in range(8):
        if step == 4:
            hang_point(rank, "raises" if rank == 3 else "all_reduce")
        batch = make_batch(records(rank, step))
        grad = batch.t() @ batch - w
        dist.all_reduce(grad)
        w += 0.1 * grad / world
        progress(rank, step)
    finish()


if __name__ == "__main__":
    main()
