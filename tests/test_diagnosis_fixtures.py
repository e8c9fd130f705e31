"""Verdicts on real captured dumps (tests/fixtures/dumps, tests/fixtures/gpu) and on the BLOOM-176B layout.

The dumps were taken from real hung programs (examples/hangs/*.py on gloo, examples/gpu/*.py on
NCCL); truth.json next to each says which pid was which rank. The pipeline is the real one:
readers → grouping → stack rules (and diagnose, which also runs the record rules).
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hangdoc.analysis.diagnose import diagnose
from hangdoc.analysis.grouping import build_report
from hangdoc.analysis.stack_rules import MAX_CONFIDENCE, findings
from hangdoc.model import Culprit
from hangdoc.readers import read_paths

HERE = os.path.dirname(os.path.abspath(__file__))
DUMPS = os.path.join(HERE, "fixtures", "dumps")
GPU = os.path.join(HERE, "fixtures", "gpu")
BLOOM = os.path.join(HERE, "fixtures", "bloom")

PYSPY_KINDS = ["plain", "full", "native", "locals", "json", "with-workers", "pystack"]


def truth(scenario):
    with open(os.path.join(DUMPS, scenario, "truth.json")) as fh:
        return json.load(fh)


def rank_map(scenario):
    return {k: v["rank"] for k, v in truth(scenario).items() if v.get("rank") is not None}


def pid_of(scenario, rank):
    return next(int(k.split(":")[1]) for k, v in truth(scenario).items() if v.get("rank") == rank and v["role"] == "rank")


def verdicts(path, ranks=None):
    report = build_report(read_paths([path], rank_map=ranks))
    return findings(report), report


def kinds_present(scenario):
    d = os.path.join(DUMPS, scenario)
    return [k for k in PYSPY_KINDS if os.path.isdir(os.path.join(d, k))]


def headline(path, ranks=None):
    found, _ = verdicts(path, ranks)
    assert found and all(f.confidence <= MAX_CONFIDENCE for f in found)
    return found[0]


def culprit_pids(f):
    return {c.pid for c in f.culprits}


def culprit_ranks(f):
    return {c.rank for c in f.culprits}


# --- dataloader-stall ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", kinds_present("dataloader_deadlock") + ["faulthandler"])
def test_dataloader_deadlock(kind):
    bad = pid_of("dataloader_deadlock", 1)
    f = headline(os.path.join(DUMPS, "dataloader_deadlock", kind))
    assert f.kind == "dataloader-stall"
    if kind == "faulthandler":  # stderr logs name ranks, not pids
        assert culprit_ranks(f) == {1}
    else:
        assert bad in culprit_pids(f)
        assert not culprit_pids(f) & {pid_of("dataloader_deadlock", r) for r in (0, 2, 3)}


def test_dataloader_deadlock_with_workers_names_the_stuck_worker_too():
    t = truth("dataloader_deadlock")
    f = headline(os.path.join(DUMPS, "dataloader_deadlock", "with-workers"), rank_map("dataloader_deadlock"))
    workers = {int(k.split(":")[1]): v.get("parent_rank") for k, v in t.items() if v["role"] == "dataloader-worker"}
    named_workers = {c.pid for c in f.culprits if c.pid in workers}
    assert named_workers and all(workers[p] == 1 for p in named_workers)
    assert culprit_ranks(f) - {None} == {1}
    assert any("CountingDataset.__getitem__" in e for e in f.evidence)


def test_dataloader_deadlock_gdb_still_names_the_rank():
    # gdb shows no Python frames: the DataLoader wait is only a poll(), but the rank is still the one named
    f = headline(os.path.join(DUMPS, "dataloader_deadlock", "gdb"))
    assert culprit_pids(f) == {pid_of("dataloader_deadlock", 1)}


def test_nccl_dataloader_deadlock_on_gpu():
    f = headline(os.path.join(GPU, "nccl_dataloader_deadlock", "trace-gpu1.out"))
    # plain py-spy prints no parent pid and there is no rank map: the worker (pid 744) is not tied
    # to its rank, yet it is shown, stuck in its lock, and named with the rank waiting on its host
    assert f.kind == "dataloader-stall" and culprit_pids(f) == {723, 744}
    assert any("pid 744; its rank is not known" in e and "stuck in a lock at Data.__getitem__" in e for e in f.evidence)
    assert not any("no DataLoader worker" in e for e in f.evidence)


# --- collective-mismatch ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", kinds_present("skip_broadcast") + ["gdb"])
def test_skip_broadcast_gloo_names_the_ranks_that_moved_on_as_candidates(kind):
    # rank 2 skipped the broadcast; root rank 0 waits in it, 1 and 3 received and moved on (gloo):
    # one of them is to blame, stacks cannot say which
    f = headline(os.path.join(DUMPS, "skip_broadcast", kind), rank_map("skip_broadcast"))
    assert f.kind == "collective-mismatch"
    assert culprit_ranks(f) == set() and {c.rank for c in f.candidates} == {1, 2, 3}
    assert any("gloo" in e for e in f.detail) and any("record" in a for a in f.advice)


@pytest.mark.parametrize("kind", kinds_present("skip_broadcast_root") + ["gdb"])
def test_skip_broadcast_by_the_root(kind):
    f = headline(os.path.join(DUMPS, "skip_broadcast_root", kind), rank_map("skip_broadcast_root"))
    assert (f.kind, culprit_ranks(f)) == ("collective-mismatch", {0})


def test_gdb_dumps_take_the_collective_from_the_gloo_thread():
    # gdb shows the main thread only in c10d::Work::wait; the pt_gloo_runloop thread names the op
    found, _ = verdicts(os.path.join(DUMPS, "skip_broadcast", "gdb"))
    assert any("gloo::broadcast" in e for e in found[0].evidence)


# --- p2p ------------------------------------------------------------------------------------------


def test_pipeline_cycle_with_locals():
    f = headline(os.path.join(DUMPS, "pipeline_cycle", "locals"), rank_map("pipeline_cycle"))
    assert (f.kind, culprit_ranks(f)) == ("p2p-cycle", {1, 2})
    assert "rank 1 recv←2" in f.summary and "rank 2 recv←1" in f.summary


@pytest.mark.parametrize("kind", [k for k in kinds_present("pipeline_cycle") if k != "locals"] + ["gdb"])
def test_pipeline_cycle_without_peers(kind):
    f = headline(os.path.join(DUMPS, "pipeline_cycle", kind), rank_map("pipeline_cycle"))
    assert f.kind == "p2p-stall" and f.culprits == []
    assert any("--locals" in a for a in f.advice)


# --- unresponsive / stopped / missing -------------------------------------------------------------


@pytest.mark.parametrize("kind", ["plain", "native", "locals", "with-workers", "json"])
def test_stopped_rank_py_spy_failure(kind):
    f = headline(os.path.join(DUMPS, "stopped_rank", kind))
    assert f.kind == "unresponsive-process"
    assert culprit_pids(f) == {pid_of("stopped_rank", 1)}
    assert any("Failed" in e for e in f.evidence)  # py-spy's own error line


@pytest.mark.parametrize("kind", ["pystack", "gdb"])
def test_stopped_rank_read_by_ptrace_tools(kind):
    # pystack and gdb read a stopped process: it sits in kill() while the others wait in all_reduce
    # (no ptrace error says so): the stack that stopped itself makes it a stopped process, not a
    # rank that skipped a collective
    f = headline(os.path.join(DUMPS, "stopped_rank", kind))
    assert culprit_pids(f) == {pid_of("stopped_rank", 1)}
    assert f.kind == "unresponsive-process" and "stopped" in f.summary
    assert any("sent itself a stop signal" in e for e in f.evidence)


def test_missing_rank_from_tag_lines(tmp_path):
    src = open(os.path.join(DUMPS, "skip_broadcast", "plain", "trace-node1.out")).read()
    t = truth("skip_broadcast")
    out = []
    for block in src.split("Process ")[1:]:
        pid = int(block.split(":", 1)[0])
        rank = t.get(f"node1:{pid}", {}).get("rank")
        if rank is None:
            continue
        out.append(f"# hangdoc process host=node1 pid={pid} rank={rank} world_size=4\nProcess {block}")
    (tmp_path / "trace-node1.out").write_text("".join(out))
    found, report = verdicts(str(tmp_path))
    assert report.missing_ranks == [2, 3]
    m = next(x for x in found if x.kind == "missing-rank")
    assert {c.rank for c in m.culprits} == {2, 3}


# --- collective-wait / no-hang --------------------------------------------------------------------


@pytest.mark.parametrize("scenario", ["nccl_skip_broadcast", "nccl_stream_misplacement"])
def test_nccl_host_sync_everyone_waits(scenario):
    f = headline(os.path.join(GPU, scenario, "trace-gpu1.out"))
    assert (f.kind, f.culprits) == ("collective-wait", [])
    assert any("Flight Recorder" in e for e in f.evidence)


@pytest.mark.parametrize("kind", kinds_present("healthy") + ["gdb", "faulthandler"])
def test_healthy_is_no_hang_without_culprit(kind):
    found, _ = verdicts(os.path.join(DUMPS, "healthy", kind))
    assert [f.kind for f in found] == ["no-hang"]
    assert all(not f.culprits for f in found)
    assert all(not f.culprits for f in diagnose(build_report(read_paths([os.path.join(DUMPS, "healthy", kind)]))))


def test_nccl_item_without_native_is_no_hang_signature():
    # .item() is a C call: without --native the stacks show user code only, so nobody is blamed
    found, _ = verdicts(os.path.join(GPU, "nccl_skip_broadcast", "trace-gpu1.out"))
    assert all(not f.culprits for f in found)


# --- BLOOM-176B -------------------------------------------------------------------------------------


def _bloom():
    spec = importlib.util.spec_from_file_location("make_bloom", os.path.join(BLOOM, "make_bloom.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bloom_2_nodes_committed_files_match_the_generator(tmp_path):
    t = _bloom().generate(str(tmp_path))
    for name in t["files"]:
        with open(os.path.join(BLOOM, "2-nodes", name)) as a, open(tmp_path / name) as b:
            assert a.read() == b.read()
    assert t["counts"] == {"bcast_pipe_scalar": 4, "dataloader": 1, "broadcast_data": 3, "reduce_outputs": 4, "recv": 4}


def test_bloom_2_nodes_dataloader_stall_names_the_one_process():
    f = headline(os.path.join(BLOOM, "2-nodes"))
    assert f.kind == "dataloader-stall"
    assert [(c.host, c.pid) for c in f.culprits] == [("jean-zay-iam48", 688514)]
    text = " ".join(f.evidence)
    for where in ("_bcast_pipe_scalar", "broadcast_data" if "broadcast_data" in text else "_build_key_size_numel_dictionaries",
                  "_reduce_outputs", "_exec_recv_activations"):
        assert where in text
    assert diagnose(build_report(read_paths([os.path.join(BLOOM, "2-nodes")])))[0].kind == "dataloader-stall"


def test_bloom_384_ranks(tmp_path):
    t = _bloom().generate(str(tmp_path), tp=4, pp=12, dp=8)
    assert t["world_size"] == 384 and len(t["files"]) == 48
    found, report = verdicts(str(tmp_path))
    assert len(report.job.processes) == 384
    f = found[0]
    assert f.kind == "dataloader-stall"
    assert [(c.host, c.pid) for c in f.culprits] == [(t["culprit"]["host"], t["culprit"]["pid"])]


# --- invariance on real dumps ---------------------------------------------------------------------

SCENARIOS = [("dataloader_deadlock", "with-workers"), ("skip_broadcast", "locals"), ("pipeline_cycle", "locals"),
             ("stopped_rank", "plain"), ("healthy", "native"), ("skip_broadcast_root", "plain")]


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(SCENARIOS), st.randoms(use_true_random=False))
def test_file_order_and_labels_never_change_the_verdict(scenario, rnd):
    name, kind = scenario
    d = os.path.join(DUMPS, name, kind)
    files = sorted(os.path.join(d, f) for f in os.listdir(d))
    ranks = rank_map(name)
    base = findings(build_report(read_paths(files, rank_map=ranks)))

    shuffled = files[:]
    rnd.shuffle(shuffled)
    job = read_paths(shuffled, rank_map=ranks)
    # relabel: hosts renamed, pids shifted, ranks permuted (peers from --locals too)
    world = sorted({p.rank for p in job.processes if p.rank is not None})
    perm = dict(zip(world, rnd.sample(world, len(world))))
    hosts = {}
    for p in job.processes:
        if p.host is not None:
            hosts.setdefault(p.host, f"h{rnd.randrange(10**6)}x{len(hosts)}")
    shift = rnd.randrange(1, 10**5)

    def relabel(c: Culprit) -> Culprit:
        return Culprit(hosts.get(c.host, c.host), None if c.pid is None else c.pid + shift, perm.get(c.rank, c.rank))

    from dataclasses import replace

    from hangdoc.model import Frame

    def remap_frame(f: Frame) -> Frame:
        if not f.locals:
            return f
        loc = []
        for k, v in f.locals:
            if k in ("src", "dst", "group_src", "group_dst", "rank") and v.strip().lstrip("-").isdigit() and int(v) in perm:
                v = str(perm[int(v)])
            elif k == "kwargs":
                import re

                v = re.sub(r"(['\"](?:src|dst)['\"]\s*:\s*)(\d+)", lambda m: m.group(1) + str(perm.get(int(m.group(2)), int(m.group(2)))), v)
            loc.append((k, v))
        return replace(f, locals=tuple(loc))

    for p in job.processes:
        p.host = hosts.get(p.host, p.host)
        p.pid = None if p.pid is None else p.pid + shift
        p.ppid = None if p.ppid is None else p.ppid + shift
        p.rank = perm.get(p.rank, p.rank)
        p.parent_rank = perm.get(p.parent_rank, p.parent_rank)
        for t in p.threads:
            t.frames = tuple(remap_frame(f) for f in t.frames)
    rnd.shuffle(job.processes)
    moved = findings(build_report(job))

    def key(fs, f=lambda c: c):
        from collections import Counter

        return Counter((x.kind, frozenset(f(c) for c in x.culprits)) for x in fs)

    assert key(moved) == key(base, relabel)
