"""NCCL: a two-stage pipeline whose stage 1 receives before it sends, while stage 0 also receives first.

Stage 0 waits for a gradient from stage 1 before sending its activation; stage 1 waits for that
activation. A p2p cycle: rank 0 recv<-1, rank 1 recv<-0.
"""

import torch
import torch.distributed as dist
from _common import init, step_marker


def train():
    rank, _ = init()
    act = torch.ones(4096, device="cuda")
    grad = torch.zeros(4096, device="cuda")
    for step in range(100000):
        if rank == 0:
            if step < 3:
                dist.send(act, dst=1)
                dist.recv(grad, src=1)
            else:  # the bug: the schedule receives the gradient first from step 3 on
                dist.recv(grad, src=1)
                dist.send(act, dst=1)
        else:
            dist.recv(act, src=0)
            dist.send(act * 2, dst=0)
        _ = grad.sum().item()
        step_marker()


if __name__ == "__main__":
    train()
