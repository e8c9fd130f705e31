"""A pipeline exchange where both stages receive first: recv/recv, a send/recv cycle.

    torchrun --nproc-per-node 2 examples/records/recv_cycle.py
"""
from _common import dist, finish, setup, torch

rank, world = setup()
act = torch.ones(32)
dist.all_reduce(act)  # a warm-up collective that does complete
other = 1 - rank
buf = torch.empty(32)
dist.recv(buf, src=other)  # the bug: both ranks wait to receive before anyone sends
dist.send(act, dst=other)
finish()
