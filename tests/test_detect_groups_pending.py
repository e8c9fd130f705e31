"""The cross-group check (hangdoc.runtime.detect_groups) with a call another thread of a rank sits
in (``pend``): a checkpoint thread's barrier on a group of its own that one rank never starts
(examples/bugs/async_ckpt_side_barrier.py), as the ranks publish it."""

from hangdoc.runtime.detect_groups import cross_group_wait, waits_in


def pub(last, counts, pend=None):
    out = {"quiet": True, "last": last, "g": {g: {"n": n, "r": [0, 1, 2, 3]} for g, n in counts.items()}}
    if pend is not None:
        out["pend"] = pend
    return out


def test_a_thread_waiting_in_a_group_of_its_own_closes_the_cycle():
    # ranks 0-2: their main threads' latest call is all_reduce #5 of the default group (done), their
    # checkpoint threads sit in barrier #0 of group 1; rank 3 waits in all_reduce #6, never in group 1
    pubs = {r: pub("default_pg", {"default_pg": 6, "1": 1}, ["1"]) for r in (0, 1, 2)}
    pubs[3] = pub("default_pg", {"default_pg": 7})
    v = cross_group_wait(3, pubs[3], pubs.get, lambda name: (0, 1, 2, 3))
    assert v is not None and v.deviants == [3] and v.agreeing == [0, 1, 2]
    assert {v.group, v.other_group} == {"1", "default_pg"}
    for r in (0, 1, 2):  # from their side the default group shows nobody behind them
        assert cross_group_wait(r, pubs[r], pubs.get, lambda name: (0, 1, 2, 3)) is None


def test_without_the_pending_call_or_while_busy_nothing_is_said():
    pubs = {r: pub("default_pg", {"default_pg": 6, "1": 1}) for r in (0, 1, 2)}
    pubs[3] = pub("default_pg", {"default_pg": 7})
    assert cross_group_wait(3, pubs[3], pubs.get, lambda name: (0, 1, 2, 3)) is None  # merely behind
    busy = {r: dict(pub("default_pg", {"default_pg": 6, "1": 1}, ["1"]), quiet=False) for r in (0, 1, 2)}
    busy[3] = pubs[3]
    assert cross_group_wait(3, busy[3], busy.get, lambda name: (0, 1, 2, 3)) is None


def test_waits_in_reads_only_what_is_well_formed():
    assert waits_in({"last": "a", "pend": ["b", 3, "c"]}) == ["b", "c", "a"]
    assert waits_in({"last": "a", "pend": "b"}) == ["a"]
    assert waits_in({"pend": ["x"] * 20})[:9] == ["x"] * 8
