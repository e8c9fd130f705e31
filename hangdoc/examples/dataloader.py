"""A DataLoader worker of one rank never returns its batch; the other ranks wait in all_reduce.

The stuck rank sits in ``DataLoader.__next__`` (its main thread polls the worker's queue forever),
the healthy ranks sit in the next ``all_reduce``. hangdoc should blame the rank waiting on its
DataLoader, not the many waiting in the collective.
"""

import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from _common import init, progress  # noqa: E402


class Shards(Dataset):
    def __init__(self, rank, stuck_rank, stuck_at):
        self.rank, self.stuck_rank, self.stuck_at = rank, stuck_rank, stuck_at

    def __len__(self):
        return 100

    def __getitem__(self, i):
        if self.rank == self.stuck_rank and i >= self.stuck_at:
            threading.Event().wait()  # the bug: a read that never returns (dead NFS, a lock)
        return torch.full((4,), float(i))


def main():
    rank, world = init()
    stuck_rank = int(os.environ.get("STUCK_RANK", min(1, world - 1)))
    loader = DataLoader(Shards(rank, stuck_rank, stuck_at=3), batch_size=1, num_workers=1)
    for step, batch in enumerate(loader):
        dist.all_reduce(batch)
        progress(rank, step)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
