"""The detector's cross-group check (hangdoc.runtime.detect_groups) on publications, without processes:
two groups entered in opposite orders name the smaller side, or both halves; no verdict where either
side already issued the other's call, a rank is not quiet, or a rank is no member (hypothesis)."""

from __future__ import annotations

from typing import Dict, List

from hypothesis import given, settings, strategies as st

from hangdoc.runtime import detect
from hangdoc.runtime.detect_groups import cross_group_wait


def publish(rank: int, calls: List[str], members: Dict[str, tuple], quiet: bool = True) -> Dict:
    """What ``rank`` publishes after issuing one all_reduce in each group of ``calls``, in order
    (through the recorder's real hook and the real snapshot)."""
    dg = detect.Digests()
    for i, g in enumerate(calls):
        rec = (i, "all_reduce", (g, members[g]), ((4,),), ("float32",), None, None, False, f"train.py:{10 + len(g)}")
        dg.hook(g, "all_reduce", ((4,),), ("float32",), None, rec)
    return detect.snapshot(dg, rank, lambda rec: ("all_reduce([4] float32)", rec[8]), quiet=quiet)


def split(world: int, data) -> tuple:
    """The world's ranks, two groups of all of them, and the ranks that use them the other way."""
    ranks = tuple(range(world))
    return ranks, {"1": ranks, "2": ranks}, data.draw(st.sets(st.sampled_from(ranks), min_size=1, max_size=world - 1))


@settings(max_examples=100, deadline=None)
@given(world=st.integers(2, 12), data=st.data())
def test_opposite_orders_name_the_smaller_side_or_both(world, data):
    ranks, members, flipped = split(world, data)
    warmup = data.draw(st.integers(0, 3))
    pubs = {}
    for r in ranks:
        # every rank issued `warmup` calls in both groups, then its first call of the next step:
        # group 1 on the ranks that kept the order, group 2 on the flipped ones
        calls = ["1", "2"] * warmup + (["2"] if r in flipped else ["1"])
        pubs[r] = publish(r, calls, members)
    me = data.draw(st.sampled_from(ranks))
    v = None
    for me_try in [me] + [r for r in ranks if r != me]:  # the check runs on every rank: one finds it
        v = cross_group_wait(me_try, pubs[me_try], pubs.get, lambda name: ranks)
        if v is not None:
            break
    assert v is not None
    kept = sorted(set(ranks) - flipped)
    small, large = sorted([sorted(flipped), kept], key=len)
    if len(small) == len(large):
        assert v.deviants == list(ranks) and v.agreeing == [] and sorted(v.sides) == ["1", "2"]
    else:
        assert (v.deviants, v.agreeing) == (small, large)
        assert "the smaller side" in v.summary
    assert {v.group, v.other_group} == {"1", "2"}
    again = detect.Verdict.from_json(v.to_json())
    assert (again.summary, again.other_group, again.sides) == (v.summary, v.other_group, v.sides)


@settings(max_examples=60, deadline=None)
@given(world=st.integers(2, 8), data=st.data())
def test_no_cycle_no_verdict(world, data):
    ranks, members, flipped = split(world, data)
    case = data.draw(st.sampled_from(["issued", "busy", "outsider"]))
    pubs = {}
    for r in ranks:
        calls = ["2"] if r in flipped else ["1"]
        if case == "issued" and r in flipped:
            calls = ["1", "2"]  # the flipped side issued group 1's call already: the others are not waiting on it
        quiet = not (case == "busy" and r in flipped)  # still issuing: no wait to speak of
        pubs[r] = publish(r, calls, members, quiet=quiet)
    ranks_of = (lambda name: ranks) if case != "outsider" else (lambda name: tuple(x for x in ranks if x in flipped) if name == "2" else ranks)
    if case == "outsider":
        for r in ranks:
            pubs[r]["g"].get("2", {}).pop("r", None)
    for me in ranks:
        if case == "outsider" and me not in flipped:
            assert cross_group_wait(me, pubs[me], pubs.get, ranks_of) is None
        elif case != "outsider":
            assert cross_group_wait(me, pubs[me], pubs.get, ranks_of) is None
