"""Alignment invariants (hypothesis) and the record rules on constructed records."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hangdoc.analysis import record_rules, sequence
from hangdoc.model import CollectiveRecord, Job, Report

OPS = [("all_reduce", (8,), "float32", None), ("broadcast", (8,), "float32", 0), ("all_gather", (4,), "float32", None),
       ("all_reduce", (2, 2), "bfloat16", None), ("barrier", None, None, None), ("reduce", (8,), "float32", 1)]


def make(seqs, last_issued=True, group="default_pg"):
    """Records for {rank: [op index, ...]}; each rank's last call is pending (the hang)."""
    out = []
    world = tuple(sorted(seqs))
    for rank, ops in seqs.items():
        for i, k in enumerate(ops):
            op, shape, dtype, root = OPS[k]
            out.append(CollectiveRecord(
                rank=rank, seq=i, op=op, group=group, group_ranks=world,
                shapes=(shape,) if shape else (), dtypes=(dtype,) if dtype else (), root=root,
                call_site=f"/job/train.py:{10 + k}:step", host="n1", pid=100 + rank,
                state="issued" if last_issued and i == len(ops) - 1 else "completed"))
    return out


ops_lists = st.lists(st.integers(0, len(OPS) - 1), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(ops_lists, st.integers(2, 6))
def test_identical_sequences_never_diverge(ops, world):
    recs = make({r: list(ops) for r in range(world)})
    assert sequence.divergences(recs) == []
    assert not [f for f in record_rules.findings(Report(job=Job(records=recs))) if f.kind == "collective-mismatch"]


@settings(max_examples=80, deadline=None)
@given(ops_lists, st.integers(3, 6), st.data())
def test_one_extra_op_blames_that_rank_once(ops, world, data):
    culprit = data.draw(st.integers(0, world - 1))
    at = data.draw(st.integers(0, len(ops)))
    extra = data.draw(st.integers(0, len(OPS) - 1))
    seqs = {r: list(ops) for r in range(world)}
    seqs[culprit] = ops[:at] + [extra] + ops[at:]
    # Every call completed: generated pending states would contradict each other (a rank blocked in
    # a collective its peers completed), and a rank blocked in its last call may just be behind.
    divs = sequence.divergences(make(seqs, last_issued=False))
    assert len(divs) == 1, [d.summary for d in divs]
    assert divs[0].ranks == [culprit]
    assert divs[0].kind in ("extra", "order", "signature")
    assert divs[0].agreeing == [r for r in range(world) if r != culprit]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, len(OPS) - 1), min_size=2, max_size=40), st.integers(3, 6), st.data())
def test_one_skipped_op_blames_that_rank(ops, world, data):
    culprit = data.draw(st.integers(0, world - 1))
    at = data.draw(st.integers(0, len(ops) - 1))
    seqs = {r: list(ops) for r in range(world)}
    seqs[culprit] = ops[:at] + ops[at + 1:]
    divs = sequence.divergences(make(seqs, last_issued=False))
    assert len(divs) == 1, [d.summary for d in divs]
    assert divs[0].ranks == [culprit]


@settings(max_examples=60, deadline=None)
@given(ops_lists, st.integers(3, 6), st.data())
def test_relabelling_ranks_relabels_the_culprit(ops, world, data):
    culprit = data.draw(st.integers(0, world - 1))
    at = data.draw(st.integers(0, len(ops) - 1))
    new = data.draw(st.integers(0, len(OPS) - 1).filter(lambda k: OPS[k] != OPS[ops[at]]))
    seqs = {r: list(ops) for r in range(world)}
    seqs[culprit] = ops[:at] + [new] + ops[at + 1:]
    perm = data.draw(st.permutations(range(world)))
    relabelled = {perm[r]: s for r, s in seqs.items()}
    a = sequence.divergences(make(seqs, last_issued=False))
    b = sequence.divergences(make(relabelled, last_issued=False))
    assert [d.ranks for d in a] == [[culprit]]
    assert [d.ranks for d in b] == [[perm[culprit]]]
    assert [d.kind for d in a] == [d.kind for d in b]


