"""The record examples hang for real, and the records name the exact culprit.

Live: the four examples of examples/records/ run concurrently on gloo (ranks started directly, as
torchrun would, killed afterwards whatever happens). Fixtures: the same scenarios captured with
torchrun (tests/fixtures/records/), read through hangdoc's readers and the whole analysis.
"""

from __future__ import annotations

import glob
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from hangdoc.analysis import record_rules
from hangdoc.model import Job, Report, Source
from hangdoc.readers import flight_recorder, records as records_reader
from tests.procs import ROOT

pytest.importorskip("torch")
sys.path.insert(0, os.path.join(ROOT, "examples", "records"))
import capture  # noqa: E402

FIXTURES = os.path.join(ROOT, "tests", "fixtures", "records")

#: scenario -> (finding kind, culprit ranks, words the headline must contain)
EXPECTED = {
    "skip_broadcast": ("collective-mismatch", [2], "rank 2 skipped broadcast #3 (skip_broadcast.py:13); everything after it is fallout"),
    "uneven_inputs": ("collective-mismatch", [2], "rank 2 called barrier (uneven_inputs.py:14) while ranks 0-1 called all_reduce #5"),
    "recv_cycle": ("p2p-cycle", [0, 1], "send/recv cycle between ranks 0-1"),
    "shape_mismatch": ("collective-mismatch", [1], "rank 1 called all_reduce([6] float32) (shape_mismatch.py:18) but rank 0 called all_reduce([8] float32)"),
}


def _read(paths, reader):
    recs, errors = [], []
    for p in paths:
        src = Source(p)
        recs += reader.read(p, src)
        errors += src.errors
    assert errors == []
    return recs


def _check(recs, scenario):
    kind, culprits, headline = EXPECTED[scenario]
    head = record_rules.findings(Report(job=Job(records=recs)))[0]
    assert head.kind == kind
    assert [c.rank for c in head.culprits] == culprits
    assert headline in head.summary
    assert head.confidence >= 0.9
    return head


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    base = tmp_path_factory.mktemp("live")
    with ThreadPoolExecutor(len(EXPECTED)) as pool:
        jobs = {s: pool.submit(capture.launch, s, str(base / s), "direct", 90.0, False, 1.5) for s in EXPECTED}
        return {s: (f.result(), base / s) for s, f in jobs.items()}


@pytest.mark.parametrize("scenario", sorted(EXPECTED))
def test_live_hang_names_the_culprit(live, scenario):
    files, out = live[scenario]
    nproc = capture.SCENARIOS[scenario][1]
    assert len(files) == nproc, open(out / "launcher.log", errors="replace").read()[-3000:]
    recs = _read(files, records_reader)
    assert {r.state for r in recs} <= {"issued", "completed"}  # nobody crashed: a real hang
    assert any(r.state == "issued" for r in recs)
    head = _check(recs, scenario)
    assert all(c.pid is not None and c.host == "node1" for c in head.culprits)


@pytest.mark.parametrize("scenario", sorted(EXPECTED))
def test_fixture_records_name_the_culprit(scenario):
    _check(_read(sorted(glob.glob(os.path.join(FIXTURES, scenario, "collectives-*.jsonl"))), records_reader), scenario)


@pytest.mark.parametrize("scenario", ["skip_broadcast", "uneven_inputs", "shape_mismatch"])
def test_flight_recorder_dumps_name_the_same_culprit(scenario):
    recs = _read(sorted(glob.glob(os.path.join(FIXTURES, scenario, "fr_trace_rank_*"))), flight_recorder)
    assert {r.origin for r in recs} == {"flight-recorder"}
    kind, culprits, _ = EXPECTED[scenario]
    head = record_rules.findings(Report(job=Job(records=recs)))[0]
    assert (head.kind, [c.rank for c in head.culprits]) == (kind, culprits)


def test_flight_recorder_on_gloo_does_not_see_send_recv():
    recs = _read(sorted(glob.glob(os.path.join(FIXTURES, "recv_cycle", "fr_trace_rank_*"))), flight_recorder)
    assert [(r.rank, r.op, r.state) for r in recs] == [(0, "all_reduce", "completed"), (1, "all_reduce", "completed")]


@pytest.mark.parametrize("scenario", sorted(EXPECTED))
def test_whole_analysis_puts_the_record_verdict_first(scenario):
    from hangdoc.analysis import analyse
    from hangdoc.readers import read_paths

    job = read_paths([os.path.join(FIXTURES, scenario)])
    assert job.errors == [] and job.processes  # the stacks are read too
    report = analyse(job)
    kind, culprits, headline = EXPECTED[scenario]
    assert report.findings[0].kind == kind and headline in report.findings[0].summary
    assert [c.rank for c in report.findings[0].culprits] == culprits


def test_real_nccl_records_show_the_gpu_side_hang():
    """Captured on 2 GPUs (see tests/fixtures/records/README.md): the host never blocks in NCCL."""
    recs = _read(sorted(glob.glob(os.path.join(FIXTURES, "gpu_nccl_skip", "collectives-*.jsonl"))), records_reader)
    pending = [(r.rank, r.op, r.stream) for r in recs if r.state == "issued"]
    assert pending == [(0, "all_reduce", "default"), (0, "broadcast", "stream35")]
    head = record_rules.findings(Report(job=Job(records=recs)))[0]
    assert head.kind == "collective-mismatch" and [c.rank for c in head.culprits] == [1]
    assert head.summary == "rank 1 skipped all_reduce #3 (gpu_skip.py:50); everything after it is fallout"
    assert any("rank 0 is blocked in all_reduce([1024] float32) #3" in e for e in head.detail)
