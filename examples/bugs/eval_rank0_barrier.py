"""Periodic evaluation on rank 0 ends in a ``barrier()`` that only rank 0 reaches (early return).

Every 3 steps the trainer calls ``maybe_evaluate``, which returns at once on every rank but 0
(``if dist.get_rank() != 0: return``: only rank 0 evaluates). Rank 0 evaluates, keeps the best
weights and then calls ``dist.barrier()`` "so that no rank reads the best-model file before it is
written". The other ranks have already gone on to the next step's all-reduce of the gradients
and the broadcast of the learning rate; rank 0 waits in the barrier.

    torchrun --nproc-per-node 4 examples/bugs/eval_rank0_barrier.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "collective-mismatch", "culprits": [0], "world": 4,
         "why": "rank 0 called barrier() at the end of maybe_evaluate at step 2, which the other ranks return from at once"}

EVAL_EVERY = 3
BEST = {"loss": float("inf"), "w": None}


def maybe_evaluate(step, w):
    if dist.get_rank() != 0:
        return
    val = torch.linspace(-1, 1, 64).view(-1, 16)
    loss = float(((val @ w.view(-1, 1)) ** 2).mean())
    if loss < BEST["loss"]:
        BEST.update(loss=loss, w=w.clone())
    print(f"eval step={step} loss={loss:.4f}", flush=True)
    dist.barrier()  # the bug: only rank 0 gets here


def main():
    rank, world = init()
    w = torch.ones(16)
    lr = torch.tensor([0.1])
    for step in range(9):
        grad = w * (rank + 1)
        dist.all_reduce(grad)
        dist.broadcast(lr, src=0)
        w -= lr * grad / world
        progress(rank, step)
        if step % EVAL_EVERY == EVAL_EVERY - 1:
            if step == EVAL_EVERY - 1:
                hang_point(rank, "evaluate, barrier" if rank == 0 else "next step's all_reduce")
            maybe_evaluate(step, w)
    finish()


if __name__ == "__main__":
    main()
