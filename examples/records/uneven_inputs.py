"""Uneven inputs: the last rank has one batch fewer, finishes its loop and enters the final
barrier while the others all_reduce the gradients of their extra batch.

    torchrun --nproc-per-node 3 examples/records/uneven_inputs.py
"""
from _common import dist, finish, setup, torch

rank, world = setup()
batches = 5 if rank == world - 1 else 6
grad = torch.zeros(16)
for _ in range(batches):
    grad += 1
    dist.all_reduce(grad)
dist.barrier()
finish()