def test_skipped_broadcast_headline_names_the_rank_not_the_root():
    # rank 2 skipped broadcast #3; rank 0 (root) still waits in it, the others are in the next all_reduce
    seqs = {0: [0, 0, 0, 1], 1: [0, 0, 0, 1, 0], 2: [0, 0, 0, 0], 3: [0, 0, 0, 1, 0]}
    fs = record_rules.findings(Report(job=Job(records=make(seqs))))
    head = fs[0]
    assert head.kind == "collective-mismatch" and head.confidence >= 0.9
    assert [c.rank for c in head.culprits] == [2] and head.culprits[0].pid == 102
    assert head.summary == "rank 2 skipped broadcast #3 (train.py:11); everything after it is fallout"
    assert "rank 2 never issued broadcast #3 ([8] float32, src=0) that ranks 0-1,3 issued at train.py:11; " \
           "rank 2 went on to all_reduce at train.py:10" in head.evidence
    assert len([f for f in fs if f.kind == "collective-mismatch"]) == 1


def test_extra_all_reduce_blames_the_rank_that_issued_it_not_the_innocent():
    # Flight Recorder's equal-seq matching would flag rank 0-2 at every later op
    seqs = {0: [0, 2, 0, 2, 0], 1: [0, 2, 0, 2, 0], 2: [0, 2, 0, 2, 0], 3: [0, 0, 2, 0, 2, 0]}
    divs = sequence.divergences(make(seqs))
    assert [(d.kind, d.ranks) for d in divs] == [("extra", [3])]


def test_two_ranks_break_the_tie_with_call_site_history():
    recs = make({0: [0, 0, 0, 0], 1: [0, 0, 0, 4]})
    [d] = sequence.divergences(recs)
    assert d.ranks == [1] and d.basis == "history" and not d.ambiguous
    tie = make({0: [1], 1: [2]})
    [d] = sequence.divergences(tie)
    assert d.ambiguous and d.basis == "tie"
    f = record_rules.findings(Report(job=Job(records=tie)))[0]
    assert f.confidence == record_rules.CONFIDENCE_TIE > 0.8


def _p2p(rank, seq, op, peer, state="issued", stream=None):
    return CollectiveRecord(rank=rank, seq=seq, op=op, peer=peer, shapes=((4,),), dtypes=("float32",),
                            call_site=f"/job/pipe.py:{20 + seq}:stage", state=state, stream=stream)


def test_recv_recv_cycle_is_shown_and_a_matched_chain_is_not():
    fs = record_rules.findings(Report(job=Job(records=[_p2p(0, 0, "recv", 1), _p2p(1, 0, "recv", 2),
                                                        _p2p(2, 0, "recv", 0)])))
    cyc = [f for f in fs if f.kind == "p2p-cycle"]
    assert len(cyc) == 1 and [c.rank for c in cyc[0].culprits] == [0, 1, 2]
    assert cyc[0].evidence[0].startswith("rank 0 waits in recv([4] float32, peer=1) at pipe.py:20 → rank 1 waits")
    # rank 1 already sent to rank 0: rank 0's recv waits on nobody, so no cycle
    chain = [_p2p(0, 0, "recv", 1), _p2p(1, 0, "send", 0, state="completed"), _p2p(1, 1, "recv", 0)]
    assert not [f for f in record_rules.findings(Report(job=Job(records=chain))) if f.kind == "p2p-cycle"]


def _coll(rank, seq, op, group, ranks, state, stream=None, phase=None):
    return CollectiveRecord(rank=rank, seq=seq, op=op, group=group, group_ranks=ranks, shapes=((16,),),
                            dtypes=("bfloat16",), call_site=f"/job/model.py:{40 + seq}:layer", state=state,
                            stream=stream, phase=phase, host="gpu1", pid=500 + rank)


def test_stream_misplacement_as_the_recorder_writes_it_on_gpu():
    # ranks 0,1,3 issue the gradient all_reduce on the comm stream, rank 2 on the default (forward) stream
    recs = []
    for r in range(4):
        recs.append(_coll(r, 0, "all_reduce", "default_pg", (0, 1, 2, 3), "completed", "stream3", "backward"))
        recs.append(_coll(r, 1, "all_reduce", "default_pg", (0, 1, 2, 3), "issued",
                          "default" if r == 2 else "stream3", "backward"))
    fs = record_rules.findings(Report(job=Job(records=recs)))
    head = fs[0]
    assert head.kind == "stream-misplacement" and [c.rank for c in head.culprits] == [2]
    assert "on stream 'default'" in head.summary and "'stream3'" in head.summary


def test_groups_entered_in_opposite_orders_form_a_cycle():
    a, b = ("tp", (0, 1)), ("dp", (0, 1))
    recs = [_coll(0, 0, "all_reduce", *a, "issued"), _coll(1, 0, "all_reduce", *b, "issued")]
    fs = record_rules.findings(Report(job=Job(records=recs)))
    assert fs[0].kind == "collective-mismatch" and "opposite orders" in fs[0].summary
    assert [c.rank for c in fs[0].culprits] == [0, 1]


