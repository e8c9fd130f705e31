"""Rank 2 passes a ``scatter_list`` to ``scatter(src=0)`` although it is not the source; it raises at once.

After 3 warm-up steps on synthetic micro-batches, rank 0 reads each global batch from the dataset
and scatters one micro-batch to every rank. The reader test was kept from the version that ran one
reader per node of 2 GPUs (``rank % GPUS_PER_NODE == 0``), so rank 2 also reads a batch and passes
its chunks as ``scatter_list``. ``torch.distributed.scatter`` checks this before any communication:
rank 2 raises ``ValueError: Argument scatter_list must NOT be specified on non-source ranks`` and
exits. Measured on gloo, within a second: rank 0 fails in its ``scatter`` when rank 2's connection
closes, ranks 1 and 3 (their chunks arrived) are in step 3's ``all_reduce`` or still in the
``scatter`` when the launcher stops them.

    torchrun --nproc-per-node 4 examples/bugs/scatter_list_node_reader.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "rank-failed", "culprits": [2], "world": 4,
         "why": "rank 2 (rank % GPUS_PER_NODE == 0, a per-node reader test) passed scatter_list to scatter(src=0) and raised ValueError before any communication"}

GPUS_PER_NODE, WARMUP, MICRO, DIM = 2, 3, 4, 32  # GPUS_PER_NODE: the old cluster's nodes


def read_global_batch(step, world):
    g = torch.Generator().manual_seed(step)
    return torch.randn(world * MICRO, DIM, generator=g, device="cpu").to(torch.get_default_device())


def next_micro_batch(rank, world, step):
    if step < WARMUP:
        return torch.randn(MICRO, DIM)  # synthetic packed-sequence warm-up
    is_reader = rank % GPUS_PER_NODE == 0  # the bug: only rank 0 is the scatter's source now
    chunks = list(read_global_batch(step, world).chunk(world)) if is_reader else None
    micro = torch.empty(MICRO, DIM)
    if step == WARMUP:
        hang_point(rank, "scatter with scatter_list (raises)" if chunks is not None and rank != 0 else "scatter(src=0)")
    dist.scatter(micro, scatter_list=chunks, src=0)
    return micro


def main():
    rank, world = init()
    w = torch.zeros(DIM, DIM)
    for step in range(8):
        x = next_micro_batch(rank, world, step)
        grad = x.t() @ (x @ w - x) / MICRO
        dist.all_reduce(grad)
        w -= 0.05 * grad / world
        progress(rank, step)
    finish()


if __name__ == "__main__":
    main()
