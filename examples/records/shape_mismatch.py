"""Rank 1 all_reduces a tensor of another shape (or, with --dtype, another dtype) at step 3.

gloo does not check: the smaller side returns with garbage and moves on to the barrier, the other
rank waits for bytes that never come. (With three or more ranks, or a larger tensor on one rank,
gloo aborts the receiving rank instead of hanging.)

    torchrun --nproc-per-node 2 examples/records/shape_mismatch.py [--dtype]
"""
import sys

from _common import dist, finish, setup, torch

rank, world = setup()
for step in range(4):
    x = torch.ones(8)
    if rank == 1 and step == 3:  # the bug: a rank-dependent shape or dtype
        x = torch.ones(8, dtype=torch.float16) if "--dtype" in sys.argv else torch.ones(6)
    dist.all_reduce(x)
dist.barrier()
finish()