def test_missing_rank_from_world_size():
    recs = make({0: [0, 0], 1: [0, 0], 3: [0, 0]})
    recs = [CollectiveRecord(**{**r.__dict__, "group_ranks": (0, 1, 2, 3)}) for r in recs]
    fs = record_rules.findings(Report(job=Job(records=recs)))
    miss = [f for f in fs if f.kind == "missing-rank"]
    assert len(miss) == 1 and [c.rank for c in miss[0].culprits] == [2]


def test_long_sequences_stay_fast():
    import time

    ops = [i % len(OPS) for i in range(20000)]
    seqs = {r: list(ops) for r in range(8)}
    seqs[5] = ops[:12345] + ops[12346:]
    t0 = time.perf_counter()
    divs = sequence.divergences(make(seqs))
    assert [d.ranks for d in divs] == [[5]]
    assert time.perf_counter() - t0 < 10  # linear walk: ~160k records in well under a second unloaded


def test_send_recv_counts_do_not_trim_collectives_when_nothing_wrapped():
    # Sequence numbers count p2p too: stage 0 sent twice before its all_reduces, stage 1 received
    # once. Nothing was lost from the ring buffer, so no collective may be trimmed away.
    from hangdoc.analysis.sequence import divergences
    from hangdoc.model import CollectiveRecord as R

    done = dict(state="completed")
    stage0 = [R(rank=0, seq=0, op="send", peer=1, **done), R(rank=0, seq=1, op="send", peer=1, **done)]
    stage0 += [R(rank=0, seq=2 + i, op="all_reduce", shapes=((4,),), dtypes=("float32",), **done) for i in range(3)]
    stage1 = [R(rank=1, seq=0, op="recv", peer=0, **done)]
    stage1 += [R(rank=1, seq=1 + i, op="all_reduce", shapes=((4,),), dtypes=("float32",), **done) for i in range(3)]
    assert divergences(stage0 + stage1) == []
    # one all_reduce fewer on stage 1 is still found
    assert divergences(stage0 + stage1[:-1])


def test_two_ranks_the_one_breaking_the_loops_period_is_blamed():
    # all_reduce every step, broadcast every third (steps 0, 3, 6); rank 1 leaves out step 6's
    # broadcast. all_reduce after all_reduce is the commoner transition, but the loop's period says
    # a broadcast comes next: rank 1 is the odd one, whichever rank is numbered first.
    loop = []
    for step in range(7):
        loop.append(0)
        if step % 3 == 0:
            loop.append(1)
    for skipper in (0, 1):
        seqs = {skipper: loop[:-1] + [0], 1 - skipper: list(loop)}
        (d,) = sequence.divergences(make(seqs))
        assert d.ranks == [skipper] and d.basis == "history", (skipper, d.summary)


@given(st.lists(st.sampled_from("abc"), min_size=1, max_size=8), st.integers(3, 5))
def test_periodic_next_continues_any_repeated_loop(body, times):
    seq = body * times
    assert sequence.periodic_next(seq[:-1]) == seq[-1]


def test_two_ranks_skipping_the_same_op_are_one_finding_naming_both():
    ops = [0, 1, 0, 1, 0]
    seqs = {r: list(ops) for r in range(8)}
    for r in (5, 6):
        seqs[r] = [0, 1, 0, 0]  # both leave out the second broadcast
    found = [f for f in record_rules.findings(Report(job=Job(records=make(seqs, last_issued=False))))
             if f.kind == "collective-mismatch"]
    assert len(found) == 1 and sorted(c.rank for c in found[0].culprits) == [5, 6], [f.summary for f in found]


def test_ranks_that_skipped_a_new_group_are_the_culprits_even_two_against_two():
    """new_group must be called by every rank, members or not: with no majority, the side that
    never makes the other side's call skipped it (examples/bugs/partial_group.py)."""
    from hangdoc.analysis.sequence import divergences
    from hangdoc.model import CollectiveRecord as R

    def calls(rank, ops):
        return [R(rank=rank, seq=i, op=op, shapes=shapes, call_site=f"t.py:{30 + i}:main",
                  state="completed" if i < len(ops) - 1 else "issued") for i, (op, shapes) in enumerate(ops)]

    ar, pair, world = ("all_reduce", ((8,),)), ("new_group", ((0, 1),)), ("new_group", ((0, 1, 2, 3),))
    recs = calls(0, [ar, ar, pair, world]) + calls(1, [ar, ar, pair, world]) + calls(2, [ar, ar, world]) + calls(3, [ar, ar, world])
    [d] = [d for d in divergences(recs, hung=True) if d.group == "default_pg"][:1]
    assert d.ranks == [2] and d.basis == "contract" and not d.ambiguous and d.expected.shapes == ((0, 1),)
    assert sorted(r for x in divergences(recs, hung=True) for r in x.ranks) == [2, 3]


