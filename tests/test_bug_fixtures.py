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


def _pyspy(name, cwd=ROOT):
    d = os.path.join(FIX, name)
    r = subprocess.run([sys.executable, "-m", "hangdoc", "aggregate", "--format", "json", "--rank-map",
                        os.path.join(d, "pyspy-rank-map.txt"), os.path.join(d, "pyspy")],
                       capture_output=True, text=True, timeout=120, cwd=cwd, env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["findings"][0]


# plain py-spy dumps (no records): what the stacks allow
@pytest.mark.parametrize("name", [
    "b4_lib_sampler_rank_seeded_subsample",  # ranks idle in DDP's backward, one in a barrier
    "b4_lib_ddp_nan_loss_skip_backward",     # ranks idle in DDP's backward, one in DDP's buffer broadcast
    "b3_sparse_grad_comm_thread",            # one rank's comm thread in all_reduce, the others' in all_gather
    "b4_proc_tokenizer_nbsp_spin",           # one rank computing, the others wait for it
    "prefetch_thread_died_queue",            # Queue.get with no other Python thread left to put
    "b4_proc_pool_unpicklable_exception",    # Pool.map with the pool's result-handler thread gone
])
def test_plain_py_spy_dumps_name_the_culprit(name):
    head = _pyspy(name)
    assert matrix_judge.judge(truth(name), matrix_judge.from_report({"findings": [head]})) == "RIGHT", head["summary"]


def test_every_rank_in_collectives_on_two_threads_is_an_ordering_race_not_a_wait_below_python():
    head = _pyspy("prefetch_allgather_thread_race")
    assert head["kind"] == "collective-mismatch" and head["culprits"] == [], head
    assert "on two threads at once" in head["summary"] and "prefetch_0: all_gather" in head["summary"]


def test_every_rank_in_one_new_group_call_is_a_creation_mismatch():
    head = _pyspy("subgroup_only_some")
    assert head["kind"] == "collective-mismatch" and head["culprits"] == [], head
    assert head["summary"].startswith("every rank waits in new_group at save_checkpoint (subgroup_only_some.py:38)")


def test_a_requests_wait_in_a_function_that_posts_isend_irecv_is_a_p2p_wait():
    # py-spy names the script relative to its directory: read from there (as on the training host),
    # the line `req.wait()` of a function that called batch_isend_irecv is a p2p wait
    head = _pyspy("ring_attention_wrong_neighbour", cwd=os.path.join(ROOT, "examples", "bugs"))
    assert head["kind"] == "p2p-stall" and "batch_isend_irecv at rotate (ring_attention_wrong_neighbour.py:47)" in head["evidence"][0]


@pytest.mark.parametrize("name", ["slow_checkpoint", "periodic_eval_slow", "rank0_object_store_upload_slow"])
def test_stacks_of_a_stall_the_records_show_the_job_went_past_are_no_verdict(name):
    d = os.path.join(FIX, name, "output")
    r = subprocess.run([sys.executable, "-m", "hangdoc", "aggregate", "--format", "json", d],
                       capture_output=True, text=True, timeout=120, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stderr
    findings = json.loads(r.stdout)["findings"]
    assert [f["kind"] for f in findings] == ["no-hang"], findings
    assert findings[0]["summary"].startswith("the job went on after its stacks were taken")
    # what the stacks said during the stall is kept, as detail
    assert any(line.startswith("the stacks, taken during the stall, said: ") for line in findings[0]["detail"])
    assert matrix_judge.judge(truth(name), matrix_judge.from_report({"findings": findings})) == "RIGHT"


def _fr(name):
    d = os.path.join(FIX, name, "fr")
    r = subprocess.run([sys.executable, "-m", "hangdoc", "aggregate", "--format", "json", d],
                       capture_output=True, text=True, timeout=120, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["findings"][0]


def test_flight_recorder_dumps_alone_name_the_only_rank_behind_with_nothing_in_flight():
    head = _fr("lock_twice")
    assert (head["kind"], [c["rank"] for c in head["culprits"]]) == ("collective-mismatch", [2]), head["summary"]
    assert head["summary"].endswith("for rank 2, which is behind and never issued it")


@pytest.mark.parametrize("name", ["tp_pp_skip", "async_ckpt_side_barrier"])
def test_ranks_behind_that_may_wait_elsewhere_are_not_named(name):
    # behind in two groups at once (tp_pp_skip), or in a call of another group (async_ckpt_side_barrier)
    head = _fr(name)
    assert head["culprits"] == [], head["summary"]
