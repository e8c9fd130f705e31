"""Rank 1 raises in its main thread; a non-daemon thread keeps the process alive; the others wait.

At step 3 rank 1's loss computation raises ``ValueError`` (a NaN check). The traceback is printed
and the main thread ends, but the process does not exit: a non-daemon "heartbeat" thread (a
metrics pusher) still runs, so the launcher sees no failure. Ranks 0, 2, 3 wait in ``all_reduce``.

    torchrun --nproc-per-node 4 examples/bugs/exception_thread.py
"""

import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "rank-failed", "culprits": [1], "world": 4,
         "why": "rank 1 raised ValueError in check_loss at step 3; a non-daemon thread keeps it alive"}


def heartbeat():
    while True:  # a metrics pusher that nobody told to stop
        time.sleep(0.5)


def check_loss(loss, step, rank):
    if rank == 1 and step == 3:
        raise ValueError(f"loss is nan at step {step}")  # the bug's symptom: only rank 1 sees it
    return loss


def main():
    rank, world = init()
    threading.Thread(target=heartbeat, name="heartbeat", daemon=False).start()
    x = torch.ones(32)
    for step in range(8):
        if step == 3:
            hang_point(rank, "raises" if rank == 1 else "all_reduce")
        check_loss(x.sum(), step, rank)
        dist.all_reduce(x)
        x /= world
        progress(rank, step)
    dist.destroy_process_group()
    os._exit(0)  # the healthy ending: the heartbeat thread would keep the process otherwise


if __name__ == "__main__":
    main()
