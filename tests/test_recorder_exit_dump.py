"""The exit dump: a rank that leaves early writes where it stopped, in a bounded file.

A real 2-rank gloo job: rank 1 returns from its loop one all_reduce early and exits; rank 0 calls
that all_reduce and fails (gloo sees the peer gone). Rank 1's exit dump holds its newest
``HANGDOC_EXIT_RECORDS`` records plus the newest record of a group used only at the start, and
the analysis of both ranks' files names rank 1. Before, every exit wrote the whole buffer
(100,000 records: 37 MB and 3 s per process on the development machine).
"""

from __future__ import annotations

import glob
import json
import os
import textwrap

import pytest
from hypothesis import given, settings, strategies as st

from hangdoc.runtime import recorder
from tests.procs import run, torchrun_cmd

JOB = textwrap.dedent("""
    import os, sys
    import torch
    import torch.distributed as dist
    from hangdoc.runtime import recorder

    recorder.enable(capacity=100_000, out_dir=sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    side = dist.new_group([0, 1])
    t = torch.ones(4)
    dist.all_reduce(t, group=side)            # the side group: used once, long before the end
    for _ in range(300 if rank == 1 else 301):  # rank 1 leaves one all_reduce early
        dist.all_reduce(t)
    """)


@pytest.fixture(scope="module")
def early_exit(tmp_path_factory):
    base = tmp_path_factory.mktemp("exit")
    script = base / "job.py"
    script.write_text(JOB)
    out = base / "out"
    res = run(torchrun_cmd(2, str(script), str(out)), timeout=120, env={"HANGDOC_EXIT_RECORDS": "50"})
    assert not res.timed_out, res.stderr[-2000:]
    return out


def _read(path):
    with open(path) as f:
        lines = [json.loads(line) for line in f]
    return lines[0], lines[1:]


def test_the_early_rank_writes_its_tail_and_each_groups_last_call(early_exit):
    (path,) = glob.glob(os.path.join(early_exit, "collectives-*-r1-*.jsonl"))
    header, recs = _read(path)
    assert header["tail"] == 50
    # 302 records (new_group([0, 1]) is one, of its own sequence): the tail and each other sequence's last
    assert header["dropped"] == 302 - 52
    default = [r for r in recs if r["group"] == "default_pg"]
    side = [r for r in recs if r["group"] not in ("default_pg", "new_group")]
    assert [(r["op"], r["seq"]) for r in recs if r["group"] == "new_group"] == [("new_group", 0)]
    assert [r["seq"] for r in default] == list(range(250, 300))
    assert len(side) == 1 and side[0]["seq"] == 0
    assert recs[1] is side[0]  # buffer order: the older records first (new_group, then the side group's)
    assert all(r["state"] == "completed" for r in recs)


def test_the_analysis_names_the_rank_that_left(early_exit):
    from hangdoc.analysis import record_rules
    from hangdoc.model import Job, Report, Source
    from hangdoc.readers import records as records_reader

    recs = []
    for p in sorted(glob.glob(os.path.join(early_exit, "collectives-*.jsonl"))):
        src = Source(p)
        recs += records_reader.read(p, src)
        assert src.errors == []
    head = record_rules.findings(Report(job=Job(records=recs)))[0]
    assert head.kind == "collective-mismatch"
    assert [c.rank for c in head.culprits] == [1]
    assert "all_reduce #300" in head.summary


@pytest.mark.parametrize("setting,expected", [("", 4096), ("all", None), ("0", 0), ("17", 17), ("-3", 0), ("lots", 4096)])
def test_exit_records_setting(monkeypatch, setting, expected):
    monkeypatch.setenv("HANGDOC_EXIT_RECORDS", setting)
    assert recorder._env_exit_records() == expected


def _rec(seq, group):
    return (seq, "all_reduce", (group, ()), (), (), None, None, False, None, None, None, 0.0, 0.0, "completed")


@settings(max_examples=300, deadline=None)
@given(groups=st.lists(st.sampled_from("abcd"), max_size=60), limit=st.integers(0, 70))
def test_tail_keeps_the_newest_and_each_groups_last(groups, limit):
    raw = [_rec(i, g) for i, g in enumerate(groups)]
    out = recorder._tail(raw, limit)
    ids = [r[0] for r in out]
    assert ids == sorted(set(ids))  # a subsequence, in buffer order
    newest = ids[len(ids) - min(limit, len(raw)):]
    assert newest == list(range(len(raw) - min(limit, len(raw)), len(raw)))  # the newest `limit` kept
    for g in set(groups):  # every group's newest record is there
        assert max(i for i, x in enumerate(groups) if x == g) in ids
    assert len(out) <= min(limit, len(raw)) + len(set(groups))
