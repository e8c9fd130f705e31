"""Rank 4 falls back to ZeRO-1 on its own: reduce_scatter on the gradient buffer where the others all_reduce it.

``GradSync`` picks its mode per rank from the free device memory it measures at start-up: with
room for a full optimizer state it all-reduces the flat gradient buffer (plain data parallel),
otherwise it reduce-scatters the same buffer and keeps only its shard (ZeRO-1). Another job shares
rank 4's device, so rank 4 alone measures too little memory and, at the first step, calls
``reduce_scatter_tensor`` on the buffer where ranks 0-3 and 5 call ``all_reduce`` on it. Measured
on gloo: the others' ``all_reduce`` of step 0 returns (with wrong sums: nothing checks the op) and
they wait in step 1's ``all_reduce``; rank 4 waits in its ``reduce_scatter_tensor`` of step 0.

    torchrun --nproc-per-node 6 examples/bugs/zero1_fallback_reduce_scatter.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "collective-mismatch", "culprits": [4], "world": 6,
         "why": "rank 4 chose ZeRO-1 from its local free memory and called reduce_scatter_tensor where ranks 0-3, 5 called all_reduce"}

NUMEL = 6 * 1024


def free_memory_gib(rank):
    # what torch.cuda.mem_get_info() reports on each rank's device; another job holds 60 GiB of rank 4's
    return 19.5 if rank == 4 else 79.5


class GradSync:
    def __init__(self, rank, world, state_gib=24.0):
        self.rank, self.world = rank, world
        self.sharded = free_memory_gib(rank) < state_gib  # the bug: a rank-local choice of the collective

    def __call__(self, flat_grad, step):
        if step == (0 if self.sharded else 1):
            hang_point(self.rank, "reduce_scatter_tensor, step 0" if self.sharded else "all_reduce, step 1")
        if self.sharded:
            shard = torch.empty(flat_grad.numel() // self.world)
            dist.reduce_scatter_tensor(shard, flat_grad)
            return shard / self.world
        dist.all_reduce(flat_grad)
        return flat_grad / self.world


def main():
    rank, world = init()
    params = torch.zeros(NUMEL)
    dist.broadcast(params, src=0)  # the same initial weights everywhere
    sync = GradSync(rank, world)
    for step in range(6):
        flat_grad = torch.randn(NUMEL) * 0.01 + params * 1e-4
        g = sync(flat_grad, step)
        if sync.sharded:
            lo = rank * g.numel()
            params[lo:lo + g.numel()] -= g
            dist.all_gather_into_tensor(params, params[lo:lo + g.numel()].clone())
        else:
            params -= g
        progress(rank, step)
    finish()


if __name__ == "__main__":
    main()
