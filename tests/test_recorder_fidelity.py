"""Recording fidelity on a real 3-rank torchrun gloo job (examples/records/fidelity.py).

One job, many assertions: per-group sequence numbers, shapes and dtypes, roots and peers as global
ranks (also through group_src in a subgroup), async completion, batch_isend_irecv, object
collectives, phases (explicit and autograd-inferred), call sites, and the dump at exit.
"""

from __future__ import annotations

import glob
import json
import os
import re

import pytest

from tests.procs import ROOT, run, torchrun_cmd

torch = pytest.importorskip("torch")

SCRIPT = os.path.join(ROOT, "examples", "records", "fidelity.py")


def _marks():
    marks = {}
    with open(SCRIPT) as f:
        for i, line in enumerate(f, 1):
            m = re.search(r"# mark:(\w+)", line)
            if m:
                marks[m.group(1)] = i
    return marks


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("fidelity")
    res = run(torchrun_cmd(3, SCRIPT), timeout=90, env={"HANGDOC_OUT": str(out)})
    assert not res.timed_out and res.returncode == 0, res.stderr[-3000:]
    files = sorted(glob.glob(str(out / "collectives-*.jsonl")))
    assert len(files) == 3, (files, res.stderr[-2000:])
    by_rank = {}
    for path in files:
        with open(path) as f:
            lines = [json.loads(line) for line in f]
        header, recs = lines[0], lines[1:]
        by_rank[header["rank"]] = (header, recs, path)
    return by_rank


def _find(recs, op, group=None):
    return [r for r in recs if r["op"] == op and (group is None or r["group"] == group)]


def test_header_and_file_name(job):
    for rank, (header, recs, path) in job.items():
        assert header["hangdoc"] == "collectives" and header["version"] == 1
        assert header["rank"] == rank and header["world_size"] == 3 and header["errors"] == 0
        assert os.path.basename(path) == f"collectives-{header['host']}-r{rank}-{header['pid']}.jsonl"
        assert all(r["pid"] == header["pid"] and r["rank"] == rank for r in recs)


def test_seq_per_group_is_contiguous_and_groups_agree(job):
    names = {}
    for rank, (_, recs, _) in job.items():
        per_group = {}
        for r in recs:
            per_group.setdefault(r["group"], []).append(r["seq"])
            names.setdefault(r["group"], set()).add(tuple(r["group_ranks"]))
        for group, seqs in per_group.items():
            assert seqs == list(range(len(seqs))), (rank, group, seqs)
    assert names["default_pg"] == {(0, 1, 2)}
    assert names.get("new_group") == {(0, 1, 2)}  # new_group calls: their own sequence, made by every rank
    sub = [g for g in names if g not in ("default_pg", "new_group")]
    assert len(sub) == 1 and names[sub[0]] == {(1, 2)}  # the same name on both member ranks
    assert not any(r["group"] == sub[0] for r in job[0][1])  # rank 0 is not in the subgroup


def test_group_creation_inside_new_subgroups_is_recorded_at_the_users_line(job):
    # every rank creates every sub-group; each new_group of it is a creation of its own (a rank that
    # alone enters new_subgroups diverges there: examples/bugs/token_budget_ckpt_subgroups.py)
    line = _marks()["subgroups"]
    for rank, (_, recs, _) in job.items():
        made = [(r["shapes"], r["call_site"].split(":")[1]) for r in _find(recs, "new_group")]
        assert made == [([[1, 2]], str(_marks()["new_group"])), ([[0]], str(line)), ([[1, 2]], str(line))], made


def test_shapes_dtypes_and_global_roots(job):
    for rank, (_, recs, _) in job.items():
        b = _find(recs, "broadcast", "default_pg")[0]
        assert (b["shapes"], b["dtypes"], b["root"]) == ([[5]], ["int64"], 2)
        g = _find(recs, "all_gather")[0]
        assert (g["shapes"], g["dtypes"]) == ([[2]], ["int32"])
        o = _find(recs, "all_gather_object")[0]
        assert (o["shapes"], o["dtypes"]) == ([[3]], ["object"])
        # object collectives run broadcasts/all_gathers inside torch: those are not recorded again
        assert len(_find(recs, "all_gather")) == 1
    for rank in (1, 2):
        recs = job[rank][1]
        sb = [r for r in recs if r["op"] == "broadcast" and r["group"] != "default_pg"][0]
        # group_src=1 in group [1, 2] is global rank 2
        assert (sb["shapes"], sb["dtypes"], sb["root"]) == ([[3, 2]], ["float64"], 2)
        sr = [r for r in recs if r["op"] == "reduce"][0]
        assert sr["root"] == 1


def test_async_and_p2p(job):
    for rank, (_, recs, _) in job.items():
        a = [r for r in recs if r["op"] == "all_reduce" and r["async_op"]]
        assert len(a) == 1 and a[0]["state"] == "completed" and a[0]["time_completed"] >= a[0]["time_issued"]
        s, v = _find(recs, "isend")[0], _find(recs, "irecv")[0]
        assert s["peer"] == (rank + 1) % 3 and v["peer"] == (rank - 1) % 3
        assert s["async_op"] and v["async_op"] and s["state"] == v["state"] == "completed"
        assert all(r["state"] == "completed" for r in recs)
    assert _find(job[0][1], "send")[0]["peer"] == 2
    assert _find(job[2][1], "recv")[0]["peer"] == 0


def test_phases_and_call_sites(job):
    marks = _marks()
    for rank, (_, recs, _) in job.items():
        def line(r):
            path, ln, func = r["call_site"].rsplit(":", 2)
            assert path == SCRIPT
            return int(ln), func

        assert line(_find(recs, "all_reduce")[0]) == (marks["all_reduce"], "main")
        assert line(_find(recs, "isend")[0]) == (marks["batch"], "main")
        assert line(_find(recs, "barrier")[0]) == (marks["phase"], "main")
        assert _find(recs, "barrier")[0]["phase"] == "eval"
        bw = [r for r in recs if r["phase"] == "backward"]
        assert len(bw) == 1 and line(bw[0]) == (marks["backward"], "backward")
        assert all(r["phase"] is None for r in recs if r not in bw and r["op"] != "barrier")


def test_ddp_construction_is_recorded(job):
    marks = _marks()
    for rank, (_, recs, _) in job.items():
        ddp = [r for r in recs if r["op"] in ("verify_params_across_processes", "broadcast_coalesced")]
        assert [r["op"] for r in ddp] == ["verify_params_across_processes", "broadcast_coalesced"]
        assert all(r["shapes"] == [[3, 4], [3]] for r in ddp)
        assert ddp[1]["root"] == 0
        assert all(r["call_site"].endswith(f"fidelity.py:{marks['ddp']}:main") for r in ddp)
