"""The detector's digests, publications and verdicts, without processes (hypothesis for invariants)."""

from __future__ import annotations

import json
from typing import Dict, List, Sequence, Tuple

from hypothesis import given, settings, strategies as st

from hangdoc.runtime import detect

SIGS = [
    ("all_reduce", ((8,),), ("float32",), None),
    ("all_reduce", ((6,),), ("float32",), None),
    ("broadcast", ((8,),), ("float32",), 0),
    ("broadcast", ((8,),), ("float32",), 1),
    ("all_gather", ((4,), (4,)), ("float16", "float16"), None),
    ("barrier", (), (), None),
]
sig_lists = st.lists(st.sampled_from(range(len(SIGS))), min_size=1, max_size=400)


def rank_pub(rank: int, sig_ids: Sequence[int], ranks: Tuple[int, ...], sites: Sequence[int] = ()) -> Dict:
    """What ``rank`` publishes after issuing ``sig_ids`` in one group (through the real hook)."""
    dg = detect.Digests()
    for i, k in enumerate(sig_ids):
        op, shapes, dtypes, root = SIGS[k]
        site = sites[i] if i < len(sites) else k
        rec = (i, op, ("default_pg", ranks), shapes, dtypes, root, None, False, site)
        dg.hook("default_pg", op, shapes, dtypes, root, rec)
    pub = detect.snapshot(dg, rank, lambda rec: (f"{rec[1]}{list(rec[3])}", f"train.py:{rec[8]}"))
    return json.loads(json.dumps(pub))["g"].get("default_pg", {})  # as it travels through the store


def test_digest_is_order_sensitive_and_stable():
    a = detect.digest_of([SIGS[0], SIGS[2]])
    assert a == detect.digest_of([SIGS[0], SIGS[2]]) != detect.digest_of([SIGS[2], SIGS[0]])
    # uneven all_to_all splits are legitimate: no shapes in that digest
    assert detect.sig_hash(("all_to_all_single", ((6,),), ("float32",), None)) == \
        detect.sig_hash(("all_to_all_single", ((2,),), ("float32",), None))
    # the hot path's digest is the same as the reference one
    pub = rank_pub(0, [0, 2], (0, 1))
    assert int(pub["d"], 16) == a and pub["n"] == 2


@settings(max_examples=60, deadline=None)
@given(sig_lists, st.integers(0, 400), st.integers(0, 400))
def test_equal_sequences_are_never_flagged(ids, cut_a, cut_b):
    """Two ranks that issued the same calls, one further than the other: never a difference."""
    a = rank_pub(0, ids[: min(cut_a, len(ids))], (0, 1))
    b = rank_pub(1, ids[: min(cut_b, len(ids))], (0, 1))
    assert detect.first_difference(a, b) is None
    assert detect.first_difference(b, a) is None


@settings(max_examples=60, deadline=None)
@given(sig_lists, st.data())
def test_a_changed_call_is_found_at_its_index(ids, data):
    k = data.draw(st.integers(0, len(ids) - 1))
    other = data.draw(st.sampled_from([s for s in range(len(SIGS)) if s != ids[k]]))
    bad = list(ids)
    bad[k] = other
    extra = data.draw(st.integers(0, 5))  # the deviant may have gone on further
    a = rank_pub(0, ids, (0, 1, 2))
    b = rank_pub(1, bad + [0] * extra, (0, 1, 2))
    diff = detect.first_difference(a, b)
    assert diff is not None
    index, exact, _last_good = diff
    if len(ids) - k <= detect.WINDOW:  # within the published window: exact
        assert (index, exact) == (k, True)
    else:  # further back: bounded by a checkpoint, never later than the truth allows
        assert index >= k


@settings(max_examples=40, deadline=None)
@given(sig_lists, st.data())
def test_majority_names_the_deviant_whatever_the_labels(ids, data):
    """Relabelling the ranks relabels the verdict: the odd one out is named, not a fixed rank."""
    k = data.draw(st.integers(max(0, len(ids) - detect.WINDOW), len(ids) - 1))
    other = data.draw(st.sampled_from([s for s in range(len(SIGS)) if s != ids[k]]))
    labels = data.draw(st.permutations([0, 1, 2, 3]))
    deviant = labels[data.draw(st.integers(0, 3))]
    pubs = {}
    for r in labels:
        seq = list(ids)
        if r == deviant:
            seq[k] = other
        pubs[r] = rank_pub(r, seq, (0, 1, 2, 3))
    v = detect.decide("default_pg", pubs, k, True)
    assert v is not None and v.deviants == [deviant] and v.basis == "majority"
    assert v.agreeing == sorted(set(labels) - {deviant})
    assert v.deviant_entry[1].startswith(SIGS[other][0]) and v.agreeing_entry[1].startswith(SIGS[ids[k]][0])


