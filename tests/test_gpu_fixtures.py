"""Verdicts on NCCL hangs captured on 2 × H200 (tests/fixtures/gpu/**): CPU CI keeps checking them.

Each scenario is read three ways, as a user would: the stack dumps alone (py-spy --native of every
process), the Flight Recorder dumps (or hangdoc's records) alone, and everything together. What the
stacks alone get wrong or cannot tell is asserted too, so a change that hides it shows up here.
"""

import os
import subprocess
import sys

import pytest

from hangdoc.analysis import analyse
from hangdoc.cli.aggregate import read_rank_map
from hangdoc.readers import read_paths

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN1 = os.path.join(ROOT, "tests", "fixtures", "gpu")


def verdict(*paths, rank_map=None):
    """(kind, culprit ranks, culprit pids, summary) of the headline finding."""
    rm = read_rank_map(rank_map) if rank_map else None
    job = read_paths(list(paths), rm)
    f = analyse(job).findings[0]
    return f.kind, {c.rank for c in f.culprits if c.rank is not None}, {c.pid for c in f.culprits if c.pid}, f.summary


def run1(scenario, *parts):
    return os.path.join(RUN1, scenario, *parts)


# -- run 1: plain torchrun (no hangdoc in the job): stacks + Flight Recorder ---------------------

def test_skip_broadcast_stacks_alone_cannot_name_the_rank():
    kind, ranks, pids, summary = verdict(run1("nccl_skip_broadcast", "trace-gpu1.out"))
    # Both ranks sit in .item() (cudaStreamSynchronize): the wrong op is already on the GPU.
    assert kind == "collective-wait" and not ranks and not pids
    assert ".item()" in summary and "below Python" in summary


def test_skip_broadcast_flight_recorder_names_rank_1():
    kind, ranks, _, summary = verdict(run1("nccl_skip_broadcast", "fr"))
    # FR pairs equal sequence numbers (rank 0's broadcast #8 with rank 1's all_reduce #8); the
    # alignment sees rank 1 issuing all_reduce where the loop always issued broadcast next.
    assert (kind, ranks) == ("collective-mismatch", {1})
    assert "rank 1 skipped broadcast #8" in summary


def test_skip_broadcast_together():
    kind, ranks, _, _ = verdict(run1("nccl_skip_broadcast"))
    assert (kind, ranks) == ("collective-mismatch", {1})


def test_pipeline_cycle_stacks_alone_see_a_host_sync():
    kind, ranks, _, summary = verdict(run1("nccl_pipeline_cycle", "trace-gpu1.out"))
    assert kind == "collective-wait" and not ranks and ".item()" in summary


def test_pipeline_cycle_flight_recorder_finds_the_cycle():
    # Each rank's send is posted, but behind its own blocked recv on the pair's NCCL stream.
    kind, ranks, _, summary = verdict(run1("nccl_pipeline_cycle", "fr"))
    assert (kind, ranks) == ("p2p-cycle", {0, 1})
    assert "recv" in summary or "cycle" in summary


def test_pipeline_cycle_together():
    kind, ranks, _, _ = verdict(run1("nccl_pipeline_cycle"))
    assert (kind, ranks) == ("p2p-cycle", {0, 1})


def test_dataloader_stacks_name_the_stalled_rank():
    rm = run1("nccl_dataloader_deadlock", "rank-map.txt")
    kind, ranks, pids, _ = verdict(run1("nccl_dataloader_deadlock", "trace-gpu1.out"), rank_map=rm)
    assert kind == "dataloader-stall" and 1 in ranks and 723 in pids and 0 not in ranks


def test_dataloader_flight_recorder_sees_rank_1_behind():
    # FR cannot see the DataLoader: it sees rank 0 waiting in all_reduce #4 that rank 1 never
    # issued. Being behind alone blames nobody (no culprit) until a stack says why.
    kind, ranks, _, summary = verdict(run1("nccl_dataloader_deadlock", "fr"))
    assert (kind, ranks) == ("collective-wait", set())
    assert "all_reduce #4" in summary and "for rank 1" in summary


def test_dataloader_together():
    rm = run1("nccl_dataloader_deadlock", "rank-map.txt")
    kind, ranks, pids, _ = verdict(run1("nccl_dataloader_deadlock"), rank_map=rm)
    assert kind == "dataloader-stall" and 1 in ranks and 723 in pids and 0 not in ranks


def test_stream_misplacement_stacks_alone_see_synchronize_only():
    # No Flight Recorder dump: NCCL's watchdog never fired (the deadlocked kernels never started).
    assert not os.listdir(run1("nccl_stream_misplacement", "fr")) if os.path.isdir(run1("nccl_stream_misplacement", "fr")) else True
    kind, ranks, _, summary = verdict(run1("nccl_stream_misplacement"))
    assert kind == "collective-wait" and not ranks and "synchronize" in summary


def test_cli_on_a_scenario_directory():
    r = subprocess.run([sys.executable, "-m", "hangdoc", "aggregate", run1("nccl_skip_broadcast"), "--format", "json"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    import json

    top = json.loads(r.stdout)["findings"][0]
    assert top["kind"] == "collective-mismatch" and [c["rank"] for c in top["culprits"]] == [1]
