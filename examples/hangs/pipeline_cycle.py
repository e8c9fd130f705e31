"""A pipeline whose two middle stages both ``recv`` before they ``send``: a recv/recv cycle.

Four stages, ranks 0..3. The forward pass should go 0 → 1 → 2 → 3. Stage 2 was "optimised" to
first receive the gradient of the previous micro-batch from stage 1 (which only sends it after it
has itself received an activation back from stage 2), so stage 1 waits in ``recv(src=2)`` and
stage 2 waits in ``recv(src=1)`` forever. Stage 0 is stuck in ``send(dst=1)`` (or has finished
sending) and stage 3 waits in ``recv(src=2)``.

    python -m torch.distributed.run --nproc-per-node 4 examples/hangs/pipeline_cycle.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import hang_point, init  # noqa: E402


def stage_forward(x):
    return torch.tanh(x) * 2


def recv_activation(src):
    buf = torch.empty(16)
    dist.recv(buf, src=src)
    return buf


def send_activation(x, dst):
    dist.send(x, dst=dst)


def run_stage(rank, world):
    if rank == 0:
        hang_point(rank, "send to 1")
        send_activation(stage_forward(torch.ones(16)), dst=1)
        grad = recv_activation(src=1)
        return grad
    if rank == 1:
        hang_point(rank, "recv from 2")
        back = recv_activation(src=2)  # the bug: waits for stage 2 before forwarding
        x = recv_activation(src=0)
        send_activation(stage_forward(x) + back, dst=2)
        return x
    if rank == 2:
        hang_point(rank, "recv from 1")
        x = recv_activation(src=1)
        send_activation(stage_forward(x), dst=1)
        send_activation(stage_forward(x), dst=3)
        return x
    hang_point(rank, "recv from 2")
    return recv_activation(src=world - 2)


def main():
    rank, world = init()
    run_stage(rank, world)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
