"""A healthy job: busy matrix products with an ``all_reduce`` every step, no hang.

Dumps of it show every rank in compute (``torch.matmul``) or briefly in ``all_reduce`` at different
lines: what "no hang" looks like, for the negative case of the diagnosis.

    python -m torch.distributed.run --nproc-per-node 2 examples/hangs/healthy.py
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import hang_point, init  # noqa: E402


def compute(a, b):
    for _ in range(20):
        a = torch.tanh(a @ b)
    return a


def main():
    rank, world = init()
    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    b = torch.randn(256, 256) / 16
    deadline = time.monotonic() + float(os.environ.get("RUN_SECONDS", "60"))
    step = 0
    while time.monotonic() < deadline:
        a = compute(a, b)
        s = a.sum().reshape(1)
        dist.all_reduce(s)
        if step == 3:
            hang_point(rank, "busy")
        step += 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
