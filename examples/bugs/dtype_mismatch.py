"""Rank 1 all-reduces float64 where the others use float32: gloo aborts within a second.

A rank that loaded its checkpoint without ``.float()`` all-reduces a float64 tensor of the same
element count: twice the bytes. gloo kills a process with an enforce failure on the message size
in well under a second, so the job dies rather than hangs; the verdict must still name the dtype
mismatch and rank 1 every time.

    torchrun --nproc-per-node 4 examples/bugs/dtype_mismatch.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "collective-mismatch", "culprits": [1], "world": 4,
         "why": "rank 1 all-reduced float64 where ranks 0, 2, 3 all-reduced float32 (step 2)"}


def main():
    rank, world = init()
    for step in range(6):
        dtype = torch.float64 if (rank == 1 and step == 2) else torch.float32  # the bug
        t = torch.ones(1024, dtype=dtype)
        if step == 2:
            hang_point(rank, f"all_reduce {dtype}")
        dist.all_reduce(t)
        progress(rank, step)
    finish()


if __name__ == "__main__":
    main()
