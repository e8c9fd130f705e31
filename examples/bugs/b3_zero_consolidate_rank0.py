"""A ZeRO-1 style sharded optimizer's ``consolidate_state_dict()`` called only on rank 0.

Each rank owns one shard of the flat parameter vector: a step all-gathers the full parameters
(``all_gather_into_tensor``), computes the gradient and reduce-scatters it back onto the shards
(``reduce_scatter_tensor``). Every ``SAVE_EVERY`` steps the main process saves a checkpoint:
``if rank == 0: torch.save(opt.consolidated_state_dict(), path)``. ``consolidated_state_dict``
collects the shards onto rank 0 with ``dist.gather`` (the same trap as torch's
``ZeroRedundancyOptimizer.consolidate_state_dict``, which every rank must call): rank 0 waits in
``gather`` after step 2, ranks 1-3 go on to step 3's ``all_gather_into_tensor``.

    torchrun --nproc-per-node 4 examples/bugs/b3_zero_consolidate_rank0.py
"""

import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "collective-mismatch", "culprits": [0], "world": 4,
         "why": "rank 0 alone calls consolidated_state_dict() (dist.gather to rank 0) to save the step-2 "
                "checkpoint; ranks 1-3 are in step 3's all_gather_into_tensor"}

SHARD = 32
SAVE_EVERY = 3
STEPS = 8


class ShardedSGD:
    """Plain SGD whose parameters and momentum live sharded over the ranks (ZeRO-1/2 style)."""

    def __init__(self, full_numel, lr=0.01, momentum=0.9):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.shard_numel = full_numel // self.world
        start = self.rank * self.shard_numel
        init_full = torch.linspace(-1.0, 1.0, full_numel)
        self.shard = init_full[start:start + self.shard_numel].clone()
        self.momentum_buf = torch.zeros_like(self.shard)
        self.lr, self.momentum = lr, momentum

    def full_params(self):
        full = torch.empty(self.shard_numel * self.world)
        dist.all_gather_into_tensor(full, self.shard)
        return full

    def step(self, full_grad):
        grad = torch.empty_like(self.shard)
        dist.reduce_scatter_tensor(grad, full_grad)
        grad /= self.world
        self.momentum_buf.mul_(self.momentum).add_(grad)
        self.shard -= self.lr * self.momentum_buf

    def consolidated_state_dict(self, to=0):
        """Collect the full parameters and momentum on rank ``to`` (the saving rank)."""
        state = {}
        for name, shard in (("params", self.shard), ("momentum", self.momentum_buf)):
            parts = [torch.empty_like(shard) for _ in range(self.world)] if self.rank == to else None
            dist.gather(shard, parts, dst=to)
            if self.rank == to:
                state[name] = torch.cat(parts).cpu()
        return state


def batch(rank, step, n):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(16, n, generator=g, device="cpu").to(torch.get_default_device())


def main():
    rank, world = init()
    ckpt_dir = tempfile.mkdtemp(prefix=f"b3-zero-ckpt-{rank}-")
    opt = ShardedSGD(SHARD * world)
    try:
        for step in range(STEPS):
            if step == 3 and rank != 0:
                hang_point(rank, "all_gather_into_tensor (step 3)")
            params = opt.full_params().requires_grad_(True)
            x = batch(rank, step, params.numel())
            loss = ((x @ params) ** 2).mean()
            loss.backward()
            opt.step(params.grad)
            progress(rank, step)
            if rank == 0 and (step + 1) % SAVE_EVERY == 0:  # the bug: consolidation is a collective
                hang_point(rank, "gather in consolidated_state_dict")
                torch.save({"step": step, "optim": opt.consolidated_state_dict()},
                           os.path.join(ckpt_dir, f"step{step}.pt"))
    finally:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    finish()


if __name__ == "__main__":
    main()
