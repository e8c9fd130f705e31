"""Rank 3 broadcasts the resumed weights with ``src=3``: it picks the "leader" from its own disk.

On resume, the rank that finds the checkpoint on its node-local disk is meant to load it and
broadcast the weights to the others (``src = rank if found else 0``, written when only rank 0 ever
saved). Rank 3 runs on a node that still holds a stale ``latest.pt`` from an earlier job, so it
loads that and calls ``broadcast(src=3)`` while ranks 0, 1, 2, 4 call ``broadcast(src=0)``: two
roots. Measured on gloo (a tree broadcast): ranks 0, 2 and 4 finish rank 0's broadcast and wait
in step 0's ``all_reduce``; rank 1 (relaying rank 0's weights to rank 3, which never takes them)
and rank 3 (sending its own weights to ranks that do not expect them) stay in ``broadcast`` until
the gloo timeout. The bug is rank 3's rank-local ``src``, not rank 1.

    torchrun --nproc-per-node 5 examples/bugs/broadcast_local_leader.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "collective-mismatch", "culprits": [3], "world": 5,
         "why": "rank 3 found a stale checkpoint on its node-local disk and called broadcast(src=3) where ranks 0, 1, 2, 4 called broadcast(src=0)"}

NUMEL = 4096


def find_local_checkpoint(rank):
    # what os.path.exists(f"/local_ssd/{job}/latest.pt") says on each rank's node; rank 3's node kept one
    # from an earlier run of the same job name
    return {0: "/local_ssd/run/latest.pt (step 1200)", 3: "/local_ssd/run/latest.pt (step 300, stale)"}.get(rank)


def resume(params, rank):
    ckpt = find_local_checkpoint(rank)
    src = rank if ckpt is not None else 0  # the bug: the leader is decided from a rank-local fact
    if ckpt is not None:
        params.fill_(float(rank + 1))  # torch.load(ckpt)["params"]
        print(f"rank {rank}: resuming from {ckpt}, broadcasting it", flush=True)
    hang_point(rank, f"broadcast(src={src})")
    dist.broadcast(params, src=src)


def main():
    rank, world = init()
    params = torch.zeros(NUMEL)
    resume(params, rank)
    for step in range(6):
        grad = torch.randn(NUMEL) * 0.01 + params * 1e-3
        dist.all_reduce(grad)
        params -= 0.1 * grad / world
        progress(rank, step)
    finish()


if __name__ == "__main__":
    main()
