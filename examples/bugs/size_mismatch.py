"""Rank 3 all-reduces a tensor of another size (its last bucket holds 16 floats, the others' 8).

Every rank all-reduces a bucket of gradients; rank 3 built its buckets from a model with one more
layer, so at step 3 its bucket has 16 elements where the others' have 8. gloo aborts a receiving
process (enforce failure: message longer than its buffer); measured here, the job dies within a
second of the call. The bug is rank 3's size, whichever process gloo kills.

    torchrun --nproc-per-node 4 examples/bugs/size_mismatch.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "collective-mismatch", "culprits": [3], "world": 4,
         "why": "rank 3 all-reduced a [16] tensor where ranks 0-2 all-reduced [8] (step 3)"}


def main():
    rank, world = init()
    for step in range(8):
        n = 16 if (rank == 3 and step == 3) else 8  # the bug
        bucket = torch.ones(n)
        if step == 3:
            hang_point(rank, f"all_reduce [{n}]")
        dist.all_reduce(bucket)
        progress(rank, step)
    finish()


if __name__ == "__main__":
    main()
