"""Epoch 1's DataLoader workers are forked while a vocab-reload thread holds the tokenizer's cache lock (rank 2).

The dataset tokenizes in ``__getitem__`` through a tokenizer whose encode cache is guarded by a
``threading.Lock``. A background thread of the main process reloads the merges when the
node-local vocab file has changed, holding that lock for the reload (2 s from a slow shared file
system). Workers are not persistent, so each epoch forks new ones. After epoch 0 only rank 2's
node finds its copy stale; its reload is running when epoch 1's workers are forked (forced here,
a race in real life). The parent's lock is released 2 s later, but the workers' copies stay held:
both workers block in their first ``encode`` for ever, rank 2 waits for a batch, ranks 0, 1, 3
wait in epoch 1's first ``all_reduce``.

    torchrun --nproc-per-node 4 examples/bugs/tokenizer_cache_fork.py
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

TRUTH = {"kind": "dataloader-stall", "culprits": [2], "world": 4,
         "why": "rank 2's epoch-1 DataLoader workers were forked while its vocab-reload thread held the tokenizer lock; they block in __getitem__"}


class Tokenizer:
    def __init__(self):
        self.lock, self.cache, self.reloading = threading.Lock(), {}, threading.Event()

    def encode(self, word):
        with self.lock:
            if word not in self.cache:
                self.cache[word] = [ord(c) % 256 for c in word]
            return self.cache[word]

    def reload(self, seconds):
        with self.lock:
            self.reloading.set()
            time.sleep(seconds)  # merges.txt from the shared file system
            self.cache.clear()


TOKENIZER = Tokenizer()


class Texts(Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        ids = [t for w in f"sample {i} of the corpus".split() for t in TOKENIZER.encode(w)]
        return torch.tensor(ids[:16] + [0] * (16 - len(ids[:16])), dtype=torch.float32, device="cpu")


def main():
    rank, world = init()
    loader = DataLoader(Texts(), batch_size=8, num_workers=2, multiprocessing_context="fork")
    w, step = torch.zeros(16), 0
    for epoch in range(2):
        if epoch == 1:
            stale = rank == 2  # only rank 2's node-local vocab file changed
            if stale:
                threading.Thread(target=TOKENIZER.reload, args=(2.0,), name="vocab-reload", daemon=True).start()
                TOKENIZER.reloading.wait()  # the race, made certain
            hang_point(rank, "epoch 1, first batch" if stale else "epoch 1, all_reduce")
        for batch in loader:  # epoch 1: new workers forked here
            grad = batch.to(w.device).mean(0) * 1e-3  # the worker's CPU batch onto this rank's device (NCCL)
            dist.all_reduce(grad)
            w -= grad / world
            progress(rank, step)
            step += 1
    finish()


if __name__ == "__main__":
    main()
