"""Calls queued on GPU streams in orders no execution can satisfy, from the records
(hangdoc.analysis.stream_order): real NCCL captures are in test_bug_fixtures and test_gpu_fixtures;
here, the invariant that ranks issuing one program in one order are never a cycle, whatever the
recorder saw completed, and that one rank swapping two calls is."""

from hypothesis import given, settings
from hypothesis import strategies as st

from hangdoc.analysis.stream_order import cycle_of
from hangdoc.model import CollectiveRecord

RANKS = 3
#: a call of the program: ("c", group) for a collective of every rank, ("p", src, dst) for a message
CALL = st.one_of(st.tuples(st.just("c"), st.sampled_from(["default_pg", "tp"])),
                 st.tuples(st.just("p"), st.integers(0, RANKS - 1), st.integers(0, RANKS - 1)).filter(lambda c: c[1] != c[2]))


def _records(program, swap=None, completed=None):
    """Each rank's records of ``program`` in program order (``swap``: (rank, i, j), that rank's
    i-th and j-th calls issued the other way round); ``completed``: per rank, how many of its first
    calls read completed."""
    out = []
    for rank in range(RANKS):
        mine = [c for c in program if c[0] == "c" or rank in c[1:]]
        if swap and swap[0] == rank and max(swap[1:]) < len(mine):
            i, j = swap[1:]
            mine[i], mine[j] = mine[j], mine[i]
        seqs = {}
        for t, c in enumerate(mine):
            group = c[1] if c[0] == "c" else "default_pg"
            seq = seqs.get(group, 0)
            seqs[group] = seq + 1
            if c[0] == "c":
                op, peer = "all_reduce", None
            else:
                op, peer = ("send", c[2]) if c[1] == rank else ("recv", c[1])
            done = completed is not None and t < completed[rank]
            out.append(CollectiveRecord(rank=rank, seq=seq, op=op, group=group, peer=peer, stream="default",
                                        time_issued=float(t), call_site=f"train.py:{10 + t}:main",
                                        state="completed" if done else "issued"))
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(CALL, min_size=2, max_size=30), st.lists(st.integers(0, 30), min_size=RANKS, max_size=RANKS))
def test_one_program_in_one_order_is_never_a_cycle(program, completed):
    assert cycle_of(_records(program, completed=completed)) is None


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["default_pg", "tp"]), min_size=2, max_size=12), st.data())
def test_one_rank_swapping_two_collectives_of_two_groups_is_a_cycle(groups, data):
    program = [("c", g) for g in groups]
    i = data.draw(st.integers(0, len(program) - 2))
    j = data.draw(st.integers(i + 1, len(program) - 1))
    if program[i] == program[j] or len({g for g in groups[i:j + 1]}) < 2:
        return  # the same group twice is the same order
    found = cycle_of(_records(program, swap=(1, i, j)))
    assert found is not None
    cyc = found[0]
    assert {r for _, r in cyc} & {1} and any(r != 1 for _, r in cyc)
