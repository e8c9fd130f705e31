"""NCCL: rank 1 skips a broadcast at step 3.

Every step does all_reduce([1024]) then broadcast([256], src=0), then reads the loss with .item().
At step 3 rank 1 skips the broadcast. NCCL collectives are asynchronous: rank 0's broadcast is
paired with rank 1's next all_reduce, and both ranks end up blocked in the host sync (.item()),
not in the collective that is wrong. Run: torchrun --nproc-per-node 2 nccl_skip_broadcast.py
"""

import torch
import torch.distributed as dist
from _common import init, step_marker


def train():
    rank, _ = init()
    x = torch.ones(1024, device="cuda")
    for step in range(100000):
        dist.all_reduce(x)
        x /= dist.get_world_size()
        if not (step == 3 and rank == 1):  # the bug: a rank-dependent branch
            params = torch.full((256,), float(step), device="cuda")
            dist.broadcast(params, src=0)
        loss = x.sum().item()  # host sync: where the Python stack shows the ranks
        step_marker()
        if step % 50 == 0 and rank == 0:
            print(f"step {step} loss {loss}", flush=True)


if __name__ == "__main__":
    train()
