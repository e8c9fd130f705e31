"""Rank 1 meets an empty micro-batch and ``continue``s past its ``reduce_scatter_tensor``.

A ZeRO/FSDP-style loop with gradient accumulation: every micro-batch gathers the full parameters
from their shards (``all_gather_into_tensor``), computes a gradient and reduce-scatters it back to
the shards (``reduce_scatter_tensor``); the optimizer steps on the shard every ``ACCUM``
micro-batches. The data loader of rank 1 yields an empty micro-batch at step 2, micro-batch 1, and
the loop guards it with ``if batch.numel() == 0: continue`` placed after the gather: rank 1 jumps
over the reduce-scatter and goes on to the next micro-batch's all-gather, the others wait in the
reduce-scatter.

    torchrun --nproc-per-node 4 examples/bugs/skip_allgather_accum.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "collective-mismatch", "culprits": [1], "world": 4,
         "why": "rank 1 skipped reduce_scatter_tensor at step 2, micro-batch 1 (empty micro-batch: `continue`)"}

ACCUM = 3
SHARD = 16


def micro_batches(rank, step):
    for micro in range(ACCUM):
        rows = 0 if (rank == 1 and step == 2 and micro == 1) else 4  # a short last file on rank 1
        yield micro, torch.randn(rows, SHARD * 4)


def main():
    rank, world = init()
    torch.manual_seed(rank)
    shard = torch.zeros(SHARD)
    full = torch.empty(SHARD * world)
    grad_shard = torch.zeros(SHARD)
    for step in range(6):
        for micro, batch in micro_batches(rank, step):
            dist.all_gather_into_tensor(full, shard)
            if step == 2 and micro == 1:
                hang_point(rank, "skips reduce_scatter_tensor" if rank == 1 else "reduce_scatter_tensor")
            if batch.numel() == 0:
                continue  # the bug: this rank's reduce_scatter is skipped, the others' is not
            grad = (batch @ full.view(-1, 1)).mean() + batch.mean(0)
            out = torch.empty(SHARD)
            dist.reduce_scatter_tensor(out, grad)
            grad_shard += out / (world * ACCUM)
        shard -= 0.1 * grad_shard
        grad_shard.zero_()
        progress(rank, step)
    finish()


if __name__ == "__main__":
    main()