def test_two_ranks_tie_break_as_sequence_does():
    # rank 0 goes on with the call it always made there; rank 1 makes a new one: rank 1 is named
    loop = [0, 2] * 5
    a = rank_pub(0, loop + [0, 2], (0, 1), sites=[30, 31] * 6)
    b = rank_pub(1, loop + [0, 1], (0, 1), sites=[30, 31] * 5 + [30, 44])
    v = detect.decide("default_pg", {0: a, 1: b}, 11, True)
    assert (v.deviants, v.basis) == ([1], "pattern")
    v = detect.decide("default_pg", {1: b, 0: a}, 11, True)
    assert (v.deviants, v.basis) == ([1], "pattern")
    # a skipped broadcast: both sides issue a familiar call, but only one goes on the way the loop
    # always went after all_reduce at line 30: the other broke the pattern, whichever rank it is
    a = rank_pub(0, loop + [0, 2], (0, 1), sites=[30, 31] * 6)
    b = rank_pub(1, loop + [0, 0], (0, 1), sites=[30, 31] * 5 + [30, 30])
    v = detect.decide("default_pg", {0: a, 1: b}, 11, True)
    assert (v.deviants, v.agreeing, v.basis) == ([1], [0], "pattern")
    v0 = detect.decide("default_pg", {0: b, 1: a}, 11, True)  # the lower rank skipped it this time
    assert (v0.deviants, v0.agreeing, v0.basis) == ([0], [1], "pattern")
    # nothing to tell the sides apart (no history before the first call): the higher rank is named
    a1 = rank_pub(0, [2], (0, 1), sites=[31])
    b1 = rank_pub(1, [0], (0, 1), sites=[30])
    v1 = detect.decide("default_pg", {0: a1, 1: b1}, 0, True)
    assert (v1.deviants, v1.basis) == ([1], "tie")
    assert v.summary.startswith("rank 1 diverged from rank 0 in default_pg at collective #11: all_reduce[(8,)] at train.py:30 "
                                "vs broadcast[(8,)] at train.py:31")


def creation_pub(rank: int, members: Sequence[Tuple[int, ...]], world: int) -> Dict:
    """What ``rank`` publishes of its ``new_group`` calls (the recorder's CREATION_GROUP sequence)."""
    from hangdoc.runtime.recorder import CREATION_GROUP

    dg = detect.Digests()
    for i, m in enumerate(members):
        rec = (i, "new_group", (CREATION_GROUP, tuple(range(world))), (m,), (), None, None, False, 30 + len(m))
        dg.hook(CREATION_GROUP, "new_group", (m,), (), None, rec)
    pub = detect.snapshot(dg, rank, lambda rec: (f"new_group({list(rec[3][0])})", f"train.py:{rec[8]}"), quiet=True)
    return json.loads(json.dumps(pub))["g"][CREATION_GROUP]


def test_a_skipped_new_group_names_the_ranks_without_it_whatever_the_count():
    """``if rank in S: new_group(S)``: the ranks that skipped it are named, tied or outnumbered
    (every rank must call new_group for every group), and groups created in two orders stay a tie."""
    world = tuple(range(4))
    for makers in ((0, 1), (2, 3), (1,), (0, 1, 3)):
        pubs = {r: creation_pub(r, ([(0, 1)] if r in makers else []) + [world], 4) for r in world}
        v = detect.decide("new_group", pubs, 0, True)
        skipped = [r for r in world if r not in makers]
        if len(makers) == 2:
            assert (v.deviants, v.basis) == (skipped, "skipped-creation"), v.summary
            assert v.summary.startswith(f"ranks {skipped[0]}-{skipped[1]} skipped new_group([0, 1]) at train.py:32, "
                                        f"which ranks {makers[0]}-{makers[1]} called (group creation #0)"), v.summary
        else:  # not a tie: the majority (as for any call); the aggregate weighs the contract
            assert v.basis == "majority"
    pubs = {r: creation_pub(r, [(0, 1), (2, 3)] if r < 2 else [(2, 3), (0, 1)], 4) for r in world}
    assert detect.decide("new_group", pubs, 0, True).basis == "tie"
    # the same tie in a group of collectives is not judged by new_group's contract
    a = rank_pub(0, [2, 0], (0, 1), sites=[31, 30])
    b = rank_pub(1, [0], (0, 1), sites=[30])
    assert detect.decide("default_pg", {0: a, 1: b}, 0, True).basis != "skipped-creation"


def test_rotating_reads_reach_across_pairs_with_one_read_a_look():
    for n in (2, 3, 4, 5, 8, 12, 1000):
        ranks = list(range(10, 10 + n))
        looks = max(1, (n - 1).bit_length())
        edges = {(r, p) for r in ranks for t in range(looks) for p in detect.rotating(r, ranks, t)}
        assert all(len(detect.rotating(r, ranks, t)) == 1 for r in ranks for t in range(2 * looks))
        assert all(r != p for r, p in edges)
        seen, todo = {ranks[0]}, [ranks[0]]  # connected: any split of the ranks has an edge across
        while todo:
            r = todo.pop()
            for a, b in edges:
                for x, y in ((a, b), (b, a)):
                    if x == r and y not in seen:
                        seen.add(y)
                        todo.append(y)
        assert seen == set(ranks), n


