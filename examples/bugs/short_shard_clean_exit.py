"""Rank 2's contiguous data shard is one batch shorter: it leaves the loop, tears down and exits 0.

The data set (97 samples) is split into contiguous per-rank shards of ``ceil(97 / 3) = 33``
samples, the last shard taking what is left (31). Each rank iterates its shard with a plain
``DataLoader(batch_size=8)`` (no ``drop_last``, no ``DistributedSampler`` padding, no ``Join``):
ranks 0 and 1 have 5 batches (4 full + 1 of 1 sample), rank 2 has 4 (3 full + 1 of 7). After its
4th step rank 2's ``for batch in loader`` ends; it runs the normal epilogue (``destroy_process_group``)
and exits with status 0. Ranks 0 and 1 go on to their 5th batch and wait in the gradient
``all_reduce`` for a peer that has left. Under gloo they do not wait long: the closed sockets make
their ``all_reduce`` raise ``Connection closed by peer`` within a second, so the only tracebacks
are theirs while the culprit's exit status is 0 (NCCL may instead leave them waiting until its
timeout).

    torchrun --nproc-per-node 3 examples/bugs/short_shard_clean_exit.py
"""

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.utils.data import DataLoader, Subset, TensorDataset  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "collective-mismatch", "culprits": [2], "world": 3,
         "why": "rank 2's contiguous shard has 31 samples (4 batches of 8) where ranks 0, 1 have 33 (5 batches): "
                "rank 2 ends its loop, destroys the process group and exits 0; ranks 0, 1 wait in step 4's all_reduce "
                "(gloo: they raise 'Connection closed by peer' at once)"}

NUM_SAMPLES = 97
BATCH = 8


def contiguous_shard(dataset, rank, world):
    per_rank = math.ceil(len(dataset) / world)
    start = rank * per_rank
    return Subset(dataset, range(start, min(start + per_rank, len(dataset))))


def main():
    rank, world = init()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(NUM_SAMPLES, 20, generator=g, device="cpu").to(torch.get_default_device())
    y = (x.sum(1, keepdim=True) > 0).float()
    shard = contiguous_shard(TensorDataset(x, y), rank, world)
    loader = DataLoader(shard, batch_size=BATCH)  # the last, short batch is kept
    n_batches = len(loader)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = 0
    for xb, yb in loader:
        loss = nn.functional.binary_cross_entropy_with_logits(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        if step == 4:
            hang_point(rank, "all_reduce (gradients)")
        dist.all_reduce(grads)
        grads /= world
        offset = 0
        for p in model.parameters():
            p.grad.copy_(grads[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        opt.step()
        progress(rank, step)
        step += 1
    if step < 5:  # the epoch ended here while a peer still has batches
        hang_point(rank, f"loop ended after {n_batches} batches: destroy_process_group, exit 0")
    finish()


if __name__ == "__main__":
    main()
