"""The readers on real dumps of real hung programs (tests/fixtures/dumps/, see each README.md).

Each scenario directory holds the same hang dumped by every dumper, one file per pretend node, and
``truth.json``: which pid was which rank/role on which node. The tests check the readers against
that answer key and the formats against each other.
"""

from __future__ import annotations

import json
import os

import pytest

from hangdoc.model import ROLE_LAUNCHER, ROLE_RANK, ROLE_WORKER, STATUS_OK, STATUS_STOPPED
from hangdoc.readers import load_rank_map, read_paths

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "dumps")
SCENARIOS = ["skip_broadcast", "skip_broadcast_root", "dataloader_deadlock", "pipeline_cycle", "stopped_rank", "healthy"]
STACK_KINDS = ["plain", "full", "native", "locals", "json", "with-workers", "pystack", "gdb"]


def scenario(name: str, *parts: str) -> str:
    return os.path.join(FIXTURES, name, *parts)


def truth(name: str) -> dict:
    with open(scenario(name, "truth.json")) as f:
        return json.load(f)


def ranks_of(name: str) -> dict:
    """``{(host, pid): rank}`` of the training processes."""
    out = {}
    for key, v in truth(name).items():
        host, pid = key.split(":")
        if v["role"] == "rank":
            out[(host, int(pid))] = v["rank"]
    return out


def by_key(job):
    return {(p.host, p.pid): p for p in job.processes}


def innermost_python(p):
    for f in reversed(p.main_thread.frames):
        if not f.native:
            return f
    return None


def bare(function: str) -> str:
    """py-spy prints qualified names (``Thread.run``), faulthandler/pystack bare ones (``run``)."""
    return function.rsplit(".", 1)[-1]


@pytest.mark.parametrize("name", SCENARIOS)
@pytest.mark.parametrize("kind", STACK_KINDS)
def test_every_rank_is_read_with_host_and_pid(name, kind):
    d = scenario(name, kind)
    job = read_paths([d])
    assert job.errors == [], [str(e) for e in job.errors]
    ranks = ranks_of(name)
    got = by_key(job)
    for key in ranks:
        if key not in got:
            # py-spy --json prints its error without the pid: an unresponsive process, pid unknown
            assert any(p.host == key[0] and p.pid is None and p.status != STATUS_OK for p in job.processes), key
    for (host, pid), p in got.items():
        assert host is not None and host.startswith("node")
        assert f"{host}:{pid}" in truth(name) or p.pid is None, (host, pid)
        assert p.source.startswith(d) and p.source_line >= 1


@pytest.mark.parametrize("name", SCENARIOS)
def test_formats_agree_on_where_each_rank_is(name):
    """plain, full, json, locals, with-workers and pystack name the same innermost Python frame."""
    ranks = ranks_of(name)
    plain = by_key(read_paths([scenario(name, "plain")]))
    for kind in ("full", "json", "locals", "with-workers", "pystack", "native"):
        other = by_key(read_paths([scenario(name, kind)]))
        for key in ranks:
            a, b = plain[key], other.get(key)
            if a.status != STATUS_OK or b is None or b.status != STATUS_OK:
                continue
            fa, fb = innermost_python(a), innermost_python(b)
            assert fb is not None, (kind, key)
            # a busy process may have moved between two dumps; a hung one may not
            if name != "healthy":
                assert (bare(fa.function), fa.line) == (bare(fb.function), fb.line), (kind, key)


@pytest.mark.parametrize("name", ["skip_broadcast", "dataloader_deadlock", "pipeline_cycle"])
def test_full_filenames_normalise_to_py_spy_short_names(name):
    plain = by_key(read_paths([scenario(name, "plain")]))
    full = by_key(read_paths([scenario(name, "full")]))
    for key, p in plain.items():
        library = [f for f in p.main_thread.frames if f.file.startswith("torch/") or "/" not in f.file]
        lib_full = {(f.function, f.line): f.file for f in full[key].main_thread.frames}
        for f in library:
            if f.file.startswith("torch/") or f.file in ("threading.py", "selectors.py"):
                assert lib_full[(f.function, f.line)] == f.file


def test_skip_broadcast_stacks():
    job = read_paths([scenario("skip_broadcast", "plain")], rank_map=truth("skip_broadcast"))
    where = {p.rank: p.main_thread.top.function for p in job.processes}
    # gloo lets the non-root ranks leave broadcast: the root alone waits there (see the README)
    assert where == {0: "broadcast", 1: "all_reduce", 2: "all_reduce", 3: "all_reduce"}
    frames = job.processes[0].main_thread.frames
    assert [f.function for f in frames][:3] == ["<module>", "main", "sync_params"]  # outermost first
    assert job.world_size == 4
    root = read_paths([scenario("skip_broadcast_root", "plain")], rank_map=truth("skip_broadcast_root"))
    assert {p.rank: p.main_thread.top.function for p in root.processes} == {
        0: "all_reduce", 1: "broadcast", 2: "broadcast", 3: "broadcast"}


