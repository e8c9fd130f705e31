"""Slow, not hung: rank 0 writes a 20 s checkpoint at step 3 under an 8 s hang timeout, then all go on.

The others wait in ``all_reduce`` for 20 s; then the job resumes and ends normally. A verdict that
blames rank 0 for a hang and is never retracted is wrong; so is "no progress" left standing.
(``CHECKPOINT_SECONDS`` changes the 20 s; keep it 2.5 times the hang timeout.)

    torchrun --nproc-per-node 4 examples/bugs/slow_checkpoint.py
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "slow-not-hung", "culprits": [], "world": 4, "slow": [0],
         "why": "rank 0 spends 20 s writing a checkpoint at step 3; the job then finishes"}


def save_checkpoint(path, state, seconds):
    deadline = time.monotonic() + seconds
    with open(path, "wb") as f:
        while time.monotonic() < deadline:  # a slow file system, chunk by chunk
            torch.save(state, f)
            time.sleep(0.5)


def main():
    rank, world = init()
    w = torch.ones(256)
    seconds = float(os.environ.get("CHECKPOINT_SECONDS", "20"))
    for step in range(6):
        if step == 3:
            hang_point(rank, "checkpoint" if rank == 0 else "all_reduce")
            if rank == 0:
                save_checkpoint(os.devnull, {"w": w}, seconds)
        dist.all_reduce(w)
        w /= world
        progress(rank, step)
    finish()


if __name__ == "__main__":
    main()
