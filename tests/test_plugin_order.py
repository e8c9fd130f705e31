"""check_collective_order and the schedule replay: in-process, fast enough for hypothesis."""

from __future__ import annotations

import importlib.util
import os

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from hangdoc.model import CollectiveRecord  # noqa: E402
from hangdoc.testing import CollectiveOrderError, CollectiveTrace, check_collective_order  # noqa: E402
from hangdoc.testing.schedule import replay  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_example():
    path = os.path.join(ROOT, "examples", "test_divergence_hypothesis.py")
    spec = importlib.util.spec_from_file_location("example_divergence_hypothesis", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_agreeing_ranks_return_the_trace():
    def step(rank, world_size, n):
        for _ in range(n):
            dist.all_reduce(torch.ones(3))
        dist.broadcast(torch.zeros(2, dtype=torch.int64), src=world_size - 1)

    trace = check_collective_order(step, 5, args=(2,))
    assert isinstance(trace, CollectiveTrace)
    assert sorted(trace.by_rank) == [0, 1, 2, 3, 4]
    assert trace.ops(4) == ["all_reduce", "all_reduce", "broadcast"]
    assert trace.calls(0)[-1] == "broadcast([2] int64, src=4)"
    assert trace.divergences() == [] and trace.schedule_problems() == []
    assert not dist.is_initialized()  # left as found


def test_divergence_raises_an_assertion_with_the_diff():
    def step(rank):
        dist.all_reduce(torch.ones(4))
        if rank % 2 == 0:
            dist.broadcast(torch.ones(8), src=0)

    with pytest.raises(AssertionError) as info:
        check_collective_order(step, 5)
    err = info.value
    assert isinstance(err, CollectiveOrderError)
    text = str(err)
    assert text.startswith("collective order diverged (world size 5, fake backend)")
    assert "broadcast #1 ([8] float32, src=0)" in text
    assert sorted(r for d in err.divergences for r in d.ranks) == [1, 3]
    assert err.trace.ops(1) == ["all_reduce"] and err.trace.ops(0) == ["all_reduce", "broadcast"]


def test_subgroups_only_count_their_members():
    def step(rank, world_size):
        evens = dist.new_group([r for r in range(world_size) if r % 2 == 0])
        odds = dist.new_group([r for r in range(world_size) if r % 2 == 1])
        dist.all_reduce(torch.ones(2), group=evens if rank % 2 == 0 else odds)

    check_collective_order(step, 6)

    def bad(rank, world_size):
        evens = dist.new_group([0, 2, 4])
        if rank in (0, 4):  # rank 2 forgets
            dist.all_reduce(torch.ones(2), group=evens)

    with pytest.raises(CollectiveOrderError, match=r"process group 1 \(ranks 0,2,4\): rank 2 issued nothing in group 1"):
        check_collective_order(bad, 6)


def test_exception_on_a_rank_propagates_when_ranks_agree():
    def step(rank):
        dist.barrier()
        if rank == 3:
            raise KeyError("three")

    with pytest.raises(KeyError) as info:
        check_collective_order(step, 4)
    assert any("raised on rank 3 of 4" in n for n in getattr(info.value, "__notes__", []))
    assert not dist.is_initialized()


def test_only_the_fake_backend_runs_in_process():
    with pytest.raises(ValueError, match="backend='fake' only"):
        check_collective_order(lambda: None, 2, backend="gloo")


def test_hypothesis_finds_the_empty_shard_bug_of_the_example():
    example = load_example()

    @given(batch=example.batches, world_size=example.world_sizes)
    @settings(max_examples=200, deadline=None, database=None, derandomize=True)
    def prop(batch, world_size):
        check_collective_order(example.train_step, world_size, args=(batch,))

    with pytest.raises(CollectiveOrderError) as info:
        prop()
    # shrunk to the smallest case: two ranks, one sample
    text = str(info.value)
    assert text.startswith("collective order diverged (world size 2, fake backend)")
    assert "rank 1 issued nothing in group default_pg, where rank 0 issued 2 calls" in text


@given(batch=st.lists(st.integers(0, 9), max_size=12), world_size=st.integers(1, 6))
@settings(max_examples=30, deadline=None, database=None)  # ~0.2 s each on 2 busy cores
def test_the_fixed_example_agrees_for_any_batch(batch, world_size):
    check_collective_order(load_example.__globals__["_EXAMPLE"].train_step_fixed, world_size, args=(batch,))


_EXAMPLE = load_example()


def rec(rank, op, peer=None, n=4, async_op=False):
    return CollectiveRecord(rank, 0, op, shapes=((n,),), dtypes=("float32",), peer=peer, async_op=async_op,
                            state="completed")


@given(world_size=st.integers(2, 12), steps=st.integers(1, 4))
@settings(max_examples=80, deadline=None, database=None)
def test_replay_ring_exchange(world_size, steps):
    """A ring exchange with blocking calls: fine when even ranks send first, a deadlock when all
    ranks send first, and always fine with isend/irecv."""
    def ring(order):
        calls = {}
        for r in range(world_size):
            right, left = (r + 1) % world_size, (r - 1) % world_size
            out = []
            for _ in range(steps):
                send, recv = rec(r, "send", right), rec(r, "recv", left)
                out += order(r, send, recv)
            calls[r] = out
        return calls

    if world_size % 2 == 0:
        assert replay(ring(lambda r, s, v: [s, v] if r % 2 == 0 else [v, s])) == []
    stuck = replay(ring(lambda r, s, v: [s, v]))
    assert [p.kind for p in stuck] == ["deadlock"] and sorted(stuck[0].at) == list(range(world_size))
    nonblocking = ring(lambda r, s, v: [rec(r, "isend", s.peer), rec(r, "irecv", v.peer)])
    assert replay(nonblocking) == []


def test_replay_collective_waits_for_a_rank_blocked_in_recv():
    calls = {
        0: [rec(0, "all_reduce"), rec(0, "send", 1)],
        1: [rec(1, "recv", 0), rec(1, "all_reduce")],
    }
    (problem,) = replay(calls)
    assert problem.kind == "deadlock"
    assert "rank 0 blocks in all_reduce([4] float32) (group default_pg)" in problem.summary
    assert "rank 1 blocks in recv([4] float32, peer=0)" in problem.summary


def test_a_rank_that_raised_and_stopped_early_is_no_divergence():
    def step(rank):
        dist.all_reduce(torch.ones(2))
        if rank == 1:
            raise ValueError("bad shard")
        dist.all_reduce(torch.ones(2))  # the others go on: rank 1's calls are a prefix of theirs

    with pytest.raises(ValueError, match="bad shard") as info:
        check_collective_order(step, 3)
    assert any("raised on rank 1 of 3" in n for n in getattr(info.value, "__notes__", []))


def test_a_divergence_beyond_the_exception_is_raised_from_it():
    def step(rank):
        dist.all_reduce(torch.ones(3 if rank == 1 else 2))  # a real divergence, before the exception
        if rank == 1:
            raise ValueError("bad shard")

    with pytest.raises(CollectiveOrderError) as info:
        check_collective_order(step, 3)
    assert isinstance(info.value.__cause__, ValueError)  # shown first: "the direct cause of"
    assert "rank 1 issued all_reduce([3] float32)" in str(info.value)


def test_each_in_process_rank_may_fill_the_recorder_on_its_own():
    """The ranks run one after another in this process: each gets a recorder of its own, so two
    ranks of 60,000 calls each (120,000 together, over one recorder's 100,000) are compared whole."""
    import torch
    import torch.distributed as dist

    t = torch.ones(1)

    def many(rank):
        for _ in range(60_000):
            dist.all_reduce(t)
        if rank == 1:
            dist.broadcast(t, src=0)

    with pytest.raises(CollectiveOrderError) as err:
        check_collective_order(many, 2)
    assert "broadcast" in str(err.value)
    trace = check_collective_order(lambda rank: [dist.all_reduce(t) for _ in range(60_000)], 2)
    assert [len(trace.records(r)) for r in (0, 1)] == [60_000, 60_000]