def test_identical_stacks_share_one_tuple():
    job = read_paths([scenario("skip_broadcast", "plain")])
    stacks = [p.main_thread.frames for p in job.processes if p.main_thread.top.function == "all_reduce"]
    assert len(stacks) == 3 and all(s is stacks[0] for s in stacks)


def test_host_comes_from_the_trace_file_name():
    job = read_paths([scenario("pipeline_cycle", "plain")])
    t = truth("pipeline_cycle")
    assert sorted((p.host, p.pid) for p in job.processes) == sorted(
        (k.split(":")[0], int(k.split(":")[1])) for k, v in t.items() if v["role"] == "rank")


def test_rank_from_py_spy_locals():
    for name in ("skip_broadcast", "pipeline_cycle", "dataloader_deadlock"):
        job = read_paths([scenario(name, "locals")])
        ranks = ranks_of(name)
        for p in job.processes:
            assert p.rank == ranks[(p.host, p.pid)], (name, p.pid)
            assert p.meta["rank_from"] == "locals"


def test_locals_are_kept_on_frames_and_ignored_by_equality():
    job = read_paths([scenario("pipeline_cycle", "locals")], rank_map=truth("pipeline_cycle"))
    p = next(p for p in job.processes if p.rank == 1)
    recv = next(f for f in p.main_thread.frames if f.function == "recv_activation")
    assert recv.local("src") == "2" and recv.local("buf").startswith("<Tensor at")
    plain = read_paths([scenario("pipeline_cycle", "plain")], rank_map=truth("pipeline_cycle"))
    q = next(q for q in plain.processes if q.rank == 1)
    assert p.main_thread.frames == q.main_thread.frames


def test_rank_map_gives_ranks_and_world_size():
    rank_map = load_rank_map(scenario("pipeline_cycle", "truth.json"))
    assert rank_map == {k: v["rank"] for k, v in truth("pipeline_cycle").items() if v["rank"] is not None}
    job = read_paths([scenario("pipeline_cycle", "plain")], rank_map=rank_map)
    assert sorted(p.rank for p in job.processes) == [0, 1, 2, 3]
    assert job.world_size == 4
    assert {p.main_thread.top.function for p in job.processes if p.rank in (1, 2, 3)} == {"recv"}


def test_dataloader_workers_are_recognised_and_tied_to_their_rank():
    t = truth("dataloader_deadlock")
    job = read_paths([scenario("dataloader_deadlock", "with-workers")], rank_map=t)
    workers = [p for p in job.processes if p.role == ROLE_WORKER]
    assert len(workers) == 4
    for w in workers:
        expected = t[f"{w.host}:{w.pid}"]
        assert expected["role"] == "dataloader-worker"
        assert (w.ppid, w.parent_rank, w.rank) == (expected["ppid"], expected["parent_rank"], None)
    stuck = [w for w in workers if w.main_thread.top.function == "CountingDataset.__getitem__"]
    assert [w.parent_rank for w in stuck] == [1]
    assert {p.rank for p in job.processes if p.role == ROLE_RANK} == {0, 1, 2, 3}


def test_faulthandler_worker_in_its_ranks_stderr():
    job = read_paths([scenario("dataloader_deadlock", "faulthandler")])
    assert job.errors == []
    by_file = {}
    for p in job.processes:
        by_file.setdefault(os.path.basename(p.source), []).append(p)
    for r in range(4):
        procs = by_file[f"stderr-rank{r}.log"]
        roles = sorted(p.role for p in procs)
        assert roles == [ROLE_WORKER, ROLE_RANK]
        rank = next(p for p in procs if p.role == ROLE_RANK)
        worker = next(p for p in procs if p.role == ROLE_WORKER)
        assert rank.rank == r and worker.parent_rank == r and worker.rank is None
    stuck = next(p for p in by_file["stderr-rank1.log"] if p.role == ROLE_WORKER)
    assert stuck.main_thread.top.function == "__getitem__"
    rank1 = next(p for p in by_file["stderr-rank1.log"] if p.role == ROLE_RANK)
    assert rank1.main_thread.is_main and rank1.main_thread.frames[0].function == "<module>"
    assert len(rank1.threads) == 3  # main, metrics-flusher, QueueFeederThread


