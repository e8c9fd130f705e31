"""DistributedSampler over a dataset that each rank built differently: rank 2 gets one batch fewer.

The job seeds Python's ``random`` with ``seed + rank`` at start-up (so that each rank's
augmentation differs) and only then builds the dataset, which keeps every positive example and
randomly keeps half of the "easy negatives". With the rank-offset seed each rank keeps a different
number of negatives: the dataset lengths are 98, 103, 90 and 97. ``DistributedSampler`` assumes the
same dataset on every rank; with ``drop_last=False`` it pads to ``ceil(len / world)`` samples per
rank, which here is 25, 26, 23 and 25, i.e. 4, 4, 3 and 4 batches of 8. Rank 2 finishes epoch 0
after three steps and waits in the end-of-epoch ``dist.barrier()`` (taken before rank 0 writes the
epoch's checkpoint), while ranks 0, 1, 3 run step 3's ``backward()`` and wait in DDP's bucket
``all_reduce`` (issued by the reducer's autograd hooks). Under gloo the barrier does not match the
all_reduce: all four ranks stay stuck until the gloo timeout.

    torchrun --nproc-per-node 4 examples/bugs/b4_lib_sampler_rank_seeded_subsample.py
"""

import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402
from torch.utils.data.distributed import DistributedSampler  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "collective-mismatch", "culprits": [2], "world": 4,
         "why": "the dataset's negative subsampling runs after random.seed(seed + rank): rank 2's dataset has "
                "90 examples (others 97-103), so its DistributedSampler yields 3 batches instead of 4; rank 2 "
                "waits in the end-of-epoch barrier while ranks 0, 1, 3 wait in step 3's DDP bucket all_reduce"}

SEED = 15
DIM = 16
POSITIVES = 64
NEGATIVES = 64
KEEP_NEGATIVE = 0.5
BATCH = 8
EPOCHS = 2


def seed_everything(seed):
    random.seed(seed)
    torch.manual_seed(seed)


class PairDataset(Dataset):
    """All positives plus a random half of the easy negatives (from a fixed pool)."""

    def __init__(self):
        pool = torch.Generator().manual_seed(0)
        feats = torch.randn(POSITIVES + NEGATIVES, DIM, generator=pool)
        self.items = [(feats[i], 1) for i in range(POSITIVES)]
        for j in range(NEGATIVES):
            if random.random() < KEEP_NEGATIVE:  # uses the global (rank-seeded) RNG
                self.items.append((feats[POSITIVES + j], 0))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        x, y = self.items[i]
        if random.random() < 0.3:  # augmentation: the reason for the per-rank seed
            x = x + 0.05 * torch.randn(DIM)
        return x, y


def main():
    rank, world = init()
    seed_everything(SEED + rank)  # the bug: runs before the dataset is built, not only for augmentation
    dataset = PairDataset()
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=SEED,
                                 drop_last=False)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler, num_workers=0)
    print(f"rank {rank}: {len(dataset)} examples, {len(loader)} batches per epoch", flush=True)
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(DIM, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = 0
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            if epoch == 0 and i == 3:
                hang_point(rank, "DDP backward: reducer bucket all_reduce (epoch 0, batch 3)")
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            progress(rank, step)
            step += 1
        if epoch == 0 and len(loader) < 4:
            hang_point(rank, "end-of-epoch barrier (one batch fewer)")
        dist.barrier()  # every rank done with the epoch before rank 0 writes its checkpoint
        if rank == 0:
            _ = {k: v.clone() for k, v in model.module.state_dict().items()}  # the epoch checkpoint
    finish()


if __name__ == "__main__":
    main()
