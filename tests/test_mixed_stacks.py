"""Ranks in a collective beside ranks in send/recv with peers unknown (hangdoc.analysis.mixed_stacks),
on real py-spy dumps of the bug scenarios (tests/fixtures/bugs/README.md)."""

import os

from test_ended_main import HERE, _aggregate


def test_plain_py_spy_of_a_pipeline_skip_names_the_ranks_outside_the_collective_as_candidates():
    """Real py-spy dumps of examples/bugs/pp_skip_pair.py: rank 0 in all_reduce, rank 1 in recv. Once
    "p2p-stall: rank 1 waits in send/recv with unknown peers" (judged WRONG), saying nothing of rank
    0; the stacks cannot say who skipped what, so rank 1 is a candidate (hangdoc.analysis.mixed_stacks)."""
    d = os.path.join(HERE, "fixtures", "bugs", "pp_skip_pair")
    head, *rest = _aggregate("--rank-map", os.path.join(d, "pyspy-rank-map.txt"), os.path.join(d, "pyspy"))
    assert head["kind"] == "collective-mismatch" and head["culprits"] == [], head
    assert [c["rank"] for c in head["candidates"]] == [1], head
    assert "rank 0 waits in all_reduce at main (pp_skip_pair.py:44)" in head["summary"], head
    assert "rank 1 waits in recv at main (pp_skip_pair.py:39)" in head["summary"], head
    assert [f["kind"] for f in rest] == ["p2p-stall"], rest
