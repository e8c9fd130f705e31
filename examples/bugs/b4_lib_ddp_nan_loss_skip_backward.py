"""DDP: rank 2 skips ``backward()`` for a batch whose loss is NaN; DDP's collectives fall out of step.

A tabular classifier (Linear, BatchNorm1d, ReLU, Linear) is trained with
``DistributedDataParallel`` (``broadcast_buffers=True``, the default, so every forward first
broadcasts the BatchNorm buffers from rank 0). Each rank parses its own shard of CSV rows; an
empty field becomes ``nan`` ("missing value"). Rank 2's shard has an empty field in step 3's batch,
so its loss is NaN and the loop's guard ``if not torch.isfinite(loss): continue`` skips the
backward. The guard is local: ranks 0, 1, 3 run step 3's backward and wait in DDP's bucket
``all_reduce`` (issued by the reducer's autograd hooks), while rank 2 starts step 4's forward and
waits in DDP's buffer ``broadcast`` (``_sync_buffers``). Neither collective is called by the user;
under gloo the two ops do not match and all four ranks stay stuck until the gloo timeout.

    torchrun --nproc-per-node 4 examples/bugs/b4_lib_ddp_nan_loss_skip_backward.py
"""

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "collective-mismatch", "culprits": [2], "world": 4,
         "why": "rank 2's step-3 loss is NaN (an empty CSV field parsed as nan) and it `continue`s past "
                "loss.backward(): it waits in step 4's DDP forward buffer broadcast while ranks 0, 1, 3 wait "
                "in step 3's DDP bucket all_reduce"}

FEATURES = 12
CLASSES = 3
BATCH = 16
STEPS = 8


def csv_shard(rank):
    """This rank's shard as CSV lines ``f0,...,f11,label`` (one empty field in rank 2's shard)."""
    g = torch.Generator().manual_seed(1234 + rank)
    lines = []
    for i in range(STEPS * BATCH):
        x = torch.randn(FEATURES, generator=g)
        label = int(x[:3].sum() > 0) + int(x[3:6].sum() > 1)
        fields = [f"{v:.5f}" for v in x.tolist()]
        if rank == 2 and i == 3 * BATCH + 7:
            fields[4] = ""  # a sensor dropout in the raw export
        lines.append(",".join(fields + [str(label)]))
    return lines


def parse(line):
    *feats, label = line.split(",")
    return [float(v) if v else math.nan for v in feats], int(label)


def batches(rank):
    rows = [parse(line) for line in csv_shard(rank)]
    for step in range(STEPS):
        chunk = rows[step * BATCH:(step + 1) * BATCH]
        yield step, torch.tensor([f for f, _ in chunk]), torch.tensor([y for _, y in chunk])


def main():
    rank, world = init()
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(), torch.nn.Linear(64, CLASSES))
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    skipped = 0
    for step, x, y in batches(rank):
        if step == 4 and skipped:
            hang_point(rank, "DDP forward: _sync_buffers broadcast (step 4; skipped step 3's backward)")
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if not torch.isfinite(loss):
            print(f"rank {rank}: non-finite loss at step {step}, skipping batch", flush=True)
            skipped += 1
            opt.zero_grad(set_to_none=True)
            continue  # the bug: DDP expects every rank to run backward (its all_reduce) each step
        if step == 3:
            hang_point(rank, "DDP backward: reducer bucket all_reduce (step 3)")
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        progress(rank, step)
    finish()


if __name__ == "__main__":
    main()
