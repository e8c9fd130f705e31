"""Evaluation shards split without padding (drop_last=False): rank 2's last batch is short and all_gather mismatches.

The validation set has 35 samples; ``shard_indices`` splits it like ``DistributedSampler`` but
without the sampler's padding, so ranks 0 and 1 get 12 samples and rank 2 gets 11. With batches of
4 and ``drop_last=False`` every rank runs 3 batches, and the last one is [4] on ranks 0, 1 and [3]
on rank 2. Each batch's predictions are all-gathered into buffers shaped like the local batch, so
the third ``all_gather`` sends [3] from rank 2 where ranks 0 and 1 send [4]. gloo does not hang
here: measured, it aborts rank 2 itself (enforce failure, SIGABRT: a message longer than its
buffer) within a second, and torchrun stops the others. The bug is rank 2's short batch.

    torchrun --nproc-per-node 3 examples/bugs/ragged_eval_allgather.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "collective-mismatch", "culprits": [2], "world": 3,
         "why": "rank 2's last eval batch holds 3 samples (35 split over 3 ranks, no padding); it all-gathers [3] where ranks 0, 1 gather [4]"}

VAL_SIZE, BATCH = 35, 4


def shard_indices(n, rank, world):
    return list(range(rank, n, world))  # the bug: DistributedSampler pads to ceil(n / world); this does not


def batches(indices, batch_size, drop_last=False):
    for i in range(0, len(indices), batch_size):
        chunk = indices[i:i + batch_size]
        if len(chunk) < batch_size and drop_last:
            return
        yield torch.tensor(chunk, dtype=torch.float32)


def evaluate(model, rank, world, step):
    preds = []
    for i, x in enumerate(batches(shard_indices(VAL_SIZE, rank, world), BATCH)):
        logits = torch.sigmoid(x * model.mean())
        if i == 2:
            hang_point(rank, f"all_gather [{logits.numel()}]")
        gathered = [torch.empty_like(logits) for _ in range(world)]
        dist.all_gather(gathered, logits)
        preds.append(torch.cat(gathered))
    return torch.cat(preds)


def main():
    rank, world = init()
    model = torch.ones(32)
    for step in range(4):
        grad = torch.randn(32) * 0.01
        dist.all_reduce(grad)
        model -= grad / world
        progress(rank, step)
    preds = evaluate(model, rank, world, step)
    if rank == 0:
        print(f"accuracy proxy {preds.mean():.3f} over {preds.numel()} predictions", flush=True)
    finish()


if __name__ == "__main__":
    main()
