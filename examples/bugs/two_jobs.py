"""Two different jobs' dumps in one directory: a stale hang (rank 1 skipped) and today's (rank 3 skipped).

The matrix runs this scenario twice into the same output and dump directories (``RUNS``): first
with ``SKIP_RANK=1`` (yesterday's job, left there), then with ``SKIP_RANK=3`` (the job being
debugged). The verdict wanted is about the second job alone, with a warning that the directory
holds two jobs; merging them (two processes per rank) or blaming rank 1 is wrong.

    SKIP_RANK=1 torchrun --nproc-per-node 4 examples/bugs/two_jobs.py
    SKIP_RANK=3 torchrun --nproc-per-node 4 examples/bugs/two_jobs.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "collective-mismatch", "culprits": [3], "world": 4,
         "why": "the latest job: rank 3 skipped the broadcast of step 3 (the directory also holds a job where rank 1 did)"}

#: the matrix runs the scenario once per entry, into the same directories, with these variables
RUNS = [{"SKIP_RANK": "1"}, {"SKIP_RANK": "3"}]


def main():
    rank, world = init()
    skip = int(os.environ.get("SKIP_RANK", "3"))
    params = torch.zeros(8)
    for step in range(8):
        if step == 3:
            hang_point(rank, "skips broadcast" if rank == skip else "broadcast")
        grad = torch.ones(8)
        dist.all_reduce(grad)
        params -= 0.01 * grad
        if rank == skip and step == 3:
            continue  # the bug
        dist.broadcast(params, src=0)
        progress(rank, step)
    finish()


if __name__ == "__main__":
    main()
