"""Rank 2 is killed (SIGKILL: the OOM killer, a node failure) at step 4; the others wait for it.

    torchrun --nproc-per-node 4 examples/bugs/dead_rank.py
"""

import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "rank-failed", "culprits": [2], "world": 4,
         "why": "rank 2 was killed with SIGKILL at step 4"}


def main():
    rank, world = init()
    x = torch.ones(64)
    for step in range(8):
        if step == 4:
            hang_point(rank, "killed" if rank == 2 else "all_reduce")
            if rank == 2:
                time.sleep(0.5)  # let the others enter the all_reduce first
                os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(x)
        x /= world
        progress(rank, step)
    finish()


if __name__ == "__main__":
    main()
