"""One rank skips a broadcast: the classic collective mismatch.

Every rank runs the same loop of ``all_reduce`` + ``broadcast``; at step 3 rank 2 takes a code path
(``if rank == skip_rank and step == 3: continue``) that jumps over the broadcast and goes on to the
next step's ``all_reduce``. Nobody moves again, but what the stacks show depends on the backend:
with gloo a non-root rank's ``broadcast`` returns once it has received the data, so ranks 1 and 3
go on into the next ``all_reduce`` together with the culprit rank 2, and only the root, rank 0,
stays in ``broadcast`` (it cannot send to rank 2). The odd one out in the stacks (rank 0) is *not*
the culprit; the collective records tell. With ``SKIP_RANK=0`` (the root skips) the stacks show
ranks 1-3 in ``broadcast`` and the culprit alone in ``all_reduce``.

    python -m torch.distributed.run --nproc-per-node 4 examples/hangs/skip_broadcast.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import hang_point, init  # noqa: E402


def sync_params(params, rank):
    dist.broadcast(params, src=0)


def train_step(step, params, rank):
    grad = torch.ones(8) * (rank + step)
    dist.all_reduce(grad)
    params -= 0.01 * grad
    return params


def main():
    rank, world = init()
    skip_rank = int(os.environ.get("SKIP_RANK", "2"))
    params = torch.zeros(8)
    for step in range(10):
        if step == 3:
            hang_point(rank, "skips broadcast" if rank == skip_rank else "broadcast")
        params = train_step(step, params, rank)
        if rank == skip_rank and step == 3:
            continue  # the bug: this rank never joins the broadcast of step 3
        sync_params(params, rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
