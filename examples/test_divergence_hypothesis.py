"""Hypothesis finds a data-dependent collective-order bug in milliseconds, without a cluster.

``train_step`` shards a batch across the ranks. When the batch has fewer samples than there are
ranks, some ranks get an empty shard and skip the gradient all-reduce: on a real job the other
ranks then wait in ``all_reduce`` forever. The bug only shows for some batch sizes and world sizes,
which is what property-based testing is for: ``check_collective_order`` runs every rank of one
example in-process on torch's fake process group (no communication, ~1 ms per rank) and raises
with a side-by-side diff when the ranks disagree, and hypothesis searches and shrinks the inputs.

Run it (the first test fails on purpose: it demonstrates the bug; the second, fixed, passes)::

    python -m pytest examples/test_divergence_hypothesis.py

Hypothesis reports the smallest failing input, ``batch=[0], world_size=2``, with::

    CollectiveOrderError: collective order diverged (world size 2, fake backend)

    process group default_pg (ranks 0-1): rank 1 issued nothing in group default_pg, where rank 0
    issued 2 calls, the first all_reduce([] float32) at test_divergence_hypothesis.py:35
"""

import torch
import torch.distributed as dist
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from hangdoc.testing import check_collective_order


def train_step(rank, world_size, batch):
    shard = batch[rank::world_size]
    if not shard:  # the bug: a rank with nothing to do skips the gradient sync
        return
    loss = torch.tensor(float(sum(shard)))
    dist.all_reduce(loss)
    dist.broadcast(torch.zeros(4), src=0)


def train_step_fixed(rank, world_size, batch):
    shard = batch[rank::world_size]
    loss = torch.tensor(float(sum(shard)))  # an empty shard contributes zero, but still joins
    dist.all_reduce(loss)
    dist.broadcast(torch.zeros(4), src=0)


batches = st.lists(st.integers(0, 9), max_size=16)
world_sizes = st.integers(1, 8)


# No xfail: this test fails on purpose, so that running the file shows hypothesis's smallest case
# and the diff (an xfail would hide both unless run with --runxfail).
@given(batch=batches, world_size=world_sizes)
# no explain phase: its "lines only failing cases ran" would point into hangdoc, not at the bug
@settings(max_examples=300, deadline=None, phases=[p for p in Phase if p.name != "explain"])
def test_train_step_collectives_agree(batch, world_size):
    check_collective_order(train_step, world_size, args=(batch,))


@given(batch=batches, world_size=world_sizes)
@settings(max_examples=300, deadline=None)
def test_train_step_fixed_collectives_agree(batch, world_size):
    check_collective_order(train_step_fixed, world_size, args=(batch,))
