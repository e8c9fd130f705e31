"""hangdoc's verdict on real captures of the bug scenarios (tests/fixtures/bugs, captured by
benchmarks/bug_matrix.py): `hangdoc aggregate` of the output directory, and of the output directory
with the job's console log, judged against each scenario's TRUTH by the matrix's own judge."""

import ast
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FIX = os.path.join(HERE, "fixtures", "bugs")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import matrix_judge  # noqa: E402


def truth(name):
    with open(os.path.join(ROOT, "examples", "bugs", f"{name}.py"), encoding="utf-8") as f:
        for node in ast.parse(f.read()).body:
            if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "TRUTH":
                return ast.literal_eval(node.value)
    raise AssertionError(name)


def judged(name, with_log, fix=FIX):
    d = os.path.join(fix, name)
    args = [os.path.join(d, "output")] + ([os.path.join(d, "hangdoc.log")] if with_log else [])
    r = subprocess.run([sys.executable, "-m", "hangdoc", "aggregate", "--format", "json"] + args,
                       capture_output=True, text=True, timeout=120, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stderr
    return matrix_judge.judge(truth(name), matrix_judge.from_report(json.loads(r.stdout)))


# the output directory alone is enough for these (records and watchdog stacks)
@pytest.mark.parametrize("name", ["no_majority", "two_culprits", "group_order", "opposite_groups", "skip_broadcast", "two_jobs", "wrong_peer", "tp_pp_skip", "partial_group", "exception_thread", "stopped_rank",
                                  "dataloader_deadlock", "extra_collective", "exception_in_collective_loop",
                                  "async_ckpt_side_barrier", "ragged_eval_allgather", "ring_attention_wrong_neighbour",
                                  "b3_resume_step_not_broadcast", "moe_capacity_alltoall_splits",
                                  "b4_lib_device_mesh_resume_fallback"])
def test_the_output_directory_names_the_culprits(name):
    assert judged(name, with_log=False) == "RIGHT"


# a rank that died or raised: its failure is in the console log, not in the output directory
@pytest.mark.parametrize("name", ["dead_rank", "exception_thread"])
def test_with_the_console_log_the_failed_rank_is_the_headline(name):
    assert judged(name, with_log=True) == "RIGHT"


# NCCL (4 GPUs, tests/fixtures/bugs_nccl/README.md): every call is issued on the host, and two groups
# entered in opposite orders deadlock on each rank's CUDA stream
@pytest.mark.parametrize("name", ["group_order", "opposite_groups", "tp_pp_skip", "opposite_groups_pair", "pp_skip_pair"])
def test_on_nccl_calls_queued_behind_each_other_on_a_stream_name_the_culprits(name):
    assert judged(name, with_log=False, fix=os.path.join(HERE, "fixtures", "bugs_nccl")) == "RIGHT"


# 4 x H200 at 40b1b49 (tests/fixtures/bugs_nccl_x4/README.md): the records' states in stream order
@pytest.mark.parametrize("name", ["pp_skip_pair", "pipeline3_wrong_peer"])
def test_on_nccl_4_gpus_the_pipeline_bugs_are_named_right(name):
    # pipeline3_wrong_peer: sends complete into the receiver's buffer, every host issues on
    assert judged(name, with_log=False, fix=os.path.join(HERE, "fixtures", "bugs_nccl_x4")) == "RIGHT"


@pytest.mark.parametrize("fix,name,skipped", [
    ("bugs_nccl_x4", "pp_skip_pair", "all_reduce (pp_skip_pair.py:44)"),
    ("bugs_nccl", "pp_skip_pair", "all_reduce at pp_skip_pair.py:44"),
    ("bugs_nccl", "tp_pp_skip", "all_reduce (tp_pp_skip.py:48)"),
    ("bugs", "tp_pp_skip", "all_reduce (tp_pp_skip.py:48)"),
])
def test_the_headline_names_the_skipped_call(fix, name, skipped):
    """The culprit alone is not enough: the headline names the call its loop skipped, where the
    user looks. On NCCL the host issued several more steps after the skip."""
    d = os.path.join(HERE, "fixtures", fix, name, "output")
    r = subprocess.run([sys.executable, "-m", "hangdoc", "aggregate", "--format", "json", d],
                       capture_output=True, text=True, timeout=120, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stderr
    head = json.loads(r.stdout)["findings"][0]["summary"]
    assert skipped in head, head


def test_a_rank_that_failed_first_heads_the_report_over_others_going_on_without_it():
    """What the in-job report had (ranks 0-2 of 4): rank 2 raised in scatter's argument check, rank
    1 then went on into the next all_reduce. The records read that as rank 1's extra call."""
    d = os.path.join(FIX, "scatter_list_node_reader", "at-the-stall")
    r = subprocess.run([sys.executable, "-m", "hangdoc", "aggregate", "--format", "json", d],
                       capture_output=True, text=True, timeout=120, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stderr
    head = json.loads(r.stdout)["findings"][0]
    assert head["kind"] == "rank-failed" and [c["rank"] for c in head["culprits"]] == [2], head["summary"]
    # rank 2's scatter failed (raised): it stopped there, it did not go elsewhere, so rank 1's next
    # all_reduce is no "extra call" of the records; what the stacks show of rank 1 stays below
    assert not any("extra" in f["summary"] for f in json.loads(r.stdout)["findings"])
