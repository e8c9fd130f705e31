"""Verdicts on NCCL hangs captured on 2 × H200 (tests/fixtures/gpu/**): CPU CI keeps checking them.

Each scenario is read three ways, as a user would: the stack dumps alone (py-spy --native of every
process), the Flight Recorder dumps (or hangdoc's records) alone, and everything together. What the
stacks alone get wrong or cannot tell is asserted too, so a change that hides it shows up here.
"""

import json
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
    assert "rank 1 skipped broadcast #7" in summary


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
    assert "all_reduce #3" in summary and "for rank 1" in summary


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


# -- run 2: through `python -m hangdoc --record --hang-timeout 8`: + records, watchdog stacks ------

RUN2 = os.path.join(RUN1, "hangdoc-run")


def run2(scenario, *parts):
    return os.path.join(RUN2, scenario, *parts)


def v2(scenario, *parts):
    paths = [run2(scenario, p) for p in parts] if parts else [run2(scenario)]
    return verdict(*paths, rank_map=run2(scenario, "rank-map.txt"))


def all_findings(scenario, *parts):
    job = read_paths([run2(scenario, p) for p in parts], read_rank_map(run2(scenario, "rank-map.txt")))
    return analyse(job).findings


def test_run2_skip_broadcast():
    # py-spy --native: host sync, nobody named; the watchdog's own stacks (Python only) even read
    # as busy ("no-hang"): the .item() is a C call, the CUDA driver spins.
    kind, ranks, _, _ = v2("nccl_skip_broadcast", "trace-gpu1.out")
    assert kind == "collective-wait" and not ranks
    kind, ranks, _, _ = v2("nccl_skip_broadcast", "watchdog")
    assert kind in ("no-hang", "collective-wait") and not ranks
    for parts in (("records",), ("fr",), ()):
        kind, ranks, _, summary = v2("nccl_skip_broadcast", *parts)
        assert (kind, ranks) == ("collective-mismatch", {1}), parts
        assert "rank 1 skipped broadcast" in summary


def test_run2_recorder_completion_matches_flight_recorder():
    # Recorder completion on NCCL without a sync of its own, checked against NCCL's watchdog (the
    # Flight Recorder states of the same run), op by op, in every scenario that dumped one.
    # Both count from 0 (the reader shifts Flight Recorder's collective_seq_id, which counts from 1).
    from hangdoc.analysis.wait_for import pending

    for scenario in ("nccl_skip_broadcast", "nccl_pipeline_cycle", "nccl_dataloader_deadlock"):
        ours = read_paths([run2(scenario, "records")]).records
        theirs = read_paths([run2(scenario, "fr")]).records
        a = sorted((x.rank, x.seq, x.op, x.state) for x in ours if x.group == "default_pg")
        b = sorted((x.rank, x.seq, x.op, x.state) for x in theirs)
        assert a == b, scenario
    job = read_paths([run2("nccl_skip_broadcast", "records")])
    first = {r: lst[0] for r, lst in pending(job.records).items()}
    # rank 0's broadcast #7 completed (as root it only sends), paired with rank 1's all_reduce #7,
    # which never completes; rank 0 then waits in all_reduce #8.
    assert (first[0].op, first[0].seq) == ("all_reduce", 8)
    assert (first[1].op, first[1].seq) == ("all_reduce", 7)


def test_run2_dataloader_deadlock():
    for parts in (("trace-gpu1.out",), ("watchdog",)):
        kind, ranks, pids, _ = v2("nccl_dataloader_deadlock", *parts)
        assert kind == "dataloader-stall" and ranks == {1} and 886 in pids, parts
    for parts in (("records",), ("fr",)):
        kind, ranks, _, summary = v2("nccl_dataloader_deadlock", *parts)
        assert (kind, ranks) == ("collective-wait", set()) and "for rank 1" in summary, parts
    # Together: the records show rank 1 behind and its stack says why: the DataLoader stall is the
    # headline, on the same process, with the records' agreement in its evidence.
    found = all_findings("nccl_dataloader_deadlock", "trace-gpu1.out", "records", "fr")
    assert found[0].kind == "dataloader-stall"
    assert {c.rank for c in found[0].culprits if c.rank is not None} == {1}
    assert 886 in {c.pid for c in found[0].culprits}
    assert any(e.startswith("the collective records agree") for e in found[0].evidence)


