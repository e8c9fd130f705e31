"""A DataLoader worker forked while a thread held a lock: the worker blocks, its rank waits for a batch.

Rank 1 has a "metrics" thread that holds ``STATS_LOCK`` while it flushes; the dataset's
``__getitem__`` takes the same lock. The worker is forked while the lock is held (forced here; a
race in real life), inherits it held, and blocks in its first ``__getitem__``. Rank 1 waits in the
DataLoader; ranks 0, 2, 3 wait in ``all_reduce`` for it.

    torchrun --nproc-per-node 4 examples/bugs/dataloader_deadlock.py
"""

import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "dataloader-stall", "culprits": [1], "world": 4,
         "why": "rank 1's DataLoader worker inherited STATS_LOCK held at fork and blocks in __getitem__"}

STATS_LOCK = threading.Lock()


class CountingDataset(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, index):
        with STATS_LOCK:
            pass
        return torch.full((4,), float(index), device="cpu")  # a forked worker: never CUDA


def flusher(holding, hold):
    while True:
        with STATS_LOCK:
            holding.set()
            time.sleep(hold)
        time.sleep(0.01)


def main():
    rank, world = init()
    weights = torch.ones(16)
    dist.broadcast(weights, src=0)  # the model's weights, before the first epoch
    progress(rank, -1)
    holding = threading.Event()
    t = threading.Thread(target=flusher, args=(holding, 600.0 if rank == 1 else 0.001), name="metrics", daemon=True)
    if rank == 1:
        t.start()
        holding.wait()  # the race, made certain
    loader = DataLoader(CountingDataset(), batch_size=4, num_workers=1, multiprocessing_context="fork")
    total = torch.zeros(4)
    hang_point(rank, "first batch" if rank == 1 else "all_reduce")
    batches = iter(loader)
    if rank != 1:
        t.start()
    for step, batch in enumerate(batches):
        total += batch.to(total.device).sum(0)
        dist.all_reduce(total)
        progress(rank, step)
    finish()


if __name__ == "__main__":
    main()
