"""A DataLoader worker stuck in the dataset's ``__getitem__`` (a read that never returns) on rank 3.

The dataset reads each sample from a "remote" store; on rank 3 the read of sample 20 blocks for
ever (modelled by a FIFO nobody writes to). Rank 3's main thread waits for the batch from its
worker; ranks 0-2 wait in ``all_reduce``.

    torchrun --nproc-per-node 4 examples/bugs/dataloader_getitem.py
"""

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "dataloader-stall", "culprits": [3], "world": 4,
         "why": "rank 3's DataLoader worker blocks in RemoteDataset.__getitem__ (read of sample 20)"}


class RemoteDataset(Dataset):
    def __init__(self, rank, stuck_path):
        self.rank, self.stuck_path = rank, stuck_path

    def __len__(self):
        return 64

    def __getitem__(self, index):
        if self.rank == 3 and index == 20:
            with open(self.stuck_path, "rb") as f:  # the bug: a read with no timeout that never returns
                f.read(1)
        return torch.full((4,), float(index), device="cpu")  # a forked worker: never CUDA


def main():
    rank, world = init()
    stuck = os.path.join(tempfile.mkdtemp(prefix=f"bug-fifo-{rank}-"), "sample-20")
    os.mkfifo(stuck)
    loader = DataLoader(RemoteDataset(rank, stuck), batch_size=4, num_workers=2, multiprocessing_context="fork")
    total = torch.zeros(4)
    for step, batch in enumerate(loader):
        if step == 4:
            hang_point(rank, "batch 5" if rank == 3 else "all_reduce")
        total += batch.to(total.device).sum(0)
        dist.all_reduce(total)
        progress(rank, step)
    finish()


if __name__ == "__main__":
    main()
