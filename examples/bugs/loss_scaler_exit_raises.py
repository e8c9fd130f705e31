"""A hand-rolled dynamic loss scaler raises in its ``__exit__`` on rank 1; the others wait in all_reduce.

The loop wraps backward in ``with scaler.scaled(loss) as scaled_loss:``; the scaler's
``__exit__`` unscales the gradients, checks them for inf/nan, halves the scale on an overflow and
raises ``FloatingPointError("Minimum loss scale reached ...")`` (as fairseq's scaler does) once the
scale drops below ``min_scale``. The overflow check runs on the *local* gradients, before the
gradient all-reduce, so it is not synchronised across ranks. Records 290-419 of the data set are
garbage (feature values of 1e30, which overflow the squared loss) and lie in rank 1's shard, which
reaches them at step 2: its scale goes 4 -> 2 -> 1 (on an overflow it zeroes its gradients and skips
its optimizer step), and at step 4 it falls to 0.5 and ``__exit__`` raises. Rank 1 exits with the
traceback; ranks 0, 2 and 3 are already waiting in the step's gradient ``all_reduce``.

    torchrun --nproc-per-node 4 examples/bugs/loss_scaler_exit_raises.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "rank-failed", "culprits": [1], "world": 4,
         "why": "rank 1's loss scaler raised FloatingPointError in __exit__ at step 4 (local overflow check on "
                "a corrupt shard, scale below min_scale); ranks 0, 2, 3 wait in the gradient all_reduce"}

BATCH = 16
FEATURES = 24


class DynamicLossScaler:
    def __init__(self, params, init_scale=4.0, min_scale=1.0):
        self.params = list(params)
        self.scale = init_scale
        self.min_scale = min_scale
        self.overflow = False

    def scaled(self, loss):
        self._loss = loss
        return self

    def __enter__(self):
        return self._loss * self.scale

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            return False
        grads = [p.grad for p in self.params if p.grad is not None]
        for g in grads:
            g.div_(self.scale)
        self.overflow = not all(torch.isfinite(g).all() for g in grads)  # local grads only
        if self.overflow:
            self.scale /= 2
            for g in grads:
                g.zero_()  # contribute nothing to this step's average
            if self.scale < self.min_scale:
                raise FloatingPointError(
                    f"Minimum loss scale reached ({self.min_scale}). Your loss is probably exploding.")
        return False


RECORDS_PER_SHARD = 256
CORRUPT_RECORDS = range(290, 420)  # global record ids a crashed exporter wrote as garbage


def record(i):
    g = torch.Generator().manual_seed(i)
    x = torch.randn(FEATURES, generator=g, device="cpu")
    if i in CORRUPT_RECORDS:
        x.fill_(1e30)
    return x


def batch_for(rank, step):
    """Shard `rank` holds records [rank * 256, (rank + 1) * 256); read it in order."""
    first = rank * RECORDS_PER_SHARD + step * BATCH
    x = torch.stack([record(i) for i in range(first, first + BATCH)]).to(torch.get_default_device())
    y = torch.tanh(x[:, :1]) * 0.5
    return x, y


def main():
    rank, world = init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = DynamicLossScaler(model.parameters())
    for step in range(8):
        x, y = batch_for(rank, step)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        if step == 4:
            hang_point(rank, "raises in DynamicLossScaler.__exit__" if rank == 1 else "all_reduce (gradients)")
        with scaler.scaled(loss) as scaled_loss:
            scaled_loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        if not scaler.overflow:
            opt.step()
        progress(rank, step)
    finish()


if __name__ == "__main__":
    main()
