"""Flight Recorder refining hangdoc's completion states (analysis.refine): invariants."""

from hypothesis import given, settings, strategies as st

from hangdoc.analysis.refine import refine_states
from hangdoc.model import CollectiveRecord

OPS = st.sampled_from([("all_reduce", ((8,),), None), ("broadcast", ((8,),), None),
                       ("all_reduce", ((4,),), None), ("send", ((8,),), 1), ("recv", ((8,),), 1)])


@settings(max_examples=200, deadline=None)
@given(calls=st.lists(st.tuples(OPS, st.booleans()), min_size=1, max_size=40),
       done=st.integers(min_value=0, max_value=40), seen_every=st.integers(min_value=1, max_value=8),
       ring=st.integers(min_value=1, max_value=40), counters=st.booleans(), stream=st.booleans())
def test_refined_states_are_true_states(calls, done, seen_every, ring, counters, stream):
    """One group, in-order completion (the first ``done`` calls ran). Flight Recorder saw every
    call (its ring keeps the newest ``ring``); hangdoc saw those flagged True, and knows of
    completion only at every ``seen_every``-th of its calls. After refining, no hangdoc record
    reads completed unless it ran, and every one Flight Recorder still holds reads its true state.

    ``counters``: Flight Recorder numbers sends and receives apart from collectives (its
    ``p2p_seq_id`` and ``collective_seq_id``, as NCCL's dumps do), its entries in issue order by
    their creation time only. ``stream``: hangdoc's records are synchronous calls on one CUDA
    stream (its order guard applies)."""
    fr, mine = [], []
    numbers = {True: 0, False: 0}
    for i, ((op, shapes, peer), hangdoc_saw) in enumerate(calls):
        ran = i < done
        lane = counters and peer is not None
        fr.append(CollectiveRecord(rank=0, seq=numbers[lane], op=op, shapes=shapes, peer=peer, time_issued=100.0 + i,
                                   state="completed" if ran else "issued", origin="flight-recorder"))
        numbers[lane] += 1
        if hangdoc_saw:
            known = ran and (len(mine) % seen_every == 0)
            mine.append((i, CollectiveRecord(rank=0, seq=len(mine), op=op, shapes=shapes, peer=peer, time_issued=100.0 + i,
                                             stream="default" if stream else None,
                                             state="completed" if known else "issued")))
    before = [r.state for _, r in mine]
    kept = fr[-ring:]
    refine_states([r for _, r in mine] + kept)
    oldest_kept = len(calls) - len(kept)
    for (i, r), b in zip(mine, before):
        ran = i < done
        assert not (b == "completed" and r.state != "completed")  # never downgraded
        if r.state == "completed":
            assert ran  # never completes a call that did not run
        elif ran and i >= oldest_kept:
            # a call that ran and Flight Recorder still holds is lifted, unless a newer twin of it
            # that hangdoc never saw took its pairing (the safe direction)
            twins_after = [j for j in range(i + 1, len(calls)) if calls[j][0] == calls[i][0] and not calls[j][1]]
            assert twins_after, (i, r)


def test_pipeline_behind_a_hung_all_reduce_stays_issued():
    """What NCCL's Flight Recorder holds for ``examples/bugs/pp_skip_pair.py`` rank 0 on 2 x H200
    (tests/fixtures/bugs_nccl/pp_skip_pair, its steps): send, recv, all_reduce per step; the
    all_reduce of step 3 never completes, the calls queued behind it neither. Its sends and
    receives are numbered apart from its all_reduces. Read by number, the newest receive paired
    with a completed one of step 1 and every queued send and receive read completed."""
    fr, mine = [], []
    p2p = coll = 0
    for step in range(8):
        for op in ("send", "recv", "all_reduce"):
            i = len(mine)
            ran = step < 3
            peer = None if op == "all_reduce" else 1
            seq = coll if peer is None else p2p
            fr.append(CollectiveRecord(rank=0, seq=seq, op=op, peer=peer, shapes=((16,),) if peer else ((1,),),
                                       time_issued=1.0 + i, state="completed" if ran else "issued",
                                       origin="flight-recorder"))
            coll, p2p = (coll + 1, p2p) if peer is None else (coll, p2p + 1)
            mine.append(CollectiveRecord(rank=0, seq=i, op=op, peer=peer, shapes=fr[-1].shapes, stream="default",
                                         time_issued=1.0 + i, state="completed" if step < 2 else "issued"))
    assert refine_states(mine + fr) == 3
    assert [r.state for r in mine] == ["completed"] * 9 + ["issued"] * 15


def test_an_upgrade_behind_an_issued_call_on_its_stream_is_undone():
    """A pairing that completes a synchronous call after one still issued on the same stream
    contradicts the stream's order (here Flight Recorder holds a twin hangdoc never saw)."""
    mine = [CollectiveRecord(rank=0, seq=0, op="all_reduce", shapes=((1,),), stream="default", time_issued=1.0),
            CollectiveRecord(rank=0, seq=1, op="send", peer=1, shapes=((4,),), stream="default", time_issued=2.0)]
    fr = [CollectiveRecord(rank=0, seq=0, op="all_reduce", shapes=((1,),), time_issued=1.0, origin="flight-recorder"),
          CollectiveRecord(rank=0, seq=0, op="send", peer=1, shapes=((4,),), time_issued=3.0, state="completed",
                           origin="flight-recorder")]
    assert refine_states(mine + fr) == 0
    assert [r.state for r in mine] == ["issued", "issued"]
    async_send = CollectiveRecord(rank=0, seq=1, op="send", peer=1, shapes=((4,),), stream="default",
                                  time_issued=2.0, async_op=True)
    assert refine_states(mine[:1] + [async_send] + fr) == 1  # an isend is not held by the stream's order
