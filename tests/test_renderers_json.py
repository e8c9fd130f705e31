"""The JSON renderer: the documented, versioned schema (docs/json.md)."""

from __future__ import annotations

import json

from hypothesis import given, settings

from hangdoc.analysis.grouping import build_report
from hangdoc.model import Frame, Job, ParseError, Process, Source, Thread
from hangdoc.ranges import expand_ranks
from hangdoc.renderers import RenderOptions, render

from test_grouping import jobs, proc, BCAST_A
from test_renderers_text import bloom_report

TOP_KEYS = {"version", "granularity", "processes", "world_size", "sources", "groups", "tree", "findings", "missing_ranks", "thread_groups", "events"}
GROUP_KEYS = {"id", "count", "ranks", "hosts", "status", "roles", "summary", "members", "stack"}


def test_schema_of_the_bloom_report():
    report = bloom_report()
    report.job.sources = [Source("trace-node1.out", processes=8, formats=["py-spy"], errors=[ParseError("trace-node1.out", 12, "truncated block")])]
    doc = json.loads(render(report, "json", RenderOptions()))
    assert set(doc) == TOP_KEYS
    assert doc["version"] == 1 and doc["processes"] == 8 and doc["world_size"] == 8
    assert doc["sources"] == [{"path": "trace-node1.out", "processes": 8, "records": 0, "events": 0, "truncated": False,
                               "formats": ["py-spy"], "errors": ["trace-node1.out:12: truncated block"]}]
    g1 = doc["groups"][0]
    assert set(g1) == GROUP_KEYS
    assert (g1["id"], g1["count"], g1["ranks"], g1["hosts"], g1["status"], g1["roles"]) == (1, 4, "0-3", "node1", "ok", ["rank"])
    assert g1["members"][0] == {"host": "node1", "pid": 1000, "rank": 0}
    assert g1["stack"][-1] == {"function": "broadcast", "file": "torch/distributed/distributed_c10d.py", "line": 1500, "native": False}
    assert g1["summary"] == "broadcast ← _bcast_pipe_scalar (engine.py:123)"
    assert [g["count"] for g in doc["groups"]] == [4, 3, 1]
    assert doc["findings"][0]["kind"] == "dataloader-stall"
    assert doc["findings"][0]["culprits"] == [{"host": "node2", "pid": 1004, "rank": 4}]
    assert doc["missing_ranks"] == ""
    tree = doc["tree"]
    assert tree[0] == {"id": 0, "parent": None, "frames": [], "count": 8, "groups": [1, 2, 3]}
    # the shared trunk is one node; then one node per group, largest first
    assert [(n["id"], n["parent"], len(n["frames"]), n["count"], n["groups"]) for n in tree[1:]] == [
        (1, 0, 6, 8, [1, 2, 3]),
        (2, 1, 3, 4, [1]),
        (3, 1, 3, 3, [2]),
        (4, 1, 6, 1, [3]),
    ]
    assert tree[1]["frames"][0] == {"function": "<module>", "file": "pretrain_gpt.py", "line": 300, "native": False}


def test_missing_ranks_and_thread_groups():
    pin = (Frame("_bootstrap", "threading.py", 995), Frame("_pin_memory_loop", "torch/utils/data/_utils/pin_memory.py", 50))
    job = Job(processes=[proc(0, BCAST_A, others=[("pin", pin)]), proc(3, BCAST_A)], world_size=6)
    doc = json.loads(render(build_report(job), "json", RenderOptions()))
    assert doc["missing_ranks"] == "1-2,4-5"
    (tg,) = doc["thread_groups"]
    assert (tg["threads"], tg["thread_names"], tg["ranks"]) == (1, ["pin"], "0")


def test_large_reports_are_compact_but_the_same_document():
    procs = [proc(r, BCAST_A) for r in range(2500)]
    text = render(build_report(Job(processes=procs)), "json", RenderOptions())
    assert "\n " not in text
    doc = json.loads(text)
    assert doc["groups"][0]["ranks"] == "0-2499" and len(doc["groups"][0]["members"]) == 2500


@settings(max_examples=40, deadline=None)
@given(jobs())
def test_json_counts_add_up_and_ranks_round_trip(job):
    doc = json.loads(render(build_report(job), "json", RenderOptions()))
    assert doc["processes"] == len(job.processes) == sum(g["count"] for g in doc["groups"])
    for g in doc["groups"]:
        assert len(g["members"]) == g["count"]
        assert expand_ranks(g["ranks"]) == sorted({m["rank"] for m in g["members"] if m["rank"] is not None})
    tree = doc["tree"]
    assert tree[0]["count"] == len(job.processes)
    for n in tree[1:]:
        assert n["parent"] < n["id"] and n["frames"]
        assert n["count"] == sum(g["count"] for g in doc["groups"] if g["id"] in n["groups"])
    present = {p.rank for p in job.processes if p.rank is not None}
    assert not present & set(expand_ranks(doc["missing_ranks"]))


def test_deep_stack_does_not_recurse():
    deep = tuple(Frame(f"r{i}", "rec.py", i) for i in range(5000))
    doc = json.loads(render(build_report(Job(processes=[Process(threads=[Thread("1", "MainThread", deep, is_main=True)])])), "json", RenderOptions()))
    assert len(doc["groups"][0]["stack"]) == 5000
    assert [len(n["frames"]) for n in doc["tree"]] == [0, 5000]
