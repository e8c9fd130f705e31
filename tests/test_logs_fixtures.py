"""Real console logs from public threads (tests/fixtures/logs/*/, each file's source in the README
beside it) and the NCCL logs captured here (tests/fixtures/gpu): every one is read, and the verdict
from the log alone is the one `cases.json` gives (a senior engineer's reading of that text alone).

A verdict is right when its kind is the expected one and its culprits are the expected culprits
(or, where the text cannot decide, exactly the expected candidates); an expected ``null`` kind is
met by any verdict that blames no one (or exactly the candidates). The cases hangdoc does not get
right yet are listed in KNOWN with the reason: they are strict xfails, so a fix shows up.
"""

import json
import os

import pytest

from hangdoc.analysis.diagnose import diagnose
from hangdoc.analysis.grouping import build_report
from hangdoc.readers import read_paths

HERE = os.path.dirname(os.path.abspath(__file__))
LOGS = os.path.join(HERE, "fixtures", "logs")
GPU = os.path.join(HERE, "fixtures", "gpu")

#: file -> why hangdoc's verdict differs from the expected one
KNOWN = {
    "NVIDIA-nccl-147-teng-li.log": "NCCL INFO collective traces (opCount per device) are not read",
    "NVIDIA-nccl-1911.log": "NCCL's RAS status report is not read",
    "pytorch-pytorch-97066.log": "ranks printing 'completed' are program output, not evidence hangdoc reads",
    "SamsungLabs-MLI-18.log": "a lone exit code with no table and no torn-down peers is not blamed",
    "ZhehengJiangLancaster-AMVUR-2.log": "a failure table mangled by the paste (fields run together) is not read",
    "pytorch-tutorials-debug_hangs-stacks.log": "an annotated, hand-shortened stacks listing (arrows, no frames)",
    "vllm-project-vllm-6042-haichuan1221.log": "[PG 2 Rank 0] is a rank within group 2: its global rank is unknown",
    "modelscope-ms-swift-5943-3.log": "two ranks' own errors, one cut off: hangdoc names the first only",
}


def _cases():
    out = []
    for d in sorted(os.listdir(LOGS)):
        path = os.path.join(LOGS, d, "cases.json")
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as f:
            for c in json.load(f):
                marks = [pytest.mark.xfail(strict=True, reason=KNOWN[c["file"]])] if c["file"] in KNOWN else []
                out.append(pytest.param(os.path.join(LOGS, d, c["file"]), c["expected"], id=f"{d}/{c['file']}",
                                        marks=marks))
    return out


CASES = _cases()


def verdict(paths):
    job = read_paths(paths)
    report = build_report(job, "function+line")
    report.findings = diagnose(report)
    return job, report.findings[0]


def right(finding, expected) -> bool:
    got = sorted(c.rank for c in finding.culprits if c.rank is not None)
    want = sorted(expected.get("culprits") or expected.get("candidates") or [])
    if expected.get("kind") is None:
        return not got or got == sorted(expected.get("candidates") or [])
    return finding.kind == expected["kind"] and got == want


def test_the_corpus_is_large_and_varied():
    projects = set()
    for d in os.listdir(LOGS):
        path = os.path.join(LOGS, d, "cases.json")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                projects |= {c["project"] for c in json.load(f)}
    assert len(CASES) >= 30 and len(projects) >= 10


@pytest.mark.parametrize("path,expected", CASES)
def test_a_real_log_gives_the_expected_verdict(path, expected):
    job, finding = verdict([path])
    assert not [e for e in job.errors if "could not" in e.message], job.errors
    assert right(finding, expected), (finding.kind, [c.rank for c in finding.culprits], finding.summary)


def test_every_fixture_is_in_its_readme():
    for d in os.listdir(LOGS):
        base = os.path.join(LOGS, d)
        if not os.path.isdir(base):
            continue
        with open(os.path.join(base, "README.md"), encoding="utf-8") as f:
            readme = f.read()
        for name in os.listdir(base):
            if name.endswith(".log"):
                assert name in readme, f"{d}/{name} has no source in its README"


@pytest.mark.parametrize("scenario,kind,culprits", [
    # rank 1 skipped a broadcast; NCCL completed rank 0's, so the two watchdogs fire one SeqNum
    # apart on the same all_reduce: two ranks, no majority, both named
    ("nccl_skip_broadcast", "collective-mismatch", [0, 1]),
    # rank 1 waits for its DataLoader: its watchdog's dump line says it enqueued up to 3 while
    # rank 0 times out in 4
    ("nccl_dataloader_deadlock", "collective-mismatch", [1]),
    # both ranks receive first: both time out in RECV, nobody sends
    ("nccl_pipeline_cycle", "p2p-stall", []),
])
def test_the_captured_nccl_logs_alone(scenario, kind, culprits):
    _, finding = verdict([os.path.join(GPU, scenario, "log.txt")])
    assert finding.kind == kind and sorted(c.rank for c in finding.culprits) == culprits, finding.summary


def test_a_log_with_no_watchdog_line_is_said_to_hold_nothing():
    # the stream-misplacement capture: NCCL's watchdog never fired, the log holds no event
    job = read_paths([os.path.join(GPU, "nccl_stream_misplacement", "log.txt")])
    # (its torchrun command line states the world size: context, no evidence)
    assert [e.kind for e in job.events] == ["world-size"]
    assert [e.message for e in job.errors] == ["no stack dump or log event found"]
