"""Rank 6 leaks activations through a debugging forward hook until the OOM killer SIGKILLs it (8 ranks).

A forward hook meant to log activation statistics keeps every output it sees, but only where
``DEBUG_ACTS`` was set, which the launcher's per-node environment does for rank 6 alone. Its
resident memory grows each step; at step 3 it passes the container's limit while computing the
forward pass and the kernel's OOM killer sends SIGKILL (simulated from inside: ``os.kill(getpid(),
SIGKILL)`` once the tracked bytes exceed the limit). It holds no lock and is in no collective when
it dies. The other seven ranks wait in the step's ``reduce_scatter_tensor`` for its gradient shard.

    torchrun --nproc-per-node 8 examples/bugs/oom_killed_activation_leak.py
"""

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "rank-failed", "culprits": [6], "world": 8,
         "why": "rank 6 was SIGKILLed (out of memory: a forward hook kept every activation) in its forward pass of step 3"}

LIMIT_BYTES = 7 * 2**18  # the headroom left in the container: 3.5 steps of kept activations (512 KiB a step)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(512, 512) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def main():
    rank, world = init()
    model = Model()
    kept = []
    if rank == 6:  # the bug: DEBUG_ACTS=1 in rank 6's environment, and the hook keeps references
        for layer in model.layers:
            layer.register_forward_hook(lambda mod, inp, out: kept.append(out.detach().clone()))
    flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    flat = torch.cat([flat, torch.zeros((-flat.numel()) % world)])
    for step in range(6):
        if step == 3:
            hang_point(rank, "OOM-killed in forward" if rank == 6 else "reduce_scatter_tensor")
        loss = model(torch.randn(64, 512)).pow(2).mean()
        if sum(t.numel() * t.element_size() for t in kept) > LIMIT_BYTES:
            os.kill(os.getpid(), signal.SIGKILL)  # what the kernel's OOM killer does
        grad = flat * 0 + loss.detach()
        shard = torch.empty(flat.numel() // world)
        dist.reduce_scatter_tensor(shard, grad)
        dist.all_gather_into_tensor(grad, shard)
        flat -= 1e-3 * grad / world
        progress(rank, step)
    finish()


if __name__ == "__main__":
    main()