def test_two_pairs_that_diverged_together_are_found():
    # ranks 2 and 3 of 4 (a pair) change the same call: the pair partners agree, a rotating read finds it
    found, _nodes, _store = _simulate(4, 10, deviant=(2, 3), at=105)
    assert found
    v = found[0][2]
    assert (v.deviants, v.agreeing, v.index) == ([2, 3], [0, 1], 105), v.summary
    assert v.basis in ("tie", "pattern")


def test_partners_cover_every_rank_with_constant_reads():
    for n in (2, 3, 5, 8, 1024):
        ranks = list(range(100, 100 + n))
        readers: Dict[int, List[int]] = {r: [] for r in ranks}
        for r in ranks:
            ps = detect.partners(r, ranks)
            assert 1 <= len(ps) <= 2 and r not in ps
            for p in ps:
                readers[p].append(r)
            more = detect.partners(r, ranks, extra=detect.OPINIONS)
            assert more[:len(ps)] == ps and len(more) == len(set(more)) and r not in more
            assert len(more) == min(n - 1, len(ps) + detect.OPINIONS)
        assert all(readers[r] for r in ranks), "a rank nobody compares with"
        assert max(len(v) for v in readers.values()) <= 2
    assert detect.partners(7, [1, 2]) == []


class _DictStore:
    def __init__(self) -> None:
        self.kv: Dict[str, bytes] = {}
        self.ops = 0

    def set(self, key, value):
        self.ops += 1
        self.kv[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        self.ops += 1
        return self.kv.get(key)

    def compare_set(self, key, expected, desired):
        self.ops += 1
        current = self.kv.get(key, b"")
        if current == expected.encode():
            self.kv[key] = desired.encode()
        return self.kv.get(key, b"")

    def add(self, key, n):
        self.ops += 1
        v = int(self.kv.get(key, b"0")) + n
        self.kv[key] = str(v).encode()
        return v


def _simulate(nranks: int, per_tick: int, deviant, at: int, ticks: int = 40):
    """Ranks issuing ``per_tick`` collectives per 0.25 s tick; ``deviant`` (a rank or a tuple of
    ranks) changes collective ``at``."""
    deviants = deviant if isinstance(deviant, tuple) else (deviant,)
    store = _DictStore()
    ranks = tuple(range(nranks))
    digests = {r: detect.Digests() for r in ranks}
    nodes = {r: detect.Node(r, store, lambda name: ranks) for r in ranks}
    describe = lambda rec: (rec[1], f"t.py:{rec[8]}")  # noqa: E731
    found = []
    now = 0.0
    for step in range(ticks):
        for r in ranks:
            for j in range(per_tick):
                i = step * per_tick + j
                op, shapes, dtypes, root = SIGS[3 if (r in deviants and i == at) else i % 3]
                site = 99 if (r in deviants and i == at) else i % 3
                digests[r].hook("default_pg", op, shapes, dtypes, root, (i, op, ("default_pg", ranks), shapes, dtypes, root, None, False, site))
        now += 0.25
        for r in ranks:
            v = nodes[r].tick(now, digests[r].total(),
                              lambda quiet, focus=None, r=r: detect.snapshot(digests[r], r, describe, quiet, focus))
            if v is not None and r not in {f[1] for f in found}:
                found.append((now, r, v, nodes[r].claimed))
    return found, nodes, store


def test_two_ranks_that_diverged_alike_are_both_named():
    # ranks 5 and 6 of 8 change the same call: whichever checker finds it, it names both
    found, _nodes, _store = _simulate(8, 10, deviant=(5, 6), at=205)
    assert found
    first = found[0][2]
    assert (first.deviants, first.agreeing) == ([5, 6], [0, 1, 2, 3, 4, 7]), first.summary


def test_nodes_publish_at_a_bounded_rate_and_agree_on_one_verdict():
    found, nodes, _store = _simulate(6, 10, deviant=4, at=205)
    writes = sum(n.writes for n in nodes.values())
    assert writes <= 6 * 10 + 6 + 4  # ≤ 1 publication per rank per second (+ the verdict)
    assert found and sum(claimed for *_, claimed in found) == 1  # one rank reports
    first = found[0][2]
    # once a difference is found every member is read (up to NAME_ALL): all the opinions are there
    assert (first.deviants, first.index, first.exact, first.agreeing) == ([4], 205, True, [0, 1, 2, 3, 5])
    assert first.deviant_entry[1:3] == ["broadcast", "t.py:99"]
    assert found[0][0] <= 5.125 + 1.5  # seconds after the divergent call
    assert all(v.to_json() == first.to_json() for _, _, v, _ in found)  # every rank learns the same verdict


def test_a_divergence_older_than_the_window_is_pinned_down_on_request():
    # 400 collectives per tick: the divergent call leaves the published window within a tick
    found, _nodes, store = _simulate(4, 400, deviant=2, at=1000, ticks=30)
    first = found[0][2]
    assert (first.deviants, first.index, first.exact) == ([2], 1000, True)
    assert first.deviant_entry[1:3] == ["broadcast", "t.py:99"] and first.agreeing_entry[2] == "t.py:1"
