"""A rank that is merely behind (a prefix of the others' records) is no divergence."""

from __future__ import annotations

import os

from hangdoc.analysis import record_rules, sequence
from hangdoc.model import CollectiveRecord as R
from hangdoc.model import Job, Report
from tests.procs import ROOT

DEMO = os.path.join(ROOT, "tests", "fixtures", "records", "dataloader_demo")


def _recs(n_ops, behind, world=3, pending_last=True):
    out = []
    for r in range(world):
        n = n_ops - 1 if r == behind else n_ops
        for i in range(n):
            last = i == n - 1
            out.append(R(rank=r, seq=i, op="all_reduce", shapes=((8,),), dtypes=("float32",), call_site="train.py:39:main",
                         state="issued" if (last and pending_last and r != behind) else "completed", host="n1", pid=100 + r))
    return out


def test_a_rank_behind_is_a_lag_not_a_divergence():
    recs = _recs(4, behind=1)
    assert sequence.divergences(recs, hung=True) == []
    # ranks that ran to their end (the pytest plugin's records): rank 1 issued one collective fewer
    assert [(d.kind, d.ranks) for d in sequence.divergences(recs)] == [("missing", [1])]
    [lag] = sequence.lags(recs)
    assert (lag.ranks, lag.waiting, lag.waiting_in.seq) == ([1], [0, 2], 3)


def test_two_ranks_the_waiting_one_is_not_blamed_for_an_extra_op():
    # was: "rank 0 issued an extra all_reduce" -- blaming the rank that waits
    recs = _recs(3, behind=1, world=2)
    fs = record_rules.findings(Report(job=Job(records=recs)))
    assert [f.kind for f in fs] == ["collective-wait"]
    assert fs[0].culprits == []  # no stack says why rank 1 is behind: nobody is blamed
    assert fs[0].confidence <= 0.7
    assert fs[0].summary == "rank 0 waits in all_reduce #2 (train.py:39) for rank 1, which is behind and never issued it"


def test_others_completed_the_op_so_it_is_still_a_skip():
    # everyone else completed the op rank 1 never issued: the records show it went on without it
    recs = _recs(4, behind=1, pending_last=False)
    [d] = sequence.divergences(recs, hung=True)
    assert (d.kind, d.ranks) == ("missing", [1])


def test_dataloader_demo_headline_is_the_stall_of_rank_1():
    from hangdoc.analysis import analyse
    from hangdoc.readers import read_paths

    job = read_paths([DEMO])
    assert job.errors == [] and len(job.processes) == 3 and job.records
    found = analyse(job).findings
    head = found[0]
    assert head.kind == "dataloader-stall"
    assert [c.rank for c in head.culprits] == [1]
    # rank 1 behind, its stack blocked outside collectives: a mismatch (one rank in no collective),
    # below the stall that says why; no other mismatch (nobody issued a different call)
    mismatch = [f for f in found if f.kind == "collective-mismatch"]
    assert len(mismatch) == 1 and mismatch[0].summary.endswith("for rank 1, which is behind and never issued it")
    lag = mismatch
    assert lag and lag[0].confidence <= 0.7 and [c.rank for c in lag[0].culprits] == [1]
    assert any("rank 1's stack: DataLoader wait" in e for e in lag[0].evidence)
