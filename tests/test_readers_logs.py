"""Console-log shapes read from real captures: the debug server's periodic stacks (ranks from its
section headers), py-spy dumps behind a pdsh prefix, C++ backtraces joining the process they belong
to, headerless traceback fragments, and a log truncated mid-line reported as a truncated source."""

import os

from hangdoc.readers import read_paths, read_text

HERE = os.path.dirname(os.path.abspath(__file__))
FIX = os.path.join(HERE, "fixtures")


def test_debug_server_stacks_take_their_ranks_from_the_section_headers():
    job = read_paths([os.path.join(FIX, "debug_server", "periodic_stacks.txt")])
    assert sorted((p.rank, p.host) for p in job.processes) == [(0, "vm"), (1, "vm"), (2, "vm"), (3, "vm")]
    tops = {p.rank: p.main_thread.top.function for p in job.processes}
    assert tops[0] == "broadcast" and {tops[1], tops[2], tops[3]} == {"all_reduce"}


def test_py_spy_dumps_behind_a_pdsh_prefix(tmp_path):
    out = tmp_path / "pdsh.out"
    with open(out, "w") as f:
        for node in ("node1", "node2"):
            with open(os.path.join(FIX, "dumps", "skip_broadcast", "plain", f"trace-{node}.out")) as src:
                f.writelines(f"{node}: {line}" for line in src)
    job = read_paths([str(out)])
    assert sorted((p.host, p.pid) for p in job.processes) == [("node1", 12610), ("node1", 12611),
                                                               ("node2", 12612), ("node2", 12613)]
    assert all(p.main_thread.frames for p in job.processes) and not job.errors


def test_cxx_backtraces_join_the_rank_that_printed_them():
    # the NCCL DataLoader capture: rank 0's DistBackendError traceback, then the watchdog's
    # unprefixed c10 backtraces: one process, the C++ frames a thread of it
    job = read_paths([os.path.join(FIX, "gpu", "nccl_dataloader_deadlock", "log.txt")])
    (r0,) = [p for p in job.processes if p.rank == 0]
    names = [t.name for t in r0.threads]
    assert names[0] == "MainThread" and names.count("c10::Error (native)") == 3
    assert r0.meta["raised_from"].startswith("checkTimeout at ")


def test_a_traceback_fragment_without_its_header():
    job = read_text('[rank2]:   File "/w/train.py", line 12, in step\n[rank2]:     dist.all_reduce(t)\n'
                    '[rank2]: RuntimeError: Socket Timeout\n')
    (p,) = job.processes
    assert p.rank == 2 and p.meta["fragment"] and p.main_thread.top.function == "step"
    assert p.meta["exception"] == "RuntimeError: Socket Timeout" and not job.errors


def test_a_log_cut_mid_line_is_a_truncated_source_not_a_hung_process(tmp_path):
    src = os.path.join(FIX, "gpu", "nccl_skip_broadcast", "log.txt")
    with open(src, "rb") as f:
        data = f.read()
    cut = tmp_path / "cut.log"
    cut.write_bytes(data[:data.index(b"Watchdog caught") + 40])  # inside rank 1's timeout line
    job = read_paths([str(cut)])
    (s,) = job.sources
    assert s.truncated and any("cut off" in e.message for e in s.errors)
    assert all(p.status != "unresponsive" for p in job.processes)


def test_a_traceback_cut_off_at_the_end_of_a_log_leaves_its_rank_unblamed(tmp_path):
    cut = tmp_path / "console.log"
    cut.write_text('[rank1]: Traceback (most recent call last):\n[rank1]:   File "/w/train.py", line 9, in <module>\n'
                   '[rank1]:     dist.barri')
    job = read_paths([str(cut)])
    assert job.sources[0].truncated
    assert [p.status for p in job.processes] == ["ok"]


def test_a_hand_collapsed_py_spy_listing_is_one_process_per_header():
    # what people paste: the headers of the ranks that share a stack, then the stack once
    job = read_text('Thread 4101 (idle): "MainThread"\nThread 4102 (idle): "MainThread"\n'
                    '    all_reduce (torch/distributed/distributed_c10d.py:2501)\n    main (train.py:40)\n'
                    'Thread 4103 (idle): "MainThread"\n    broadcast (torch/distributed/distributed_c10d.py:2100)\n'
                    '    main (train.py:38)\n')
    tops = {p.pid: p.main_thread.top.function for p in job.processes}
    assert tops == {4101: "all_reduce", 4102: "all_reduce", 4103: "broadcast"}