def test_run2_pipeline_cycle():
    kind, ranks, _, _ = v2("nccl_pipeline_cycle", "trace-gpu1.out")
    assert kind == "collective-wait" and not ranks
    for parts in (("records",), ("fr",), ()):
        kind, ranks, _, summary = v2("nccl_pipeline_cycle", *parts)
        assert (kind, ranks) == ("p2p-cycle", {0, 1}), parts
        assert "recv" in summary or "cycle" in summary


def test_run2_stream_misplacement():
    for parts in (("trace-gpu1.out",), ("watchdog",)):
        kind, ranks, _, summary = v2("nccl_stream_misplacement", *parts)
        assert kind == "collective-wait" and not ranks and "synchronize" in summary, parts
    # No Flight Recorder dump (NCCL's watchdog never fired) and FR records no streams anyway:
    # only hangdoc's records see rank 1's backward all_reduce on the forward stream.
    assert not os.path.isdir(run2("nccl_stream_misplacement", "fr"))
    for parts in (("records",), ()):
        kind, ranks, _, summary = v2("nccl_stream_misplacement", *parts)
        assert (kind, ranks) == ("stream-misplacement", {1}), parts
        assert "stream99" in summary and "stream131" in summary


def test_run2_stream_misplacement_completion_state():
    # Per op and per stream: the three healthy steps completed, step 3's four calls are pending.
    job = read_paths([run2("nccl_stream_misplacement", "records")])
    by_state = {}
    for x in job.records:
        by_state.setdefault(x.state, set()).add(x.seq)
    assert by_state["issued"] == {4} and max(by_state["completed"]) == 3


# -- runs 3 and 5: the recorder's CUDA queue alone (no Flight Recorder refinement) ------------------
# run 3: an event after every call; run 5 (session 3's default): events at most once per ms per
# stream, one before a call after a pause, and an idle stream completing its queue with no event.
RUN3 = os.path.join(RUN1, "hangdoc-run3")
RUN5 = os.path.join(RUN1, "hangdoc-run5-gap")
RUN6 = os.path.join(RUN1, "hangdoc-run6-watermark")
EXACT_RUNS = pytest.mark.parametrize("run", [RUN3, RUN5, RUN6], ids=["run3-event-per-call", "run5-gap", "run6-watermark"])


def blocked_in(scenario, run=RUN3):
    """Per rank, the 'blocked in' evidence of the headline: which call the records say is stuck."""
    f = analyse(read_paths([os.path.join(run, scenario)])).findings[0]
    return f, sorted(e for e in f.detail if " is blocked in " in e)  # every rank's pending call: -v detail


@pytest.mark.parametrize("scenario, kind, culprits, stuck", [
    # the call each rank really hangs in (NCCL's own watchdog agreed in log.txt), not an earlier one
    ("nccl_skip_broadcast", "collective-mismatch", {1},
     ["rank 0 is blocked in all_reduce([1024] float32) #8 ", "rank 1 is blocked in all_reduce([1024] float32) #7 "]),
    ("nccl_pipeline_cycle", "p2p-cycle", {0, 1},
     ["rank 0 is blocked in recv([4096] float32, peer=1) #6 ", "rank 1 is blocked in recv([4096] float32, peer=0) #6 "]),
    ("nccl_stream_misplacement", "stream-misplacement", {1},
     ["rank 0 is blocked in all_reduce([65536] float32) #4 of group 2", "rank 1 is blocked in all_reduce([65536] float32) #4 of group 1"]),
])
@EXACT_RUNS
def test_exact_verdicts_and_exact_completion(run, scenario, kind, culprits, stuck):
    f, evidence = blocked_in(scenario, run)
    assert f.kind == kind and {c.rank for c in f.culprits} == culprits
    assert len(evidence) == 2 and all(e.startswith(s) for e, s in zip(evidence, stuck)), evidence


@EXACT_RUNS
def test_exact_pipeline_records_complete_up_to_the_cycle(run):
    # Calls 0-5 ran (NCCL: "last completed work: 6" counts from 1); 6 and 7 never did.
    job = read_paths([os.path.join(run, "nccl_pipeline_cycle", "records")])
    for rank in (0, 1):
        states = [r.state for r in sorted((r for r in job.records if r.rank == rank), key=lambda r: r.seq)]
        assert states == ["completed"] * 6 + ["issued"] * 2, (rank, states)
    with open(os.path.join(run, "nccl_pipeline_cycle", "log.txt")) as f:
        assert "last enqueued work: 8, last completed work: 6" in f.read()