def test_prefixed_faulthandler_in_the_launcher_console():
    job = read_paths([scenario("skip_broadcast", "console.log")])
    assert job.errors == []
    assert sorted(p.rank for p in job.processes) == [0, 1, 2, 3]
    assert all(p.format == "faulthandler" and p.local_rank == p.rank for p in job.processes)
    assert {p.rank: p.main_thread.top.function for p in job.processes}[0] == "broadcast"


def test_prefixed_interleaved_tracebacks():
    job = read_paths([scenario("skip_broadcast", "traceback", "console.log")])
    assert job.errors == []
    ranks = {p.rank: p for p in job.processes if p.role == ROLE_RANK}
    assert sorted(ranks) == [0, 1, 2, 3]
    # rank 1's lines are interleaved with rank 2's whole traceback in this file
    assert [f.function for f in ranks[1].main_thread.frames][:3] == ["<module>", "main", "train_step"]
    assert ranks[0].main_thread.top.function == "broadcast"
    assert "Timed out" in ranks[0].meta["exception"]
    assert [p.role for p in job.processes].count(ROLE_LAUNCHER) == 1
    # torchrun's ChildFailedError table names each failed rank's pid and host
    assert {r: p.pid for r, p in ranks.items()} == {0: 13343, 1: 13344, 2: 13345, 3: 13346}
    assert {p.host for p in job.processes} == {"localhost"}


def test_launcher_dump():
    job = read_paths([scenario("skip_broadcast", "launcher")])
    (p,) = job.processes
    assert p.role == ROLE_LAUNCHER and len(p.threads) == 9
    assert p.main_thread.name == "MainThread"


def test_py_spy_failure_keeps_the_process_and_says_it_is_stopped():
    for kind in ("plain", "locals", "native", "with-workers"):
        job = read_paths([scenario("stopped_rank", kind)])
        bad = [p for p in job.processes if p.status != STATUS_OK]
        assert len(bad) == 1, kind
        (p,) = bad
        assert (p.host, p.pid) == ("node1", 24709) and truth("stopped_rank")["node1:24709"]["rank"] == 1
        # py-spy's waitpid result says the process was in group-stop: stopped, not just unreadable
        assert p.status == STATUS_STOPPED
        assert p.status_detail.startswith("Error: Failed to get stack traces; the process is stopped")
        assert "Failed to suspend process" in p.meta["error"] and p.threads == []
        assert p.role == ROLE_RANK and p.command.endswith("stopped_rank.py")
        job = read_paths([scenario("stopped_rank", kind)], rank_map=truth("stopped_rank"))
        assert next(p for p in job.processes if p.status != STATUS_OK).rank == 1
    # with --json py-spy prints the error with no "Process" line; its pid is taken from the
    # error text ("unexpected waitpid result PtraceEvent(Pid(24709), SIGSTOP, 128)")
    job = read_paths([scenario("stopped_rank", "json")])
    bad = [p for p in job.processes if p.status == STATUS_STOPPED]
    assert len(bad) == 1 and bad[0].host == "node1" and bad[0].pid == 24709


def test_gdb_and_pystack_native_frames():
    job = read_paths([scenario("stopped_rank", "gdb")])
    p = next(p for p in job.processes if p.pid == 24709)
    assert all(f.native for t in p.threads for f in t.frames)
    assert p.main_thread.ident == "24709" and len(p.threads) == 4
    assert "kill" in p.main_thread.top.function  # it stopped itself with SIGSTOP
    assert any("c10d" in f.function or "gloo" in f.function for t in p.threads for f in t.frames)
    # gdb lines differ in addresses and argument values; equal stacks still share one tuple
    mains = [q.main_thread.frames for q in job.processes if q.pid != 24709]
    assert len(mains) == 3 and all(m is mains[0] for m in mains)
    job = read_paths([scenario("stopped_rank", "pystack")])
    p = next(p for p in job.processes if p.pid == 24709)
    names = [f.function for f in p.main_thread.frames]
    assert names[0] == "_start" and "<module>" in names and "step_fn" not in names[:1]


def test_py_spy_native_keeps_long_template_names():
    job = read_paths([scenario("skip_broadcast", "native")])
    p = job.processes[0]
    longest = max((f for f in p.main_thread.frames if f.native), key=lambda f: len(f.function))
    assert len(longest.function) > 500 and longest.function.startswith("pybind11::")
    assert any(f.function == "c10d::Work::wait" for f in p.main_thread.frames)
    assert any(f.function == "??" for f in p.main_thread.frames)  # addresses alone do not split groups


