"""One process is one entry, whichever dumps of it are read together, and a job dumped partly
with ``py-spy dump`` and partly with ``--full-filenames`` groups as if dumped one way."""

from __future__ import annotations

import glob
import os

import pytest

from hangdoc.analysis import analyse
from hangdoc.readers import read_paths
from tests.procs import ROOT

DUMPS = os.path.join(ROOT, "tests", "fixtures", "dumps")
SCENARIOS = ["dataloader_deadlock", "skip_broadcast", "pipeline_cycle", "stopped_rank"]
GPU_DL = os.path.join(ROOT, "tests", "fixtures", "gpu", "nccl_dataloader_deadlock")


def _verdict(report):
    head = report.findings[0]
    return head.kind, sorted((c.host, c.pid, c.rank) for c in head.culprits)


def _groups(report):
    return sorted(sorted((p.host, p.pid) for p in g.members) for g in report.groups)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_same_processes_dumped_four_ways_are_read_once(scenario):
    d = os.path.join(DUMPS, scenario)
    truth = os.path.join(d, "truth.json")
    once = read_paths([os.path.join(d, "plain")], rank_map=truth_map(truth))
    every = read_paths([os.path.join(d, v) for v in ("plain", "native", "json", "full")], rank_map=truth_map(truth))
    assert sorted((p.host, p.pid, p.rank) for p in every.processes) == sorted((p.host, p.pid, p.rank) for p in once.processes)
    assert all(p.meta.get("snapshots") == 4 for p in every.processes if p.pid is not None)
    # the richest dump of each process is kept: --native frames are there
    assert any(f.native for p in every.processes for t in p.threads for f in t.frames)
    assert _verdict(analyse(every)) == _verdict(analyse(once))


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_plain_and_full_filenames_mixed_per_node_group_as_one_format(scenario):
    d = os.path.join(DUMPS, scenario)
    nodes = sorted(os.path.basename(p) for p in glob.glob(os.path.join(d, "plain", "trace-*.out")))
    rmap = truth_map(os.path.join(d, "truth.json"))
    plain = analyse(read_paths([os.path.join(d, "plain")], rank_map=rmap))
    for i in range(len(nodes)):
        mixed = [os.path.join(d, "full" if j == i else "plain", n) for j, n in enumerate(nodes)]
        report = analyse(read_paths(mixed, rank_map=rmap))
        assert _groups(report) == _groups(plain), mixed
        assert _verdict(report) == _verdict(plain), mixed


def test_a_rank_s_dying_traceback_in_the_log_folds_into_its_live_dump():
    """The NCCL job's log holds rank 0's DistBackendError traceback, printed as the watchdog took the
    process down after py-spy had dumped it: one rank 0, carrying the exception, not two."""
    job = read_paths([GPU_DL], rank_map=os.path.join(GPU_DL, "rank-map.txt") and _text_map(os.path.join(GPU_DL, "rank-map.txt")))
    ranks = sorted(p.rank for p in job.processes if p.rank is not None)
    assert ranks == [0, 1]
    (r0,) = [p for p in job.processes if p.rank == 0]
    assert r0.pid == 722 and r0.meta["exception"].startswith("torch.distributed.DistBackendError")
    assert r0.meta["exception_at"].startswith(os.path.join(GPU_DL, "log.txt"))
    # alone, the log is all there is of rank 0: it stays a process; rank 1, which only printed
    # its watchdog's state (a dump signal), is a process known from the log alone
    alone = read_paths([os.path.join(GPU_DL, "log.txt")])
    assert [(p.rank, p.pid, p.status) for p in alone.processes] == [(0, None, "ok"), (1, None, "log-only")]


def truth_map(path):
    from hangdoc.readers import load_rank_map

    return load_rank_map(path)


def _text_map(path):
    from hangdoc.cli.aggregate import read_rank_map

    return read_rank_map(path)


def test_a_process_whose_stack_moved_between_two_dumps_is_said_to_be_moving(tmp_path):
    from hangdoc.analysis import analyse

    block = 'Process {pid}: python train.py\nPython v3.11.7\n\nThread {pid} (active): "MainThread"\n    {fn} (train.py:{line})\n    main (train.py:40)\n\n'
    first = block.format(pid=11, fn="all_reduce", line=9) + block.format(pid=12, fn="load", line=20)
    second = block.format(pid=11, fn="all_reduce", line=9) + block.format(pid=12, fn="forward", line=30)
    for sub, text in (("first", first), ("later", second)):  # srun --output=trace-%N.out, twice
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "trace-n1.out").write_text(text)
    job = read_paths([str(tmp_path / "first"), str(tmp_path / "later")], rank_map={"n1:11": 0, "n1:12": 1})
    assert sorted(p.pid for p in job.processes) == [11, 12]
    by_pid = {p.pid: p for p in job.processes}
    assert by_pid[12].meta["snapshots"] == 2 and by_pid[12].meta["moved"] is True
    assert "moved" not in by_pid[11].meta
    head = analyse(job).findings[0]
    assert any(e.startswith("rank 1 (n1 pid 12): its stack changed between its 2 dumps") for e in head.evidence)
