"""A rank that is stopped (SIGSTOP: ``kill -STOP``, a debugger, a frozen node): the others wait.

Ranks all-reduce in a loop; at step 5 rank 1 stops itself with ``SIGSTOP`` and never runs again,
so ranks 0, 2, 3 wait in ``all_reduce``. A dumper cannot always read a stopped process: py-spy
either reports it or fails, which hangdoc must show as an unresponsive process, not drop.

    python -m torch.distributed.run --nproc-per-node 4 examples/hangs/stopped_rank.py
"""

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import hang_point, init  # noqa: E402


def step_fn(x):
    dist.all_reduce(x)
    return x / dist.get_world_size()


def main():
    rank, world = init()
    stop_rank = int(os.environ.get("STOP_RANK", "1"))
    x = torch.ones(4)
    for step in range(100):
        if step == 5:
            hang_point(rank, "stops" if rank == stop_rank else "all_reduce")
            if rank == stop_rank:
                os.kill(os.getpid(), signal.SIGSTOP)
        x = step_fn(x)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
