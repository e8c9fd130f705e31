"""A pipeline whose stages all receive before they send: a point-to-point cycle.

Stage ``r`` receives activations from stage ``r-1`` (the first stage from the last one: the
"wrap-around" of a looped schedule) and only then sends to ``r+1``. Every stage waits in ``recv``
for a ``send`` that comes after someone else's ``recv``: a cycle in the wait-for graph.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import init, progress  # noqa: E402


def forward_stage(x, rank, world):
    prev, nxt = (rank - 1) % world, (rank + 1) % world
    dist.recv(x, src=prev)  # the bug: recv before send on every stage
    dist.send(x + 1, dst=nxt)
    return x


def main():
    rank, world = init()
    x = torch.zeros(4)
    for step in range(3):
        dist.all_reduce(x)
        progress(rank, step)
    forward_stage(x, rank, world)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
