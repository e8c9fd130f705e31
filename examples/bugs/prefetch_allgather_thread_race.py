"""Two threads issue collectives on the same group: rank 2's prefetch all_gather comes after its all_reduce.

Each step a prefetch thread (a one-worker ``ThreadPoolExecutor``) all-gathers the next layer's
sharded weights while the main thread computes and then all-reduces the gradient of the replicated
embedding, both on the default process group. Collectives on one group are matched by the order in
which each rank issues them, and nothing orders these two: on every rank the prefetch usually
wins (its ``all_gather`` goes out at once, the ``all_reduce`` after 0.2 s of compute). At step 2
rank 2's prefetch first reads layer 3's shard from a cold local disk (0.6 s), so rank 2 issues
``all_reduce`` first and ``all_gather`` second, the opposite of ranks 0, 1, 3. Measured on gloo: all
four ranks hang until the timeout, each with one thread in ``all_gather`` and one in
``all_reduce``. The bug is the unordered use of one group from two threads; rank 2 is the rank
whose order differs.

    torchrun --nproc-per-node 4 examples/bugs/prefetch_allgather_thread_race.py
"""

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "collective-mismatch", "culprits": [2], "world": 4,
         "why": "at step 2 rank 2's prefetch thread is late (cold disk read), so rank 2 issues all_reduce before all_gather on the default group where ranks 0, 1, 3 issue all_gather first"}

LAYERS, SHARD, EMB = 6, 2048, 4096


def load_shard(rank, layer, device):
    if rank == 2 and layer == 3:
        time.sleep(0.6)  # layer 3's shard is not in rank 2's page cache
    return torch.full((SHARD,), float(layer * 10 + rank), device=device)


def gather_layer(rank, world, layer, device):
    shard = load_shard(rank, layer, device)  # (a thread does not inherit the default device)
    full = [torch.empty(SHARD, device=device) for _ in range(world)]
    dist.all_gather(full, shard)  # on the default group, from the prefetch thread
    return torch.cat(full)


def main():
    rank, world = init()
    prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch")
    emb = torch.zeros(EMB)
    device = torch.get_default_device()
    weights = gather_layer(rank, world, 0, device)
    for step in range(LAYERS - 1):
        if step == 2:
            hang_point(rank, "all_reduce, then all_gather (late prefetch)" if rank == 2 else "all_gather (prefetch), then all_reduce")
        nxt = prefetcher.submit(gather_layer, rank, world, step + 1, device)  # the bug: unordered with the all_reduce below
        time.sleep(0.2)  # forward and backward of this layer
        grad = torch.randn(EMB) * 0.01 + weights.mean() * 1e-3
        dist.all_reduce(grad)  # on the default group, from the main thread
        emb -= grad / world
        weights = nxt.result()
        progress(rank, step)
    prefetcher.shutdown()
    finish()


if __name__ == "__main__":
    main()
