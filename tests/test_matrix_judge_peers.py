"""The bug matrix's parsers for two peers, on their real output (tests/fixtures/peers): what
nvidia-resiliency-ext's ft_launcher and torch's debug server say about a hung job, as a verdict."""

import ast
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FIX = os.path.join(HERE, "fixtures", "peers")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import matrix_judge  # noqa: E402


def truth(name):
    with open(os.path.join(ROOT, "examples", "bugs", f"{name}.py"), encoding="utf-8") as f:
        for node in ast.parse(f.read()).body:
            if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "TRUTH":
                return ast.literal_eval(node.value)
    raise AssertionError(name)


def nvrx_log(name):
    with open(os.path.join(FIX, "nvrx", f"{name}.log"), "rb") as f:
        return f.read().decode("utf-8", "replace")


def pages(name, drop=()):
    d = os.path.join(FIX, "dbgsrv", name)
    with open(os.path.join(d, "pages.json"), encoding="utf-8") as f:
        index = json.load(f)
    got = {}
    for path, meta in index.items():
        file = os.path.join(d, meta["file"])
        if os.path.exists(file) and path not in drop:
            with open(file, encoding="utf-8") as f:
                got[path] = dict(meta, text=f.read())
    return got


# --- nvidia-resiliency-ext -------------------------------------------------------------------------

def test_nvrx_every_rank_timed_out_names_nobody():
    # skip_broadcast: all four rank monitors print "Did not get subsequent heartbeat": the job hung, no culprit
    v = matrix_judge.from_nvrx_log(nvrx_log("skip_broadcast"))
    assert v["kind"] == matrix_judge.UNATTRIBUTED and v["culprits"] == [] and v["timed_out"] == [0, 1, 2, 3]
    assert "Did not get subsequent heartbeat. Waited 8.00 seconds." in v["summary"]
    assert matrix_judge.judge(truth("skip_broadcast"), v) == "NONE"


def test_nvrx_stopped_rank_is_not_told_apart():
    v = matrix_judge.from_nvrx_log(nvrx_log("stopped_rank"))
    assert v["timed_out"] == [0, 1, 2, 3] and v["culprits"] == []
    assert matrix_judge.judge(truth("stopped_rank"), v) == "NONE"


def test_nvrx_some_ranks_timed_out_are_named():
    # the same real log without rank 3's monitor lines: ranks 0-2 named, an innocent among them
    text = "\n".join(ln for ln in nvrx_log("skip_broadcast").splitlines() if "@vm:3]" not in ln)
    v = matrix_judge.from_nvrx_log(text)
    assert v["kind"] == matrix_judge.NO_HEARTBEAT and v["culprits"] == [0, 1, 2]
    assert matrix_judge.judge(truth("skip_broadcast"), v) == "WRONG"


def test_nvrx_killed_rank_is_the_launchers_first_failure():
    v = matrix_judge.from_nvrx_log(nvrx_log("dead_rank"))
    assert v == {"kind": "rank-failed", "culprits": [2], "summary": v["summary"]}
    assert "failed (exitcode: -9) local_rank: 2" in v["summary"]
    assert matrix_judge.judge(truth("dead_rank"), v) == "RIGHT"


def test_nvrx_launcher_that_never_started_workers_is_a_crash_and_silence_is_none():
    head = nvrx_log("skip_broadcast").split("starting workers for entrypoint")[0]
    assert "crash" in matrix_judge.from_nvrx_log(head)
    assert matrix_judge.from_nvrx_log("") is None


# --- torch's debug server --------------------------------------------------------------------------

def test_debug_server_names_the_rank_whose_worker_did_not_answer():
    v = matrix_judge.from_debug_server(pages("stopped_rank"))
    assert v["kind"] == "unresponsive-process" and v["culprits"] == [1]
    assert "Failed to fetch: status=408" in v["summary"]
    assert matrix_judge.judge(truth("stopped_rank"), v) == "RIGHT"


def test_debug_server_analysis_page_fails_on_gloo():
    v = matrix_judge.from_debug_server(pages("skip_broadcast"))
    assert v == {"crash": "/fr_trace: HTTP 500: Exception: KeyError(('0', 0))."}
    assert matrix_judge.judge(truth("skip_broadcast"), v) == "CRASH"


def test_debug_server_raw_pages_alone_are_no_verdict():
    # the stacks of every rank (all answered) with no analysis page: nothing names a culprit
    v = matrix_judge.from_debug_server(pages("skip_broadcast", drop=("/fr_trace",)))
    assert v is None and matrix_judge.judge(truth("skip_broadcast"), v) == "NONE"


def test_debug_server_404_is_a_missing_handler_not_a_missing_rank():
    health = pages("skip_broadcast")["/torchcomms_health_check"]
    assert health["text"].count("Failed to fetch: status=404") == 4
    assert matrix_judge.from_debug_server({"/stacks": health}) is None


# --- nvidia-resiliency-ext's in-process restart ----------------------------------------------------

def nvrxip_log(name):
    with open(os.path.join(FIX, "nvrxip", f"{name}.log"), "rb") as f:
        return f.read().decode("utf-8", "replace")


def test_inprocess_names_the_ranks_of_its_first_interruption():
    # skip_broadcast: "RankShouldRestart: Interruption.SOFT_TIMEOUT on ranks={1}": an innocent rank
    v = matrix_judge.from_nvrx_inprocess_log(nvrxip_log("skip_broadcast"))
    assert (v["kind"], v["culprits"], v["interruption"]) == (matrix_judge.NO_HEARTBEAT, [1], "SOFT_TIMEOUT")
    assert "Interruption.SOFT_TIMEOUT on ranks={1}" in v["summary"]
    assert matrix_judge.judge(truth("skip_broadcast"), v) == "WRONG"


def test_inprocess_several_ranks_in_one_record():
    v = matrix_judge.from_nvrx_inprocess_log(nvrxip_log("stopped_rank"))
    assert v["culprits"] == [1, 2] and matrix_judge.judge(truth("stopped_rank"), v) == "WRONG"


def test_inprocess_log_without_an_interruption_is_no_verdict():
    head = nvrxip_log("skip_broadcast").split("Interruption.")[0]
    assert matrix_judge.from_nvrx_inprocess_log(head) is None


def test_the_judge_reads_every_kind_the_detector_writes():
    from hangdoc.runtime.detect_digest import KINDS

    assert set(matrix_judge.DETECT_KINDS) == set(KINDS)
    div = {"deviants": [1], "kind": "dataloader-stall", "summary": "rank 1 waits for its DataLoader worker"}
    assert matrix_judge.from_divergence(div)["kind"] == "dataloader-stall"
    assert matrix_judge.from_divergence(dict(div, kind="nonsense"))["kind"] == "collective-mismatch"
