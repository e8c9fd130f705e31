"""One rank skips a broadcast: the classic collective mismatch.

Every rank runs ``all_reduce`` then ``broadcast`` each step; at step 3 the last rank takes a code
path that jumps over the broadcast and goes on to the next step's ``all_reduce``. The others wait
in ``broadcast`` for it, it waits in ``all_reduce`` for them: nobody moves again. hangdoc should
name the last rank (its records lack the broadcast the others issued).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import init, progress  # noqa: E402


def sync_params(params):
    dist.broadcast(params, src=0)


def train_step(step, params, rank):
    grad = torch.ones(8) * (rank + step)
    dist.all_reduce(grad)
    params -= 0.01 * grad
    return params


def main():
    rank, world = init()
    skip_rank = int(os.environ.get("SKIP_RANK", world - 1))
    params = torch.zeros(8)
    for step in range(10):
        params = train_step(step, params, rank)
        if rank == skip_rank and step == 3:
            continue  # the bug: this rank never joins the broadcast of step 3
        sync_params(params)
        progress(rank, step)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
