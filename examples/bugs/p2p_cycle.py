"""A ring exchange where every rank receives before it sends: a recv cycle of all four ranks.

Each rank should pass its activation to the next rank and get the previous rank's; written as
``recv(prev)`` then ``send(next)`` on every rank, every rank waits in ``recv`` for a sender that
itself waits in ``recv``.

    torchrun --nproc-per-node 4 examples/bugs/p2p_cycle.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "p2p-cycle", "culprits": [0, 1, 2, 3], "world": 4,
         "why": "every rank recv(prev) before send(next): 0<-3<-2<-1<-0"}


def main():
    rank, world = init()
    x = torch.ones(16) * rank
    for step in range(2):
        dist.all_reduce(x)
        progress(rank, step)
    buf = torch.empty(16)
    hang_point(rank, f"recv(src={(rank - 1) % world})")
    dist.recv(buf, src=(rank - 1) % world)  # the bug: everybody receives first
    dist.send(x, dst=(rank + 1) % world)
    finish()


if __name__ == "__main__":
    main()