def test_periodic_debug_server_dumps_are_snapshots_of_one_job(tmp_path):
    src = os.path.join(FIX, "debug_server", "periodic_stacks.txt")
    with open(src) as f:
        text = f.read()
    (tmp_path / "stacks_20260101_100000.txt").write_text(text.replace("line 28 in main", "line 27 in main"))
    (tmp_path / "stacks_20260101_100100.txt").write_text(text)
    job = read_paths([str(tmp_path)])
    assert sorted(p.rank for p in job.processes) == [0, 1, 2, 3]
    (r0,) = [p for p in job.processes if p.rank == 0]
    # the newest dump is the state; rank 0's stack differed in the earlier one: it was moving
    assert r0.source.endswith("100100.txt") and r0.meta["snapshots"] == 2 and r0.meta["moved"]
    assert not any(p.meta.get("moved") for p in job.processes if p.rank != 0)


def test_the_detectors_divergence_json_is_aggregated():
    # captured on 2 GPUs (tests/fixtures/detect/gpu): rank 1 skipped a broadcast; two ranks, so
    # the detector named the higher rank and the aggregate names both sides
    from hangdoc.analysis.diagnose import diagnose
    from hangdoc.analysis.grouping import build_report

    job = read_paths([os.path.join(FIX, "detect", "gpu", "divergence.json")])
    report = build_report(job, "function+line")
    top = diagnose(report)[0]
    assert top.kind == "collective-mismatch" and sorted(c.rank for c in top.culprits) == [0, 1]
    assert "no majority" in top.summary and any("nccl_silent_skip.py:56" in e for e in top.evidence)


def test_two_runs_of_a_job_in_one_directory_are_kept_apart(tmp_path):
    # two real runs of the NCCL skipped-broadcast job (hangdoc's watchdog dumps, different launchers)
    # copied into one directory, the older one first: the newest run is the evidence, with a warning
    import shutil

    old = os.path.join(FIX, "gpu", "hangdoc-run3", "nccl_skip_broadcast", "watchdog")
    new = os.path.join(FIX, "gpu", "hangdoc-run", "nccl_skip_broadcast", "watchdog")
    for i, d in enumerate((old, new)):
        for name in os.listdir(d):
            if name.startswith("stacks-"):
                dst = tmp_path / name
                shutil.copy(os.path.join(d, name), dst)
                os.utime(dst, (1_700_000_000 + i * 3600,) * 2)
    job = read_paths([str(tmp_path)])
    ranks = sorted(p.rank for p in job.processes if p.role == "rank")
    assert ranks == [0, 1] and {p.pid for p in job.processes if p.role == "rank"} == {907, 908}
    (warn,) = [e for e in job.errors if e.source == "evidence"]
    assert "2 runs of a job" in warn.message and "kept the newest" in warn.message and "1018" in warn.message


def _pyspy_two_runs(tmp_path, names=None):
    """The plain py-spy dumps of examples/bugs/two_jobs.py (tests/fixtures/bugs/README.md): two runs,
    pids 7485-7488 (rank 1 skipped) and 7581-7584 (rank 3 skipped), copied with one file time."""
    import shutil

    d = os.path.join(FIX, "bugs", "two_jobs", "pyspy")
    for name in names or os.listdir(d):
        shutil.copy(os.path.join(d, name), tmp_path / name)
        os.utime(tmp_path / name, (1_700_000_000,) * 2)
    from hangdoc.cli.aggregate import read_rank_map

    return read_paths([str(tmp_path)], rank_map=read_rank_map(os.path.join(FIX, "bugs", "two_jobs", "pyspy-rank-map.txt")))


def test_two_runs_copied_with_one_file_time_are_told_apart_by_their_pids(tmp_path):
    job = _pyspy_two_runs(tmp_path)
    assert sorted((p.rank, p.pid) for p in job.processes) == [(0, 7581), (1, 7582), (2, 7583), (3, 7584)]
    (warn,) = [e for e in job.errors if e.source == "evidence"]
    assert "2 runs of a job" in warn.message and "7485, 7486, 7487, 7488" in warn.message and "pids" in warn.message


def test_runs_that_nothing_tells_apart_are_kept_with_a_warning(tmp_path):
    # rank 0 of the newer run with ranks 1-3 of the older and rank 0 of the older: no block holds
    # every rank once, so no run can be picked; the evidence stays whole and says it mixes runs
    job = _pyspy_two_runs(tmp_path, ["trace-run0-rank0.out", "trace-run0-rank1.out", "trace-run1-rank0.out"])
    assert len([p for p in job.processes if p.rank == 0]) == 2
    (warn,) = [e for e in job.errors if e.source == "evidence"]
    assert "more than one process for rank 0" in warn.message and "7485, 7581" in warn.message