def test_whole_scenario_directory_skips_non_dumps():
    job = read_paths([scenario("dataloader_deadlock")])
    names = {os.path.basename(s.path) for s in job.sources}
    assert "README.md" not in names and "truth.json" not in names
    assert [e for e in job.errors if e.source != "evidence"] == []
    # the directory holds two runs (console.log's tracebacks: pids 3821-3824 on localhost; the gdb
    # and py-spy dumps: 32380-32390 on node1, node2), which nothing in the files tells apart: said once
    (warn,) = [e for e in job.errors if e.source == "evidence"]
    assert "more than one process for" in warn.message and "3821, 32380" in warn.message
    assert {s.formats[0] for s in job.sources if s.path != "evidence"} == {"py-spy", "py-spy-json", "pystack", "gdb", "faulthandler", "traceback"}


def test_glob_and_rank_map_by_pid_only():
    t = truth("healthy")
    pid_map = {k.split(":")[1]: v["rank"] for k, v in t.items() if v["rank"] is not None}
    job = read_paths([os.path.join(scenario("healthy", "plain"), "trace-*.out")], rank_map=pid_map)
    assert sorted(p.rank for p in job.processes) == [0, 1]
    assert all(p.main_thread.state in ("active", "active+gil", "idle") for p in job.processes)


def test_same_code_on_three_pythons_compares_equal():
    """lock_cycle.py dumped under Python 3.11, 3.12 and 3.13: line numbers of the standard library
    differ, its paths (…/lib/python3.X/threading.py) normalise to the same name."""
    job = read_paths([scenario("pythons")])
    assert job.errors == []
    pyspy = {p.host: p for p in job.processes if p.format == "py-spy"}
    assert sorted(pyspy) == ["py3.11", "py3.12", "py3.13"]
    loader_stacks = {
        tuple((f.function, f.file) for f in next(t for t in p.threads if t.name == "loader").frames)
        for p in pyspy.values()}
    assert loader_stacks == {(("Thread._bootstrap", "threading.py"), ("Thread._bootstrap_inner", "threading.py"),
                              ("Thread.run", "threading.py"), ("load_batches", "/work/main/examples/hangs/lock_cycle.py"))}
    lines = {p.host: next(t for t in p.threads if t.name == "loader").frames[0].line for p in pyspy.values()}
    assert len(set(lines.values())) == 3  # really three different standard libraries
    fh = [p for p in job.processes if p.format == "faulthandler"]
    assert len(fh) == 3
    assert len({tuple((f.function, f.file) for t in p.threads for f in t.frames) for p in fh}) == 1
    assert all(p.main_thread.top.function == "main" for p in fh)


def test_rank_map_naming_a_worker_gives_its_parent_rank():
    t = truth("dataloader_deadlock")
    flat = {k: (v["rank"] if v["rank"] is not None else v.get("parent_rank")) for k, v in t.items()}
    job = read_paths([scenario("dataloader_deadlock", "faulthandler"), scenario("dataloader_deadlock", "plain")],
                     rank_map={k: v for k, v in flat.items() if v is not None})
    plain_workers = [p for p in job.processes if p.role == ROLE_WORKER and p.format == "py-spy"]
    assert plain_workers == []  # the srun-style files hold the ranks only
    job = read_paths([scenario("dataloader_deadlock", "with-workers")],
                     rank_map={k: v for k, v in flat.items() if v is not None and t[k]["role"] == "dataloader-worker"})
    assert sorted((p.pid, p.parent_rank, p.rank) for p in job.processes if p.role == ROLE_WORKER) == sorted(
        (int(k.split(":")[1]), v["parent_rank"], None) for k, v in t.items() if v["role"] == "dataloader-worker")


def test_a_rank_whose_script_path_mentions_a_launcher_is_a_rank():
    """py-spy's Process line: the role comes from what the command runs (hangdoc.cmdline), the same
    rule hangdoc dump uses, never from a substring of a path."""
    from hangdoc.readers import read_text

    text = ('Process 7: /usr/bin/python3 /home/u/torchrun-exps/accelerate/train.py --lr 1\nPython v3.11.7\n\n'
            'Thread 7 (idle): "MainThread"\n    main (train.py:3)\n\n'
            'Process 6: /usr/bin/python3 -u -m torch.distributed.run --nproc-per-node 2 /home/u/train.py\nPython v3.11.7\n\n'
            'Thread 6 (idle): "MainThread"\n    _invoke_run (torch/distributed/elastic/agent/server/api.py:908)\n')
    job = read_text(text, name="trace-n1.out")
    assert {p.pid: p.role for p in job.processes} == {7: "rank", 6: "launcher"}
