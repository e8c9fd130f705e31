"""Early stopping decided on each rank's own validation shard: rank 3 stops and waits in ``barrier()``.

A data-parallel regression job (gradients averaged by hand with ``all_reduce``) validates every
other step and stops early when the validation loss has not improved for ``PATIENCE`` evaluations.
The validation files are split by rank (``val_files[rank::world]``) and the loss is never
all-reduced: every rank runs its own ``EarlyStopping``. Rank 3's shard is the out-of-domain split,
whose loss rises while the model fits the training distribution; its stopper fires after step 5,
it ``break``s out of the loop and waits in the final ``barrier()`` before saving. Ranks 0-2, whose
validation loss still falls, go on to step 6 and wait in the gradient ``all_reduce``.

    torchrun --nproc-per-node 4 examples/bugs/b3_early_stop_local_val.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "collective-mismatch", "culprits": [3], "world": 4,
         "why": "rank 3's early stopper fires on its rank-local validation loss after step 5: it breaks "
                "out of the loop into barrier() while ranks 0-2 all_reduce step 6's gradients"}

STEPS = 20
EVAL_EVERY = 2
PATIENCE = 2
FEATURES = 16
HANG_STEP = 6  # the first step rank 3 does not train (see the docstring)


class EarlyStopping:
    def __init__(self, patience, min_delta=1e-4):
        self.patience, self.min_delta = patience, min_delta
        self.best, self.bad = float("inf"), 0

    def should_stop(self, value):
        if value < self.best - self.min_delta:
            self.best, self.bad = value, 0
        else:
            self.bad += 1
        return self.bad >= self.patience


def make_split(name, rank, n):
    """A stand-in for reading one rank's files of a split; the val file of rank 3 is the held-out domain."""
    g = torch.Generator().manual_seed(1000 * rank + len(name))
    w_true = torch.linspace(-1, 1, FEATURES, device="cpu")
    x = torch.randn(n, FEATURES, generator=g, device="cpu")
    dev = torch.get_default_device()
    if name == "val" and rank == 3:
        return x.to(dev), (-(x @ w_true)).to(dev)  # another domain: same inputs, opposite relation
    return x.to(dev), (x @ w_true + 0.01 * torch.randn(n, generator=g, device="cpu")).to(dev)


def all_reduce_grads(model, world):
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    dist.all_reduce(flat)
    flat /= world
    offset = 0
    for p in model.parameters():
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()


def main():
    rank, world = init()
    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x_train, y_train = make_split("train", rank, 256)
    x_val, y_val = make_split("val", rank, 64)
    stopper = EarlyStopping(PATIENCE)
    for step in range(STEPS):
        rows = slice((step * 32) % 256, (step * 32) % 256 + 32)
        loss = torch.nn.functional.mse_loss(model(x_train[rows]).squeeze(1), y_train[rows])
        opt.zero_grad()
        loss.backward()
        if step == HANG_STEP:
            hang_point(rank, "all_reduce (gradients)")
        all_reduce_grads(model, world)
        opt.step()
        progress(rank, step)
        if step % EVAL_EVERY == 1:
            with torch.no_grad():
                val_loss = torch.nn.functional.mse_loss(model(x_val).squeeze(1), y_val).item()
            print(f"rank={rank} step={step} val_loss={val_loss:.4f}", flush=True)
            if stopper.should_stop(val_loss):  # the bug: a rank-local decision, val_loss not all-reduced
                print(f"rank={rank} early stopping at step {step}", flush=True)
                break
    hang_point(rank, "barrier (after early stopping)")
    dist.barrier()
    finish()


if __name__ == "__main__":
    main()
