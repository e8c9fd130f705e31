"""NCCL: on rank 1 a DataLoader worker deadlocks on a lock inherited at fork.

A background thread in rank 1 holds a lock at the moment the DataLoader forks its worker; the
worker's __getitem__ takes the same lock and never gets it. Rank 1's main thread waits for a batch;
rank 0 waits for rank 1 in the next all_reduce (NCCL: rank 0 blocks in the host sync).
"""

import threading
import time

import torch
import torch.distributed as dist
from _common import init, step_marker

LOCK = threading.Lock()


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 1 << 20

    def __getitem__(self, i):
        with LOCK:  # in the forked worker this lock may be held forever
            return torch.ones(16)


def hold_lock_forever():
    LOCK.acquire()
    time.sleep(3600)


def train():
    rank, _ = init()
    x = torch.ones(1024, device="cuda")
    for _ in range(3):  # a few healthy steps first
        dist.all_reduce(x)
        _ = x.sum().item()
    if rank == 1:
        # e.g. a logging or prefetch thread that happens to hold the lock when the worker forks
        threading.Thread(target=hold_lock_forever, daemon=True).start()
        time.sleep(0.2)
    loader = torch.utils.data.DataLoader(Data(), batch_size=4, num_workers=1 if rank == 1 else 0)
    for batch in loader:
        dist.all_reduce(x)
        x /= dist.get_world_size()
        _ = (x.sum() + batch.sum().cuda()).item()
        step_marker()


if __name__ == "__main__":
    train()