def test_groups_entered_in_opposite_orders_on_one_cuda_stream_every_call_issued():
    # NCCL: the host never blocks, so both ranks issued both calls; each rank's second call waits on its
    # stream behind its first, which waits for the other rank's second: an order deadlock, not a
    # cross-stream one (examples/bugs/opposite_groups on 4 GPUs, tests/fixtures/bugs_nccl)
    a, b = ("tp", (0, 1)), ("dp", (0, 1))
    recs = []
    for rank, order in ((0, (a, b)), (1, (b, a))):
        for t, g in enumerate(order):
            x = _coll(rank, 0, "all_reduce", *g, "issued", stream="default")
            x.time_issued = 100.0 + t
            recs.append(x)
    fs = record_rules.findings(Report(job=Job(records=recs)))
    assert fs[0].kind == "collective-mismatch" and "opposite orders" in fs[0].summary, [(f.kind, f.summary) for f in fs]
    assert [c.rank for c in fs[0].culprits] == [0, 1]


def test_a_resume_between_keeps_a_periodic_calls_stride():
    # all_reduce every step, all_gather every fourth; a checkpoint's barrier and a resume's broadcasts
    # come between; then one rank all-gathers on schedule and the other (its step counter reset)
    # all-reduces: the last calls alone read as a loop of all_reduces, the stride says the gather
    # was due (examples/bugs/b3_resume_step_not_broadcast.py)
    loop = [0, 0, 0, 0, 2, 0, 0, 4, 1, 1, 0, 0]
    for reset in (0, 1):
        seqs = {reset: loop + [0], 1 - reset: loop + [2]}
        (d,) = sequence.divergences(make(seqs))
        assert d.ranks == [reset] and d.basis == "history", (reset, d.summary)


def test_uneven_all_to_all_splits_are_no_shape_mismatch():
    # MoE dispatch: every rank's all_to_all_single input has its own row count by design
    recs = [CollectiveRecord(rank=r, seq=i, op="all_to_all_single", group="default_pg", group_ranks=(0, 1, 2),
                             shapes=((100 + 7 * r + i, 16),), dtypes=("float32",), call_site="/job/moe.py:80:forward",
                             state="completed") for r in range(3) for i in range(4)]
    assert sequence.divergences(recs) == []
    # but not its dtype
    recs[-1] = CollectiveRecord(rank=2, seq=3, op="all_to_all_single", group="default_pg", group_ranks=(0, 1, 2),
                                shapes=((9, 16),), dtypes=("bfloat16",), call_site="/job/moe.py:80:forward",
                                state="completed")
    assert [d.ranks for d in sequence.divergences(recs)] == [[2]]


def test_a_rank_that_created_no_group_at_all_skipped_the_creations():
    # DeviceMesh built by ranks 0-2 (local synchronization: each waits for its members only); rank 3's
    # fallback never calls init_device_mesh and waits in the default group instead
    def rec(rank, seq, op, group, shape, state="completed"):
        return CollectiveRecord(rank=rank, seq=seq, op=op, group=group, group_ranks=(0, 1, 2, 3), shapes=(shape,),
                                dtypes=(), call_site=f"/job/train.py:{82 if group == 'new_group' else 105}:main",
                                state=state)

    recs = [rec(r, 0, "barrier", "default_pg", ()) for r in range(4)]
    for r, made in ((0, 3), (1, 2), (2, 4)):
        for i, members in enumerate([(0, 2), (1, 3), (0, 1), (2, 3)][:made]):
            recs.append(rec(r, i, "new_group", "new_group", members, "issued" if i == made - 1 else "completed"))
    recs.append(rec(3, 1, "verify_params", "default_pg", (64,), "issued"))
    found = [d for d in sequence.divergences(recs, hung=True) if d.group == "new_group"]
    assert [d.ranks for d in found] == [[3]], [d.summary for d in found]
    # a rank whose records start later (a ring buffer that wrapped) is not taken for a skipper
    late = [r if r.rank != 3 else CollectiveRecord(**{**r.__dict__, "seq": r.seq + 500}) for r in recs]
    assert not [d for d in sequence.divergences(late, hung=True) if d.group == "new_group"]
