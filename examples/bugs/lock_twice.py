"""Rank 2 takes a non-reentrant ``threading.Lock`` twice: a self-deadlock; the others wait for it.

``update_stats`` holds ``STATS_LOCK`` and calls ``record`` which takes it again. Only rank 2 takes
that path (it is the rank that logs the histogram at step 3). It blocks for ever in
``STATS_LOCK.acquire``; ranks 0, 1, 3 wait in ``all_reduce``.

    torchrun --nproc-per-node 4 examples/bugs/lock_twice.py
"""

import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "collective-mismatch", "culprits": [2], "world": 4,
         "why": "rank 2 waits for STATS_LOCK, which it holds itself (record() inside update_stats())"}

STATS_LOCK = threading.Lock()
STATS = {}


def record(name, value):
    with STATS_LOCK:  # the bug: already held by update_stats on this path
        STATS[name] = value


def update_stats(step, x, histogram):
    with STATS_LOCK:
        STATS["step"] = step
        if histogram:
            record("hist", x.histc(bins=4).tolist())


def main():
    rank, world = init()
    x = torch.ones(32)
    for step in range(8):
        if step == 3:
            hang_point(rank, "lock" if rank == 2 else "all_reduce")
        update_stats(step, x, histogram=(rank == 2 and step == 3))
        dist.all_reduce(x)
        x /= world
        progress(rank, step)
    finish()


if __name__ == "__main__":
    main()
