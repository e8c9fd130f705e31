"""Calls queued behind each other on GPU streams (hangdoc.runtime.detect_queue): two groups entered in
opposite orders and a pipeline stage that skipped a collective under NCCL, from the detector's real
publications on 2 x H200 (tests/fixtures/detect/gpu-queue/README.md), and the rule's invariants."""

import glob
import json
import os

from hypothesis import given, settings
from hypothesis import strategies as st

from hangdoc.runtime.detect_queue import QUEUED, _cycle, _inversion, head, queued_cycle

HERE = os.path.dirname(os.path.abspath(__file__))
FIX = os.path.join(HERE, "fixtures", "detect", "gpu-queue")


def _pubs(kind):
    out = {0: [], 1: []}
    for path in sorted(glob.glob(os.path.join(FIX, kind, "pub-r*.json"))):
        with open(path) as f:
            pub = json.load(f)
        out[pub["rank"]].append(pub)
    assert out[0] and out[1]
    return out


def _both(name):
    """The members of every group of these two-rank jobs."""
    return (0, 1)


def test_the_real_opposite_order_is_found_from_either_rank_at_every_look():
    pubs = _pubs("bug")
    for p0 in pubs[0]:
        for p1 in pubs[1]:
            for me, mine in ((0, p0), (1, p1)):
                v = queued_cycle(me, mine, {0: p0, 1: p1}.get, _both)
                assert v is not None and v.deviants == [0, 1] and v.agreeing == [], (me, v)
                assert v.basis == "queued" and v.kind == "collective-mismatch"
                assert sorted(v.sides.items()) == [("1", [0]), ("2", [1])]
                assert all(f"opposite_groups_pair.py:{n}" in v.summary for n in (38, 39, 41, 42)), v.summary
    with open(os.path.join(FIX, "bug", "divergence.json")) as f:
        written = json.load(f)
    assert written["deviants"] == [0, 1] and written["basis"] == "queued"


def test_the_real_pipeline_skip_names_the_rank_that_broke_its_loop_from_either_rank():
    """rank 1 skipped the all_reduce of step 3: rank 0's all_reduce #3 and the send of message #4
    wait on its GPU, rank 1's receive of message #4 and its all_reduce #3 (really step 4's) on its."""
    pubs = _pubs("pp")
    for p0 in pubs[0]:
        for p1 in pubs[1]:
            for me, mine in ((0, p0), (1, p1)):
                v = queued_cycle(me, mine, {0: p0, 1: p1}.get, _both)
                assert v is not None and v.deviants == [1] and v.agreeing == [0], (me, v.summary)
                assert v.basis == "pattern-break"
                assert "all_reduce([1] float32) at pp_skip_pair.py:44 (group default_pg, #3)" in v.summary
                assert "message #4 0>1" in v.summary, v.summary
    with open(os.path.join(FIX, "pp", "divergence.json")) as f:
        assert json.load(f)["deviants"] == [1]


def test_without_the_loop_break_the_pipeline_cycle_names_both_ranks():
    pubs = _pubs("pp")
    p0, p1 = pubs[0][0], {k: v for k, v in pubs[1][0].items() if k != "qbrk"}
    v = queued_cycle(0, p0, {0: p0, 1: p1}.get, _both)
    assert v.deviants == [0, 1] and v.basis == "queued" and "cycle" in v.summary


def test_the_real_correct_job_is_never_a_cycle_whatever_looks_are_compared():
    pubs = _pubs("ok")
    for p0 in pubs[0]:
        for p1 in pubs[1]:
            for me, mine in ((0, p0), (1, p1)):
                assert queued_cycle(me, mine, {0: p0, 1: p1}.get, _both) is None


def test_a_busy_rank_or_no_list_is_no_cycle():
    pubs = _pubs("bug")
    p0, p1 = pubs[0][0], dict(pubs[1][0], quiet=False)
    assert queued_cycle(0, p0, {0: p0, 1: p1}.get, _both) is None
    assert queued_cycle(0, p0, {0: p0, 1: {"quiet": True}}.get, _both) is None
    garbled = dict(pubs[1][0], h={"q": [["2", "3"], "x", None]})
    assert queued_cycle(0, p0, {0: p0, 1: garbled}.get, _both) is None


CALLS = st.lists(st.tuples(st.sampled_from(["1", "2", "3", "p2p:0>1", "p2p:1>0"]), st.integers(0, 50)),
                 min_size=2, max_size=40, unique=True)


