"""A receive from the wrong peer, counted in messages (record_rules._wrong_peers_by_count):
invariants over generated point-to-point programs, whatever the completion states."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from hangdoc.analysis.record_rules import _wrong_peers_by_count
from hangdoc.model import CollectiveRecord

WORLD = 4


def program(messages, done):
    """Each rank's records for ``messages`` ((src, dst) pairs, in the order the job sends them):
    the sender's send and the receiver's recv, numbered per rank; the first ``done[r]`` calls of
    rank ``r`` completed."""
    calls = {r: [] for r in range(WORLD)}
    for src, dst in messages:
        calls[src].append(("send", dst))
        calls[dst].append(("recv", src))
    out = []
    for r, lst in calls.items():
        for i, (op, peer) in enumerate(lst):
            out.append(CollectiveRecord(rank=r, seq=i, op=op, peer=peer, shapes=((4,),),
                                        state="completed" if i < done[r] else "issued"))
    return out


pairs = st.tuples(st.integers(0, WORLD - 1), st.integers(0, WORLD - 1)).filter(lambda p: p[0] != p[1])


@settings(max_examples=300, deadline=None)
@given(messages=st.lists(pairs, min_size=1, max_size=30), done=st.lists(st.integers(0, 30), min_size=WORLD, max_size=WORLD))
def test_a_program_whose_receives_name_their_senders_is_never_a_wrong_peer(messages, done):
    assert _wrong_peers_by_count(program(messages, done)) == []


@settings(max_examples=500, deadline=None)
@given(messages=st.lists(pairs, min_size=1, max_size=30), pick=st.integers(0, 29), data=st.data())
def test_a_receive_naming_a_rank_that_never_sends_it_is_named(messages, pick, data):
    """One message's receiver names a third rank (one with records of its own) that sends it
    nothing at all and waits for the receiver in turn; everything before that receive completed on
    the receiver, nothing after. The receiver is the culprit; with that rank waiting for another,
    or for nothing, nobody is named (a peer held up elsewhere may still send)."""
    src, dst = messages[pick % len(messages)]
    busy = {r for m in messages for r in m}  # a rank without any record is unknown, not silent
    silent = [q for q in sorted(busy) if q not in (src, dst) and (q, dst) not in messages]
    if not silent:
        return
    k = pick % len(messages)
    if (src, dst) not in messages[:k]:
        return  # the rule asks for a sender the receiver took messages from before (its usual one)
    wrong = data.draw(st.sampled_from(silent))
    records = program(messages, [30] * WORLD)
    nth = sum(1 for s, d in messages[:k] if d == dst)  # this receive's index among the receiver's receives
    mine = [r for r in records if r.rank == dst]
    target = [r for r in mine if r.op == "recv"][nth]
    assert target.peer == src
    target.peer = wrong
    for r in mine:
        r.state = "completed" if r.seq < target.seq else "issued"
    theirs = [r for r in records if r.rank == wrong]
    # the wrong peer waits for the receiver in turn (a receive from it, never completed): the cycle
    # that the wrong peer causes
    back = CollectiveRecord(rank=wrong, seq=len(theirs), op="recv", peer=dst, shapes=((4,),))
    found = _wrong_peers_by_count(records + [back])
    assert [c.rank for f in found for c in f.culprits] == [dst]
    assert f"peer is wrong (rank {src}, not {wrong})" in found[0].summary
    # the same peer held up elsewhere (it waits for nobody here, or in nothing): it may still send
    late = CollectiveRecord(rank=wrong, seq=len(theirs), op="recv", peer=src, shapes=((4,),))
    assert _wrong_peers_by_count(records + [late]) == []
    assert _wrong_peers_by_count(records) == []
