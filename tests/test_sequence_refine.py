"""Flight Recorder refining hangdoc's completion states (sequence.refine_states): invariants."""

from hypothesis import given, settings, strategies as st

from hangdoc.analysis.sequence import refine_states
from hangdoc.model import CollectiveRecord

OPS = st.sampled_from([("all_reduce", ((8,),), None), ("broadcast", ((8,),), None),
                       ("all_reduce", ((4,),), None), ("send", ((8,),), 1), ("recv", ((8,),), 1)])


@settings(max_examples=200, deadline=None)
@given(calls=st.lists(st.tuples(OPS, st.booleans()), min_size=1, max_size=40),
       done=st.integers(min_value=0, max_value=40), seen_every=st.integers(min_value=1, max_value=8),
       ring=st.integers(min_value=1, max_value=40))
def test_refined_states_are_true_states(calls, done, seen_every, ring):
    """One group, in-order completion (the first ``done`` calls ran). Flight Recorder saw every
    call (its ring keeps the newest ``ring``); hangdoc saw those flagged True, and knows of
    completion only at every ``seen_every``-th of its calls. After refining, no hangdoc record
    reads completed unless it ran, and every one Flight Recorder still holds reads its true state."""
    fr, mine = [], []
    for i, ((op, shapes, peer), hangdoc_saw) in enumerate(calls):
        ran = i < done
        fr.append(CollectiveRecord(rank=0, seq=i, op=op, shapes=shapes, peer=peer,
                                   state="completed" if ran else "issued", origin="flight-recorder"))
        if hangdoc_saw:
            known = ran and (len(mine) % seen_every == 0)
            mine.append((i, CollectiveRecord(rank=0, seq=len(mine), op=op, shapes=shapes, peer=peer,
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
