"""The bug scenarios (examples/bugs) and the matrix that runs them (benchmarks/bug_matrix.py).

Cheap checks of every scenario (TRUTH, docstring, importable), the judge's rules, and one real
run of the matrix on one scenario for one hangdoc column.
"""

import importlib.util
import json
import os
import sys
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bug_matrix  # noqa: E402
import matrix_judge  # noqa: E402
from hangdoc.model import FINDING_KINDS  # noqa: E402

SCENARIOS = bug_matrix.scenarios()
#: kinds a TRUTH may use: the documented ones, plus the two the lead adds to docs/findings
KINDS = set(FINDING_KINDS) | {"rank-failed", "slow-not-hung"}


def test_enough_scenarios():
    assert len(SCENARIOS) >= 20


@pytest.mark.parametrize("s", SCENARIOS, ids=[s["name"] for s in SCENARIOS])
def test_scenario_has_truth_and_docstring(s):
    truth = s["truth"]
    assert truth is not None, f"{s['name']}: no TRUTH"
    assert truth["kind"] in KINDS
    assert 2 <= truth["world"] <= 8  # one host: up to 8 GPUs on NCCL
    assert all(isinstance(r, int) and 0 <= r < truth["world"] for r in truth["culprits"])
    assert truth["culprits"] == sorted(set(truth["culprits"]))
    assert truth["culprits"] or truth["kind"] == "slow-not-hung"
    assert truth.get("why")
    assert s["doc"] and "torchrun" in s["doc"], f"{s['name']}: the docstring states the bug and how to run it"
    assert isinstance(s["runs"], list) and all(isinstance(e, dict) for e in s["runs"])


@pytest.mark.parametrize("s", SCENARIOS, ids=[s["name"] for s in SCENARIOS])
def test_scenario_imports(s):
    spec = importlib.util.spec_from_file_location(f"bug_{s['name']}", s["path"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # __name__ is not __main__: nothing runs
    assert module.TRUTH == s["truth"]
    assert callable(module.main)


def test_judge_rules():
    t = {"kind": "collective-mismatch", "culprits": [2]}
    assert matrix_judge.judge(t, {"kind": "collective-mismatch", "culprits": [2]}) == "RIGHT"
    assert matrix_judge.judge(t, {"kind": "missing-rank", "culprits": [2]}) == "PARTIAL"
    assert matrix_judge.judge(t, {"kind": "collective-mismatch", "culprits": []}) == "PARTIAL"
    assert matrix_judge.judge(t, {"kind": "collective-mismatch", "culprits": [0]}) == "WRONG"
    assert matrix_judge.judge(t, {"kind": "no-hang", "culprits": []}) == "WRONG"
    assert matrix_judge.judge(t, None) == "NONE"
    assert matrix_judge.judge(t, {"crash": "KeyError"}) == "CRASH"
    slow = {"kind": "slow-not-hung", "culprits": []}
    assert matrix_judge.judge(slow, None) == "RIGHT"  # a job that only was slow: silence is right
    assert matrix_judge.judge(slow, {"kind": "no-hang", "culprits": []}) == "RIGHT"
    assert matrix_judge.judge(slow, {"kind": "collective-mismatch", "culprits": [0]}) == "WRONG"
    unattributed = {"kind": matrix_judge.UNATTRIBUTED, "culprits": []}  # "timed out", nobody named
    assert matrix_judge.judge(slow, unattributed) == "WRONG"
    assert matrix_judge.judge(t, unattributed) == "NONE"


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(KINDS)), st.sets(st.integers(0, 7)), st.sampled_from(sorted(KINDS)),
       st.sets(st.integers(0, 7)))
def test_judge_invariants(true_kind, guilty, kind, blamed):
    cell = matrix_judge.judge({"kind": true_kind, "culprits": sorted(guilty)}, {"kind": kind, "culprits": sorted(blamed)})
    assert cell in matrix_judge.CELLS
    assert (cell == "RIGHT") == ((kind == true_kind or kind in matrix_judge.SAME_KIND.get(true_kind, ()))
                                 and blamed == guilty)
    if blamed - guilty:
        assert cell == "WRONG"


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="Rank 0123456789,:{}()=[]\nmissing ranks Culprit rank is running collective: "
                        "CollectiveFingerPrint(OpType=BROADCAST but failed to pass monitoredBarrier", max_size=400))
def test_peer_parsers_total(text):
    for v in (matrix_judge.from_detail_log(text), matrix_judge.from_fr_trace(text, 0)):
        assert v is None or v.get("kind") in ("collective-mismatch", matrix_judge.UNATTRIBUTED) and all(isinstance(r, int) for r in v["culprits"])


def test_detail_fingerprints_majority():
    line = ("[rank{me}]: RuntimeError: Detected mismatch between collectives on ranks. Rank {me} is running collective: "
            "CollectiveFingerPrint(SequenceNumber=7, OpType={mine}, TensorShape=[8], TensorDtypes=Float, "
            "TensorDeviceTypes=TensorOptions(dtype=float (default), device=cpu)), but Rank {other} is running "
            "collective: CollectiveFingerPrint(SequenceNumber=7, OpType={theirs}, TensorShape=[8], TensorDtypes=Float, "
            "TensorDeviceTypes=TensorOptions(dtype=float (default)")
    log = "\n".join(line.format(me=r, other=2, mine="BROADCAST", theirs="ALLREDUCE") for r in (0, 1, 3))
    log += "\n" + line.format(me=2, other=0, mine="ALLREDUCE", theirs="BROADCAST")
    assert matrix_judge.from_detail_log(log)["culprits"] == [2]
    # rank 0's own line may show another rank in an internal GATHER (seen in barrier_rank0's DETAIL log):
    # each rank's own line wins
    own = ("[rank0]: RuntimeError: Detected mismatch between collectives on ranks. Rank 0 is running collective: "
           "CollectiveFingerPrint(SequenceNumber=3OpType=BARRIER), but Rank 1 is running collective: "
           "CollectiveFingerPrint(SequenceNumber=0OpType=GATHER).")
    log = own + "\n" + "\n".join(line.format(me=r, other=0, mine="ALLREDUCE", theirs="BARRIER") for r in (1, 2, 3))
    assert matrix_judge.from_detail_log(log)["culprits"] == [0]
    assert matrix_judge.from_detail_log("[Rank 0]: Ranks 1, 3 failed to pass monitoredBarrier in 8000 ms")["culprits"] == [1, 3]


def _procs_with(tag):
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if tag.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


def test_matrix_runs_one_scenario(tmp_path, monkeypatch):
    """One real run: skip_broadcast under ``-m hangdoc --detect`` (the quickest hangdoc column: the
    detector fires about a second after the skip); the cell is judged and the job is gone afterwards."""
    tag = f"BUG_MATRIX_TEST_{uuid.uuid4().hex}"
    monkeypatch.setenv(tag, "1")  # inherited by every process of the job
    assert bug_matrix.main(["--only", "skip_broadcast", "--columns", "detect", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "matrix.json") as f:
        result = json.load(f)["scenarios"]["skip_broadcast"]
    assert result["runs"]["detect"]["state"] == "hung"
    assert result["cells"]["detect"] in matrix_judge.CELLS
    verdict = result["verdicts"]["detect"]  # read from the detector's divergence.json
    assert verdict["kind"] == "collective-mismatch" and verdict["culprits"], verdict
    assert (tmp_path / "skip_broadcast" / "detect-out" / "divergence.json").exists()
    assert "| skip_broadcast |" in (tmp_path / "table.md").read_text()
    assert [p for p in _procs_with(tag) if p != os.getpid()] == []  # the whole job was stopped