def _headline(job):
    from hangdoc.analysis.diagnose import diagnose
    from hangdoc.analysis.grouping import build_report

    report = build_report(job, "function+line")
    report.findings = diagnose(report)
    return report.findings[0]


def test_a_pasted_py_spy_dump_cut_mid_line_is_a_truncated_source_not_an_unresponsive_process(tmp_path):
    # the paste of issue huggingface/accelerate#3104, cut inside its frames at several places:
    # once "unresponsive-process: the dump of pid 42 is cut off", pid 42 the culprit
    with open(os.path.join(FIX, "logs", "launch", "huggingface-accelerate-3104.log"), "rb") as f:
        data = f.read()
    whole = _headline(read_paths([os.path.join(FIX, "logs", "launch", "huggingface-accelerate-3104.log")]))
    for cut in (len(data) - 5, data.index(b"loss_scaler.py") + 5, data.index(b"Thread 928") + 4):
        path = tmp_path / f"cut{cut}.log"
        path.write_bytes(data[:cut])
        job = read_paths([str(path)])
        assert job.sources[0].truncated, cut
        assert all(p.status == "ok" for p in job.processes), cut
        f = _headline(job)
        assert f.kind == whole.kind and f.kind != "unresponsive-process" and not f.culprits, (cut, f.summary)


def test_a_dump_file_cut_mid_line_keeps_its_processes_and_says_the_file_was_cut(tmp_path):
    # hangdoc dump's file of node1 (two ranks), cut inside the second one's "Python v3.11.7" line and
    # inside its top frame and its third: the source is truncated, no process is blamed for the cut, and a frame
    # cut in two is not read (a half function name is no frame)
    with open(os.path.join(FIX, "dumps", "skip_broadcast", "plain", "trace-node1.out"), "rb") as f:
        data = f.read()
    second = data.index(b"Process 12611")
    for cut, status in ((data.index(b"Python v", second) + 10, "log-only"),
                        (data.index(b"    all_reduce (", second) + 9, "log-only"),
                        (data.index(b"    train_step (", second) + 9, "ok")):
        path = tmp_path / "trace-node1.out"
        path.write_bytes(data[:cut])
        job = read_paths([str(path)])
        assert job.sources[0].truncated
        assert [(p.pid, p.status) for p in job.processes] == [(12610, "ok"), (12611, status)]
        assert job.processes[1].meta["cut_off"]
        assert not any(fr.function in ("all_r", "train") for p in job.processes for t in p.threads for fr in t.frames)
        f = _headline(job)
        assert f.kind != "unresponsive-process", f.summary
        if status == "log-only":  # nothing of its stack was read: it is not blamed
            assert 12611 not in [c.pid for c in f.culprits], f.summary
        else:  # its innermost frames were read (py-spy prints them first): the verdict of the whole file
            whole = _headline(read_paths([os.path.join(FIX, "dumps", "skip_broadcast", "plain", "trace-node1.out")]))
            assert (f.kind, [c.pid for c in f.culprits]) == (whole.kind, [c.pid for c in whole.culprits])


def test_the_world_size_a_log_states():
    # verbatim lines of the fixtures: torchrun's args (two nodes of two), NCCL's communicator
    # (8 ranks), a command line with no --nnodes (one node); a node range says nothing
    from hangdoc.analysis.log_rules import stated_world_size

    def ws(path):
        return stated_world_size(read_paths([os.path.join(FIX, "logs", path)]).events)

    assert ws("launch/pytorch-pytorch-64926.log") == 4
    assert ws("launch/vllm-project-vllm-6732-17.log") == 8
    assert ws("captured/nccl-h100x4-slow_checkpoint.log") == 4
    assert ws("nccl/aioz-ai-GCD-6.log") is None
    assert stated_world_size(read_text("$ torchrun --nnodes=1:4 --nproc-per-node 8 train.py\n").events) is None
    assert stated_world_size(read_text("$ torchrun --nproc_per_node=gpu train.py\n").events) is None
    assert stated_world_size(read_text("  global_world_sizes=[16, 16, 16, 16]\n").events) == 16


def test_a_silent_rank_is_named_when_the_log_states_the_world_size():
    # the captured NCCL run: ranks 1-3 time out at SeqNum 1, rank 0 (in its checkpoint) says nothing,
    # torchrun's command line says 4 ranks; once "collective-wait" with no culprit
    job = read_paths([os.path.join(FIX, "logs", "captured", "nccl-h100x4-slow_checkpoint.log")])
    f = _headline(job)
    assert (f.kind, [c.rank for c in f.culprits]) == ("missing-rank", [0]), f.summary
    assert any("world size 4 from" in line and "--nproc-per-node 4" in line for line in f.evidence)
    assert job.world_size is None  # stated by a log: the log rules use it, no dump is expected per rank
