"""The wait cycle through collectives and receives, and the rank that broke its loop
(hangdoc.runtime.detect_pattern), on publications as the detector writes them."""

from __future__ import annotations

import json
from typing import Any, Dict, Optional

from hypothesis import given, settings, strategies as st

from hangdoc.runtime import detect_pattern
from hangdoc.runtime.detect_digest import Verdict

STAGE0 = [("all_reduce", 40), ("send", 41), ("recv", 43)]
STAGE1 = [("recv", 46), ("all_reduce", 48), ("send", 49)]


def pub(last: str, counts: Dict[str, int], members: Dict[str, list], sent: Dict[int, int], received: Dict[int, int],
        waiting: Optional[list] = None, brk: Optional[dict] = None, quiet: bool = True) -> Dict[str, Any]:
    out: Dict[str, Any] = {"quiet": quiet, "last": last, "g": {g: {"n": n, "r": members[g]} for g, n in counts.items()},
                           "p": {"s": {str(k): v for k, v in sent.items()}, "r": {str(k): v for k, v in received.items()},
                                 "w": waiting}}
    if brk:
        out["brk"] = brk
    return json.loads(json.dumps(out))


BRK = {"at": ["send([16] float32, peer=1)", "pp.py:49"], "after": ["recv([16] float32, peer=1)", "pp.py:46"],
       "usual": ["all_reduce([16] float32)", "pp.py:48"], "ago": 1}


def tp_pp(brk3: Optional[dict] = BRK, brk0: Optional[dict] = None) -> Dict[int, Dict[str, Any]]:
    """The four publications of examples/bugs/tp_pp_skip.py as the job left them (rank 3 skipped its
    TP all_reduce at step 3): copied from a real run's, with the debugging aid of that session."""
    m = {"1": [0, 1], "2": [2, 3]}
    return {
        0: pub("1", {"1": 4}, m, {2: 4}, {2: 4}, ["recv", 2, "recv([16] float32, peer=2)", "pp.py:43"], brk0),
        1: pub("1", {"1": 5}, m, {3: 4}, {3: 4}),
        2: pub("2", {"2": 4}, m, {0: 3}, {0: 4}),
        3: pub("2", {"2": 3}, m, {1: 4}, {1: 5}, ["recv", 1, "recv([16] float32, peer=1)", "pp.py:46"], brk3),
    }


def check(pubs: Dict[int, Dict[str, Any]], me: int) -> Optional[Verdict]:
    return detect_pattern.broken_loop_in_wait(me, pubs[me], pubs.get, range(len(pubs)), lambda name: ())


def test_the_rank_that_broke_its_loop_in_a_wait_cycle_is_named_from_any_rank_of_it():
    pubs = tp_pp()
    for me in range(4):
        v = check(pubs, me)
        assert v is not None and (v.kind, v.deviants, v.agreeing, v.basis) == (
            "collective-mismatch", [3], [0, 1, 2], "pattern-break")
        assert v.summary.startswith("rank 3 broke its loop: after recv([16] float32, peer=1) at pp.py:46 came "
                                    "send([16] float32, peer=1) at pp.py:49 where every earlier iteration issued "
                                    "all_reduce([16] float32) at pp.py:48"), v.summary
        assert Verdict.from_json(json.loads(json.dumps(v.to_json()))).summary == v.summary


def test_no_cycle_no_break_or_every_rank_broke_says_nothing():
    assert all(check(tp_pp(brk3=None), me) is None for me in range(4))  # a cycle, nobody broke a loop
    assert check(tp_pp(brk3=BRK, brk0=BRK), 0).deviants == [0, 3]  # two of four
    pubs = tp_pp()
    pubs[1] = pub("1", {"1": 5}, {"1": [0, 1]}, {3: 5}, {3: 4})  # rank 1 did send: rank 3's receive can end
    assert all(check(pubs, me) is None for me in range(4))
    pubs = tp_pp()
    pubs[2]["quiet"] = False  # rank 2 is still issuing calls: no wait stands
    assert all(check(pubs, me) is None for me in (0, 1, 3))
    everyone = {r: dict(p, brk=BRK) for r, p in tp_pp().items()}
    assert check(everyone, 0) is None


def _periodic(loop, reps):
    return [k for _ in range(reps) for k in loop]


@settings(max_examples=80, deadline=None)
@given(st.sampled_from([STAGE0, STAGE1, [("all_reduce", 1), ("all_reduce", 2)], [("barrier", 7)]]),
       st.integers(2, 40), st.integers(0, 2))
def test_a_loop_that_keeps_its_pattern_never_breaks_it(loop, reps, cut):
    keys = _periodic(loop, reps) + loop[:cut]
    assert detect_pattern.pattern_break(keys) is None


@settings(max_examples=80, deadline=None)
@given(st.sampled_from([STAGE0, STAGE1]), st.integers(3, 40), st.integers(0, 2), st.integers(0, 2))
def test_a_call_skipped_in_the_last_iteration_is_the_break(loop, reps, skip, more):
    """Drop call ``skip`` of the last iteration (then ``more`` calls of the next): the break is the call
    that came in its place, and the usual one is what the loop always issued there."""
    keys = _periodic(loop, reps)
    last = loop[:skip] + loop[skip + 1:] + loop[:more]
    hit = detect_pattern.pattern_break(keys + last)
    if skip == len(loop) - 1 and not more:  # nothing came in its place yet: only behind, no break
        assert hit is None
    elif skip == 0:  # the first call of an iteration skipped: the previous iteration's last call is followed
        assert hit is not None and (keys + last)[hit[0]] == loop[1] and (keys + last)[hit[1]] == loop[0]
    else:
        assert hit is not None and hit[0] == len(keys) + skip and (keys + last)[hit[1]] == loop[skip]
