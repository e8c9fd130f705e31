"""A DataLoader worker deadlocks on a lock that was held by a background thread at fork time.

Every rank has a background "metrics" thread that takes ``STATS_LOCK`` while it flushes counters,
and the dataset's ``__getitem__`` takes the same lock to count samples. The DataLoader forks its
workers; on rank 1 the fork happens while the metrics thread holds the lock (forced here, a timing
race in real life). The forked worker inherits a *held* lock but not the thread that would release
it, so its first ``__getitem__`` blocks for ever. Rank 1's main thread waits in the DataLoader for a
batch that never comes; ranks 0, 2, 3 got their batches and wait in ``all_reduce`` for rank 1.

    python -m torch.distributed.run --nproc-per-node 4 examples/hangs/dataloader_deadlock.py
"""

import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from _common import hang_point, init  # noqa: E402

STATS_LOCK = threading.Lock()
SAMPLES_SEEN = [0]


class CountingDataset(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, index):
        with STATS_LOCK:  # in a forked worker whose lock was held at fork: blocks for ever
            SAMPLES_SEEN[0] += 1
        return torch.full((4,), float(index))


def metrics_flusher(holding, hold_seconds):
    while True:
        with STATS_LOCK:
            holding.set()
            time.sleep(hold_seconds)  # "flushing" while holding the lock
        time.sleep(0.01)


def main():
    rank, world = init()
    bad_rank = int(os.environ.get("DEADLOCK_RANK", "1"))
    holding = threading.Event()
    flusher = threading.Thread(target=metrics_flusher, args=(holding, 30.0 if rank == bad_rank else 0.001),
                               name="metrics-flusher", daemon=True)
    if rank == bad_rank:
        # The race, made certain: the fork below lands while the flusher holds the lock.
        flusher.start()
        holding.wait()
    loader = DataLoader(CountingDataset(), batch_size=4, num_workers=1, multiprocessing_context="fork")
    total = torch.zeros(4)
    hang_point(rank, "first batch")
    batches = iter(loader)  # forks the worker
    if rank != bad_rank:
        flusher.start()  # the lucky ranks: the lock was free when they forked
    for batch in batches:
        total += batch.sum(0)
        dist.all_reduce(total)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