@settings(max_examples=200, deadline=None)
@given(CALLS, st.data())
def test_subsequences_of_one_issue_order_never_invert(order, data):
    """Ranks that issued the same calls in one order list subsequences of it (what they saw
    completed differs): never an inversion."""
    def sub():
        keep = data.draw(st.lists(st.booleans(), min_size=len(order), max_size=len(order)))
        return [[g, i, "all_reduce", "x.py:1"] for (g, i), k in zip(order, keep) if k]

    a, b, c = sub(), sub(), sub()
    assert _inversion(a, b) is None
    # nor do three ranks' lists close a cycle of any length through the calls they share
    assert _cycle({0: a, 1: b, 2: c}, [(x[0], x[1]) for x in a + b + c]) is None


@settings(max_examples=200, deadline=None)
@given(CALLS, st.data())
def test_two_calls_swapped_on_one_rank_are_the_inversion(order, data):
    i = data.draw(st.integers(0, len(order) - 2))
    j = data.draw(st.integers(i + 1, len(order) - 1))
    swapped = list(order)
    swapped[i], swapped[j] = swapped[j], swapped[i]
    mine = [[g, n, "all_reduce", "x.py:1"] for g, n in order]
    theirs = [[g, n, "all_reduce", "x.py:1"] for g, n in swapped]
    hit = _inversion(mine, theirs)
    assert hit is not None
    x, y = hit
    assert mine.index(x) < mine.index(y) and theirs.index(x) > theirs.index(y)


class _Ring:
    """A digests group: its ring (entries at their index modulo RING) and its call count."""

    def __init__(self, entries):
        from hangdoc.runtime.detect_digest import RING

        self.ring = [None] * RING
        for e in entries:
            self.ring[e[0] % RING] = e
        self.n = max(e[0] for e in entries) + 1


def _rec(seq, stream, state="issued", async_op=False):
    # the recorder's tuple: seq, op, group, shapes, dtypes, root, peer, async, site, stream, phase, t0, t1, state
    return (seq, "all_reduce", ("1", (0, 1)), ((8,),), ("float32",), None, None, async_op, None, stream, None, 0.0, None, state)


def test_head_lists_the_calls_not_seen_completed_on_the_newest_calls_stream():
    done = _rec(0, "default", "completed")
    a, b, side, asynchronous = _rec(1, "default"), _rec(2, "default"), _rec(3, "side"), _rec(4, "default", async_op=True)
    c = _rec(5, "default")
    groups = {"1": _Ring([(0, 0, 0, done), (1, 0, 0, a), (2, 0, 0, side)]), "2": _Ring([(0, 0, 0, b), (1, 0, 0, asynchronous), (2, 0, 0, c)])}

    def describe(r):
        return (f"call{r[0]}", f"x.py:{r[0]}")

    h = head([done, a, b, side, asynchronous, c], groups, describe)
    assert h == {"q": [["1", 1, "call1", "x.py:1"], ["2", 0, "call2", "x.py:2"], ["2", 2, "call5", "x.py:5"]]}
    assert head([done, a, side], groups, describe) is None  # one call on the newest call's stream
    assert head([_rec(9, None), _rec(10, None)], groups, describe) is None  # CPU calls: never queued on a GPU
    many = [_rec(k, "default") for k in range(40)]
    rings = {"1": _Ring([(k, 0, 0, r) for k, r in enumerate(many)])}
    assert [x[1] for x in head(many, rings, describe)["q"]] == list(range(40 - QUEUED, 40))


def test_a_cycle_of_sends_and_receives_only_is_a_p2p_cycle_of_its_ranks():
    """Both stages receive first (the schedule of examples/gpu's nccl_pipeline_cycle): every rank on
    the cycle, whatever loop it broke."""
    def pub(*calls, brk=False):
        out = {"quiet": True, "h": {"q": [[n, i, op, f"pipe.py:{20 + i}"] for n, i, op in calls]}}
        if brk:
            out["qbrk"] = {"at": ["recv", "pipe.py:22"], "after": ["send", "pipe.py:23"], "usual": ["send", "pipe.py:19"]}
        return out

    pubs = {0: pub(("p2p:1>0", 3, "recv"), ("p2p:0>1", 3, "send"), brk=True),
            1: pub(("p2p:0>1", 3, "recv"), ("p2p:1>0", 3, "send"))}
    for me in (0, 1):
        v = queued_cycle(me, pubs[me], pubs.get, lambda name: (0, 1))
        assert v.kind == "p2p-cycle" and v.deviants == [0, 1], v.summary
        assert "message #3 1>0" in v.summary and "message #3 0>1" in v.summary
