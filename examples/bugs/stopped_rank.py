"""Rank 1 is stopped (SIGSTOP: ``kill -STOP``, a debugger, a frozen node) at step 4; the others wait.

    torchrun --nproc-per-node 4 examples/bugs/stopped_rank.py
"""

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "unresponsive-process", "culprits": [1], "world": 4,
         "why": "rank 1 stopped itself with SIGSTOP at step 4"}


def main():
    rank, world = init()
    x = torch.ones(64)
    for step in range(8):
        if step == 4:
            hang_point(rank, "stops" if rank == 1 else "all_reduce")
            if rank == 1:
                os.kill(os.getpid(), signal.SIGSTOP)
        dist.all_reduce(x)
        x /= world
        progress(rank, step)
    finish()


if __name__ == "__main__":
    main()
