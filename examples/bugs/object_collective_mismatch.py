"""Rank 3 sends its validation metrics with ``gather_object`` while the others ``all_gather_object``.

Every 3 steps each rank evaluates its validation shards and the metrics are collected by
``collect_metrics``: a rank that has validation data all-gathers them (every such rank runs the
early-stopping check itself), a rank without ("nothing to check") only sends its metrics to rank 0
with ``gather_object``. The 3 validation shards go to ranks 0-2, so rank 3 takes the second branch.
Both start with an all-gather of the pickled sizes, which matches; then ranks 0-2 wait in the
all-gather of the pickled objects and rank 3 in a gather: they never match.

    torchrun --nproc-per-node 4 examples/bugs/object_collective_mismatch.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "collective-mismatch", "culprits": [3], "world": 4,
         "why": "rank 3 (no validation shard) called gather_object where ranks 0-2 called all_gather_object (step 2)"}

VAL_SHARDS = ["val-00", "val-01", "val-02"]


def collect_metrics(metrics, has_val, world):
    if has_val:
        everyone = [None] * world
        dist.all_gather_object(everyone, metrics)
        return everyone
    dist.gather_object(metrics, None, dst=0)  # the bug: the others are in all_gather_object
    return None


def main():
    rank, world = init()
    my_val = VAL_SHARDS[rank::world]
    w = torch.ones(32)
    for step in range(8):
        grad = torch.full((32,), float(rank + 1))
        dist.all_reduce(grad)
        w -= 0.01 * grad / world
        if step % 3 == 2:
            metrics = {"rank": rank, "val_loss": float(w.sum()) / (1 + len(my_val)), "shards": my_val}
            hang_point(rank, "gather_object" if not my_val else "all_gather_object")
            everyone = collect_metrics(metrics, bool(my_val), world)
            if everyone and min(m["val_loss"] for m in everyone) < 0:
                break
        progress(rank, step)
    finish()


if __name__ == "__main__":
    main()