@EXACT_RUNS
def test_exact_dataloader_records_agree_with_the_stacks(run):
    # run 5: both ranks dumped (run 4's rank 0 never did: its sweep blocked in cuEventRecord)
    assert len(os.listdir(os.path.join(run, "nccl_dataloader_deadlock", "records"))) == 2
    f, _ = blocked_in("nccl_dataloader_deadlock", run)
    assert f.kind == "dataloader-stall" and {c.rank for c in f.culprits} == {1}
    assert any("the collective records agree: rank 0 waits in all_reduce #3" in e for e in f.evidence)


# -- sampled CUDA events (one per 32 calls) + Flight Recorder: FR's states refine the records ------
SAMPLED = os.path.join(RUN1, "hangdoc-run-sampled")


def test_sampled_records_alone_find_the_pipeline_cycle_by_the_order_of_calls():
    # every p2p call reads issued, so there is no first pending recv per rank to follow (the verdict
    # was "no-hang"); the order each rank queued them in is a cycle (hangdoc.analysis.stream_order)
    kind, ranks, _, summary = verdict(os.path.join(SAMPLED, "nccl_pipeline_cycle", "records"))
    assert kind == "p2p-cycle" and set(ranks) == {0, 1}, summary
    assert "nccl_pipeline_cycle.py:22" in summary and "message #3 1>0" in summary


@pytest.mark.parametrize("scenario, kind, stuck", [
    ("nccl_pipeline_cycle", "p2p-cycle", ["rank 0 is blocked in recv([4096] float32, peer=1) #6 ",
                                          "rank 1 is blocked in recv([4096] float32, peer=0) #6 "]),
    ("nccl_skip_broadcast", "collective-mismatch", ["rank 0 is blocked in all_reduce([1024] float32) #8 ",
                                                    "rank 1 is blocked in all_reduce([1024] float32) #7 "]),
])
def test_flight_recorder_refines_sampled_records(scenario, kind, stuck):
    f = analyse(read_paths([os.path.join(SAMPLED, scenario)])).findings[0]
    evidence = sorted(e for e in f.detail if " is blocked in " in e)  # every rank's pending call: -v detail
    assert f.kind == kind and len(evidence) == 2
    assert all(e.startswith(s) for e, s in zip(evidence, stuck)), evidence


def test_refinement_never_contradicts_exact_records():
    # run 2 had an event per call: Flight Recorder agrees with every state it can pair
    from hangdoc.analysis.refine import refine_states

    for scenario in ("nccl_skip_broadcast", "nccl_pipeline_cycle", "nccl_dataloader_deadlock"):
        job = read_paths([run2(scenario, "records"), run2(scenario, "fr")])
        assert refine_states(job.records) == 0, scenario


# -- run 4: sampled events, states lifted from Flight Recorder inside the job at the dump ----------
RUN4 = os.path.join(RUN1, "hangdoc-run4-fr")


@pytest.mark.parametrize("scenario, kind, stuck", [
    ("nccl_pipeline_cycle", "p2p-cycle", ["rank 0 is blocked in recv([4096] float32, peer=1) #6 ",
                                          "rank 1 is blocked in recv([4096] float32, peer=0) #6 "]),
    ("nccl_skip_broadcast", "collective-mismatch", ["rank 0 is blocked in all_reduce([1024] float32) #8 ",
                                                    "rank 1 is blocked in all_reduce([1024] float32) #7 "]),
    ("nccl_stream_misplacement", "stream-misplacement", ["rank 0 is blocked in all_reduce([65536] float32) #4 ",
                                                         "rank 1 is blocked in all_reduce([65536] float32) #4 "]),
])
def test_run4_records_refined_in_the_job_are_exact(scenario, kind, stuck):
    d = os.path.join(RUN4, scenario)
    refined = []
    for name in sorted(os.listdir(d)):
        if name.startswith("collectives-"):
            with open(os.path.join(d, name)) as f:
                refined.append(json.loads(f.readline()).get("refined_by_flight_recorder", 0))
    assert len(refined) == 2 and all(n > 0 for n in refined), refined
    f = analyse(read_paths([d])).findings[0]
    evidence = sorted(e for e in f.detail if " is blocked in " in e)  # every rank's pending call: -v detail
    assert f.kind == kind and all(e.startswith(s) for e, s in zip(evidence, stuck)) and len(evidence) == 2, evidence
