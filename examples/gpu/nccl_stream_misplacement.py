"""NCCL: a backward-phase all_reduce issued on the forward stream on one rank.

Pipeline engines keep one CUDA stream and one process group per phase. Rank 0 (correct) issues the
gradient all_reduce X on the backward stream, makes the forward stream wait for it, then issues the
activation all_reduce Y on the forward stream. Rank 1 issues Y first (another pipeline stage, so a
different host order is legal), then, wrongly, X on the forward stream, behind Y. GPU-side:
rank 0's Y waits for X, X waits for rank 1's X, which waits for rank 1's Y on the same stream,
which waits for rank 0's Y: a cross-rank, cross-stream deadlock. Both hosts block in synchronize().
"""

import os

import torch
import torch.distributed as dist
from _common import init, step_marker

try:
    from hangdoc import phase
except Exception:  # hangdoc not installed: phases are only labels
    import contextlib

    def phase(name):
        return contextlib.nullcontext()


def train():
    rank, world = init()
    misplace_step = int(os.environ.get("SCENARIO_MISPLACE_STEP", "3"))
    pg_fwd = dist.new_group(list(range(world)))
    pg_bwd = dist.new_group(list(range(world)))
    fwd, bwd = torch.cuda.Stream(), torch.cuda.Stream()
    a = torch.ones(1 << 16, device="cuda")
    g = torch.ones(1 << 16, device="cuda")
    # create both communicators in the same order on every rank
    dist.all_reduce(a, group=pg_fwd)
    dist.all_reduce(g, group=pg_bwd)
    torch.cuda.synchronize()
    for step in range(100000):
        wrong = rank == 1 and step >= misplace_step
        if rank == 0:
            with phase("backward"), torch.cuda.stream(bwd):
                dist.all_reduce(g, group=pg_bwd)  # X
            fwd.wait_stream(bwd)
            with phase("forward"), torch.cuda.stream(fwd):
                dist.all_reduce(a, group=pg_fwd)  # Y
        else:
            with phase("forward"), torch.cuda.stream(fwd):
                dist.all_reduce(a, group=pg_fwd)  # Y
            with phase("backward"), torch.cuda.stream(fwd if wrong else bwd):
                dist.all_reduce(g, group=pg_bwd)  # X: the bug puts it on the forward stream
            fwd.wait_stream(bwd)
        torch.cuda.synchronize()
        a.fill_(1.0)
        g.fill_(1.0)
        step_marker()


if __name__ == "__main__":
    train()
