"""Tensor-parallel evaluation under ``torch.no_grad()`` on per-rank shards: rank 0 runs one batch more.

The 4 ranks form one tensor-parallel group: each holds a quarter of the hidden units, and the
row-parallel output layer all-reduces the partial outputs in every forward, validation included.
Training feeds every rank the same batch, as tensor parallelism requires, but the validation loop
was copied from a data-parallel script: each rank iterates its own strided shard of the 61-sample
validation set (``val[rank::world]``, ``len()`` computed locally), 16 samples on rank 0 and 15 on
ranks 1-3. In batches of 5 that is 4 batches on rank 0 and 3 elsewhere, so rank 0's fourth forward
all-reduces its [1, 8] partial output while ranks 1-3 have left the loop and all-gather the
per-shard validation loss (the copied script's per-shard report). The job hangs until the gloo
timeout. The bug is the rank-local shard; rank 0 makes the extra call.

    torchrun --nproc-per-node 4 examples/bugs/tp_eval_uneven_shard.py
"""

import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.nn.functional as dist_nn  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

warnings.filterwarnings("ignore", category=FutureWarning)  # torch.distributed.nn.functional's deprecation

TRUTH = {"kind": "collective-mismatch", "culprits": [0], "world": 4,
         "why": "validation shards taken per rank in a tensor-parallel group: rank 0 has 16 samples (4 batches of 5), ranks 1-3 have 15 (3); rank 0's 4th forward all-reduces partial outputs while ranks 1-3 all_gather the per-shard val loss"}

VAL_SIZE, BATCH, D_IN, HIDDEN, D_OUT = 61, 5, 16, 64, 8


class TPMLP(torch.nn.Module):
    def __init__(self, world):
        super().__init__()
        self.up = torch.nn.Linear(D_IN, HIDDEN // world)  # column-parallel shard
        self.down = torch.nn.Linear(HIDDEN // world, D_OUT, bias=False)  # row-parallel shard

    def forward(self, x):
        partial = self.down(torch.relu(self.up(x)))
        return dist_nn.all_reduce(partial)  # sum of the row-parallel partial outputs (differentiable)


def main():
    rank, world = init()
    torch.manual_seed(rank)
    model = TPMLP(world)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(3):
        x = torch.randn(8, D_IN, generator=torch.Generator().manual_seed(step), device="cpu").to(torch.get_default_device())  # the same batch on every TP rank
        loss = torch.nn.functional.mse_loss(model(x), x[:, :D_OUT])
        opt.zero_grad()
        loss.backward()
        opt.step()
        progress(rank, step)

    val = torch.randn(VAL_SIZE, D_IN, generator=torch.Generator().manual_seed(99), device="cpu").to(torch.get_default_device())
    shard = val[rank::world]  # the bug: a data-parallel shard in a tensor-parallel group
    total = torch.zeros(2)
    with torch.no_grad():
        for i in range((len(shard) + BATCH - 1) // BATCH):
            xb = shard[i * BATCH:(i + 1) * BATCH]
            if i == 3:
                hang_point(rank, "all_reduce in TPMLP.forward, val batch 3")
            out = model(xb)
            total += torch.tensor([torch.nn.functional.mse_loss(out, xb[:, :D_OUT], reduction="sum").item(), len(xb)])
        if rank != 0:
            hang_point(rank, "all_gather of the per-shard val loss")
        shards = [torch.empty(2) for _ in range(world)]
        dist.all_gather(shards, total)
    if rank == 0:
        print("val mse per shard " + " ".join(f"{s[0] / s[1]:.4f}" for s in shards), flush=True)
    finish()


if __name__ == "__main__":
    main()
