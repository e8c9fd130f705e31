"""Rank 2 deadlocks between two of its own threads (lock order A->B against B->A); the others wait.

Rank 2 is the rank that exports metrics: from step 3 a background exporter thread snapshots the
metric registry. It takes ``REGISTRY_LOCK`` and then, to read the counters, ``COUNTERS_LOCK``. The
training loop updates the counters under ``COUNTERS_LOCK`` and registers a new metric (the
gradient norm, first seen at step 3) under ``REGISTRY_LOCK`` while still holding it: the classic
ABBA order. Each thread holds one lock and waits for the other; rank 2's main thread never reaches
the ``all_reduce`` where ranks 0, 1, 3 wait.

    torchrun --nproc-per-node 4 examples/bugs/abba_threads.py
"""

import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "collective-mismatch", "culprits": [2], "world": 4,
         "why": "rank 2's main thread holds COUNTERS_LOCK and waits for REGISTRY_LOCK, held by its exporter thread that waits for COUNTERS_LOCK (ABBA)"}

REGISTRY_LOCK = threading.Lock()
COUNTERS_LOCK = threading.Lock()
REGISTRY = {"loss": 0.0}
COUNTERS = {}


def exporter():
    while True:
        with REGISTRY_LOCK:  # B ...
            names = list(REGISTRY)
            time.sleep(0.5)  # serialising the registry
            with COUNTERS_LOCK:  # ... then A
                snapshot = {n: COUNTERS.get(n) for n in names}
        del snapshot
        time.sleep(1.0)


def log_metric(name, value):
    with COUNTERS_LOCK:  # A ...
        COUNTERS[name] = value
        if name not in REGISTRY:
            time.sleep(0.5)  # building the new metric's histogram buckets
            with REGISTRY_LOCK:  # ... then B: the bug, the opposite order of exporter()
                REGISTRY[name] = 0.0


def main():
    rank, world = init()
    w = torch.ones(64)
    for step in range(8):
        grad = torch.full((64,), float(rank + step))
        if rank == 2 and step == 3:
            threading.Thread(target=exporter, name="metrics-exporter", daemon=True).start()
        if step == 3:
            hang_point(rank, "ABBA locks" if rank == 2 else "all_reduce")
        log_metric("loss", float(grad.mean()))
        if step >= 3:
            log_metric("grad_norm", float(grad.norm()))
        dist.all_reduce(grad)
        w -= 0.01 * grad / world
        progress(rank, step)
    finish()


if __name__ == "__main__":
    main()
