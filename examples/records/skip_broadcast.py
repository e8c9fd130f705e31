"""Rank 2 skips one broadcast: the root waits in broadcast, the others (rank 2 included) in the
next all_reduce, so stacks point at the root; the records name rank 2.

    torchrun --nproc-per-node 4 examples/records/skip_broadcast.py
"""
from _common import dist, finish, setup, torch

rank, world = setup()
t = torch.ones(8)
for step in range(4):
    dist.all_reduce(t)
    if step == 2 and rank != 2:  # the bug: a rank-dependent condition around a collective
        dist.broadcast(t, src=0)
dist.all_reduce(torch.ones(4))
finish()
