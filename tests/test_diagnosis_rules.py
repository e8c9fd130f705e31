"""Stack rules on jobs built from model objects: every finding kind, and the invariants.

Fixture-based tests (real captured dumps, BLOOM) are in test_diagnosis_fixtures.py.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Dict, List

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hangdoc.analysis.diagnose import diagnose
from hangdoc.analysis.stack_rules import MAX_CONFIDENCE, findings
from hangdoc.model import (
    FINDING_KINDS,
    ROLE_LAUNCHER,
    ROLE_RANK,
    ROLE_WORKER,
    STATUS_OK,
    STATUS_STOPPED,
    STATUS_UNRESPONSIVE,
    Culprit,
    Frame,
    Job,
    Process,
    Report,
    Thread,
)

C10D = "torch/distributed/distributed_c10d.py"
TOP = (Frame("<module>", "train.py", 90), Frame("main", "train.py", 80))


def user(*fr):
    return TOP + tuple(fr)


def lib(fn, line=1, file=C10D, **loc):
    return Frame(fn, file, line, False, tuple((k, str(v)) for k, v in loc.items()))


# Stack makers: (frames outermost first, thread state). Each takes the rank's peer map when it needs one.
def all_reduce(line=12):
    return user(Frame("train_step", "train.py", line), lib("all_reduce", 2501)), "idle"


def all_gather():
    return user(Frame("gather_stats", "train.py", 30), lib("all_gather", 2800)), "idle"


def broadcast():
    return user(Frame("sync_params", "train.py", 23), lib("broadcast", 2793)), "idle"


def dataloader():
    return user(Frame("train_step", "train.py", 10), lib("__next__", 725, "torch/utils/data/dataloader.py"),
                lib("_next_data", 1505, "torch/utils/data/dataloader.py"), lib("_get_data", 1464, "torch/utils/data/dataloader.py"),
                lib("_try_get_data", 1291, "torch/utils/data/dataloader.py"), lib("Queue.get", 113, "multiprocessing/queues.py"),
                lib("_PollLikeSelector.select", 415, "selectors.py")), "idle"


def recv(peer):
    return user(Frame("stage", "pipe.py", 41), lib("recv", 2799, src=peer)), "idle"


def send(peer):
    return user(Frame("stage", "pipe.py", 38), lib("send", 2750, dst=peer)), "idle"


def sleeping():
    return user(Frame("train_step", "train.py", 11), Frame("clock_nanosleep", "libc.so.6", None, True)), "idle"


def lock():
    return user(Frame("log_metrics", "train.py", 60), Frame("PyThread_acquire_lock_timed", "libpython3.11.so", None, True)), "idle"


def compute(line=14):
    return user(Frame("forward", "model.py", line)), "active"


def worker(stuck: bool):
    base = user(Frame("DataLoader.__iter__", "torch/utils/data/dataloader.py", 505),
                lib("_worker_loop", 334, "torch/utils/data/_utils/worker.py"))
    if stuck:
        return base + (lib("fetch", 54, "torch/utils/data/_utils/fetch.py"), Frame("__getitem__", "dataset.py", 35)), "idle"
    return base + (lib("Queue.get", 113, "multiprocessing/queues.py"), lib("select", 415, "selectors.py")), "idle"


def proc(rank, made, host=None, pid=None, role=ROLE_RANK, status=STATUS_OK, **kw):
    frames, state = made
    return Process(host=host or f"node{(rank or 0) // 2}", pid=pid or 1000 + (rank or 0), rank=rank, role=role, status=status,
                   threads=[Thread("1", "MainThread", frames, state=state, is_main=True)], **kw)


def report(procs, missing=(), world=None):
    return Report(job=Job(processes=list(procs), world_size=world or len(procs) + len(missing)), missing_ranks=list(missing))


def head(procs, missing=()):
    found = findings(report(procs, missing))
    assert found, "stack rules must always say something about a non-empty job"
    return found[0]


def ranks(f):
    return sorted(c.rank for c in f.culprits if c.rank is not None)


# --- every kind ------------------------------------------------------------------------------------


def test_rank_blocked_outside_collective_is_the_culprit():
    for blocked in (sleeping, lock):
        f = head([proc(r, blocked() if r == 2 else all_reduce()) for r in range(4)])
        assert (f.kind, ranks(f)) == ("collective-mismatch", [2])
        assert "rank 2" in f.summary and "all_reduce" in " ".join(f.evidence + f.detail)


def test_gloo_broadcast_root_left_behind_names_the_ranks_that_moved_on_as_candidates():
    # rank 0 is the broadcast root still waiting; rank 2 skipped it; 1 and 3 got the data and moved on:
    # one of ranks 1-3 is to blame and stacks cannot say which, so none is blamed, all are named
    f = head([proc(r, broadcast() if r == 0 else all_reduce()) for r in range(4)])
    assert f.kind == "collective-mismatch"
    assert ranks(f) == [] and sorted(c.rank for c in f.candidates) == [1, 2, 3]
    text = " ".join(f.evidence + f.detail)
    assert "gloo" in text and "records" in text and f.confidence <= 0.5
    # the other direction (NCCL-like: every receiver still waits): the one rank that moved on is named
    f = head([proc(r, all_reduce() if r == 2 else broadcast()) for r in range(4)])
    assert ranks(f) == [2]


def test_different_collectives_minority_and_tie():
    f = head([proc(r, all_gather() if r == 3 else all_reduce()) for r in range(4)])
    assert (f.kind, ranks(f)) == ("collective-mismatch", [3])
    f = head([proc(r, all_reduce(12) if r < 2 else all_reduce(19)) for r in range(4)])
    assert f.kind == "collective-mismatch" and f.culprits == [] and "same size" in " ".join(f.evidence + f.detail)


def test_dataloader_stall_names_the_rank_and_its_stuck_worker_only():
    procs = [proc(r, dataloader() if r == 1 else all_reduce()) for r in range(4)]
    procs.append(proc(None, worker(True), host="node0", pid=2001, role=ROLE_WORKER, ppid=1001))
    procs.append(proc(None, worker(False), host="node0", pid=2000, role=ROLE_WORKER, ppid=1000))
    f = head(procs)
    assert f.kind == "dataloader-stall" and f.confidence == MAX_CONFIDENCE
    assert set(f.culprits) == {Culprit("node0", 1001, 1), Culprit("node0", 2001, None)}
    advice = " ".join(f.advice)
    for hint in ("num_workers=0", "spawn", "forkserver", "fork", "lock", "py-spy dump"):
        assert hint in advice
    assert [g.kind for g in findings(report(procs))] == ["dataloader-stall"]  # the collective waits are its evidence


def test_worker_found_by_parent_rank_and_by_stack_without_role():
    procs = [proc(r, dataloader() if r == 1 else all_reduce()) for r in range(2)]
    procs.append(proc(None, worker(True), pid=3000, parent_rank=1))
    assert Culprit("node0", 3000, None) in head(procs).culprits


def test_p2p_cycle_from_locals():
    made = {0: send(1), 1: recv(2), 2: recv(1), 3: recv(2)}
    f = head([proc(r, made[r]) for r in range(4)])
    assert (f.kind, ranks(f)) == ("p2p-cycle", [1, 2])
    assert "rank 1 recv←2" in f.summary and "rank 2 recv←1" in f.summary


def test_matched_send_recv_is_no_cycle():
    f = head([proc(0, send(1)), proc(1, recv(0))])
    assert f.kind not in ("p2p-cycle",)


def test_p2p_stall_chain_ends_at_rank_doing_something_else():
    made = {0: compute(), 1: recv(0), 2: recv(1)}
    found = findings(report([proc(r, made[r]) for r in range(3)]))
    f = found[0]
    assert (f.kind, ranks(f)) == ("p2p-stall", [0])


def test_p2p_stall_without_peers_flags_the_odd_call_site():
    def recv_at(line):
        return user(Frame("_exec_recv_activations", "deepspeed/runtime/pipe/engine.py", line), lib("recv", 2799)), "idle"

    f = head([proc(r, recv_at(1073) if r != 5 else recv_at(1100)) for r in range(6)])
    assert (f.kind, ranks(f)) == ("p2p-stall", [5])
    # every rank at one recv, none sending: nobody can ever send, a receive deadlock of them all
    f = head([proc(r, recv_at(1073)) for r in range(4)])
    assert (f.kind, ranks(f)) == ("p2p-cycle", [0, 1, 2, 3]) and "--locals" in " ".join(f.advice)
    assert "none sends" in f.summary and "unless" not in f.summary and f.confidence == 0.75
    # plain py-spy dumps: the world size is not known, so a rank not dumped might still send
    [f] = findings(Report(job=Job(processes=[proc(r, recv_at(1073)) for r in range(4)])))
    assert f.kind == "p2p-cycle" and "unless a process that was not dumped" in f.summary and f.confidence == 0.6
    # one rank elsewhere (computing, or missing from the dumps) may still send: no deadlock is claimed
    f = head([proc(r, recv_at(1073)) for r in range(3)] + [proc(3, compute())])
    assert f.kind != "p2p-cycle"
    f = head([proc(r, recv_at(1073)) for r in range(3)], missing=[3])
    assert f.kind != "p2p-cycle"


def test_p2p_stall_without_peers_a_first_stage_sending_is_a_candidate_not_a_culprit():
    # examples/bugs/wrong_peer.py dumped by plain py-spy: rank 0 sends, ranks 1-3 receive, all at one
    # line each; the bug is rank 1's wrong source, and a pipeline's first stage always only sends
    def at(op, line):
        return user(Frame("main", "wrong_peer.py", line), lib(op, 2799 if op == "recv" else 2753)), "idle"

    f = head([proc(0, at("send", 46))] + [proc(r, at("recv", 42)) for r in range(1, 4)])
    assert f.kind == "p2p-stall" and f.culprits == []
    assert [c.rank for c in f.candidates] == [0]


def test_every_rank_at_one_line_inside_a_loop_is_not_called_a_hang_below_python(tmp_path):
    # examples/bugs/group_order.py: two groups reduced in opposite orders, all at one line of a loop
    src = tmp_path / "group_order.py"
    src.write_text("def main(groups, x):\n    for g in groups:\n        dist.all_reduce(x, group=g)\n")
    at = user(Frame("main", str(src), 3), lib("all_reduce", 2501)), "idle"
    f = head([proc(r, at) for r in range(4)])
    assert f.kind == "collective-wait" and f.culprits == []
    assert "a call inside a loop" in f.summary and "the hang is below Python" not in f.summary
    assert f.advice[0].startswith("Run again with the collective recorder")
    flat = tmp_path / "flat.py"  # not in a loop: below Python
    flat.write_text("def main(x):\n    y = 1\n    dist.all_reduce(x)\n")
    at = user(Frame("main", str(flat), 3), lib("all_reduce", 2501)), "idle"
    f = head([proc(r, at) for r in range(4)])
    assert f.summary.endswith("the hang is below Python"), f.summary


def test_unresponsive_and_stopped():
    procs = [proc(r, all_reduce()) for r in range(4)]
    procs[1] = Process(host="node0", pid=1001, rank=1, status=STATUS_STOPPED, status_detail="state T")
    found = findings(report(procs))
    assert (found[0].kind, ranks(found[0])) == ("unresponsive-process", [1])
    assert found[0].confidence == MAX_CONFIDENCE
    assert "collective-wait" not in [f.kind for f in found]  # the stopped rank explains the wait
    procs[1] = Process(host="node0", pid=1001, rank=1, status=STATUS_UNRESPONSIVE, status_detail="py-spy: Permission denied")
    f = head(procs)
    assert (f.kind, ranks(f)) == ("unresponsive-process", [1]) and "Permission denied" in " ".join(f.evidence + f.detail)


def test_missing_rank():
    f = head([proc(r, all_reduce()) for r in range(3)], missing=[3])
    assert (f.kind, f.culprits) == ("missing-rank", [Culprit(rank=3)])


def test_collective_wait_has_no_culprit_and_points_below_python():
    f = head([proc(r, all_reduce()) for r in range(4)])
    assert (f.kind, f.culprits) == ("collective-wait", [])
    advice = " ".join(f.advice)
    assert "NCCL_DEBUG=INFO" in advice and "CUDA_LAUNCH_BLOCKING=1" in advice and "examples/" in advice
    assert any("iterations" in e for e in f.evidence)  # loop ambiguity


def test_no_hang():
    f = head([proc(r, compute(14 + r)) for r in range(4)])
    assert (f.kind, f.culprits) == ("no-hang", [])
    # a healthy job caught while some ranks wait in all_reduce for busy ones: nobody blamed
    f = head([proc(r, compute() if r % 2 else all_reduce()) for r in range(4)])
    assert (f.kind, f.culprits) == ("no-hang", [])


def test_launchers_are_ignored():
    agent = (Frame("main", "torch/distributed/run.py", 900),
             Frame("SimpleElasticAgent._invoke_run", "torch/distributed/elastic/agent/server/api.py", 908)), "idle"
    f = head([proc(r, all_reduce()) for r in range(2)] + [proc(None, agent, pid=999, role="unknown"), proc(None, agent, pid=998, role=ROLE_LAUNCHER)])
    assert (f.kind, f.culprits) == ("collective-wait", [])


def test_diagnose_puts_stack_verdict_first_and_every_kind_is_known():
    procs = [proc(r, dataloader() if r == 1 else all_reduce()) for r in range(4)]
    found = diagnose(report(procs))
    assert found[0].kind == "dataloader-stall"
    assert all(f.kind in FINDING_KINDS and f.confidence <= MAX_CONFIDENCE for f in found)
    assert findings(report([])) == []


# --- invariants --------------------------------------------------------------------------------------

KINDS = ["ar", "ar2", "ag", "bc", "dl", "recv", "send", "sleep", "lock", "compute", "stopped", "unresponsive"]


def build(spec: Dict[int, tuple], missing: List[int], rmap, hmap, pmap, order_seed: int, workers: Dict[int, bool]):
    """Processes of ``spec`` (rank -> (kind, peer)) under a relabelling of ranks, hosts and pids."""
    procs = []
    for r, (kind, peer) in spec.items():
        host, pid, rank = hmap(f"node{r // 2}"), pmap(1000 + r), rmap(r)
        if kind in ("stopped", "unresponsive"):
            procs.append(Process(host=host, pid=pid, rank=rank, role=ROLE_RANK, status=kind))
            continue
        made = {"ar": lambda: all_reduce(), "ar2": lambda: all_reduce(19), "ag": all_gather, "bc": broadcast, "dl": dataloader,
                "recv": lambda: recv(rmap(peer)), "send": lambda: send(rmap(peer)), "sleep": sleeping, "lock": lock,
                "compute": compute}[kind]()
        procs.append(proc(rank, made, host=host, pid=pid))
    for r, stuck in workers.items():
        procs.append(proc(None, worker(stuck), host=hmap(f"node{r // 2}"), pid=pmap(5000 + r), role=ROLE_WORKER, ppid=pmap(1000 + r)))
    random.Random(order_seed).shuffle(procs)
    return Report(job=Job(processes=procs, world_size=len(spec) + len(missing)), missing_ranks=sorted(rmap(m) for m in missing))


def verdict(rep: Report):
    # a multiset: frozensets have no total order, so sorting them would compare nothing useful
    return Counter((f.kind, frozenset(f.culprits)) for f in findings(rep))


@st.composite
def scenarios(draw):
    n = draw(st.integers(2, 8))
    spec = {}
    for r in range(n):
        kind = draw(st.sampled_from(KINDS) if draw(st.integers(0, 3)) == 0 else st.sampled_from(["ar", "bc", "dl", "recv", "compute"]))
        peer = draw(st.sampled_from([x for x in range(n) if x != r])) if kind in ("recv", "send") else None
        spec[r] = (kind, peer)
    ranks_ = list(spec)
    missing = draw(st.lists(st.sampled_from(ranks_), max_size=1, unique=True)) if n > 2 else []
    for m in missing:
        del spec[m]
    workers = {r: draw(st.booleans()) for r in spec if spec[r][0] == "dl" and draw(st.booleans())}
    return spec, missing, workers


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.permutations(range(8)), st.integers(0, 1000), st.integers(0, 1000))
def test_relabelling_hosts_pids_ranks_and_reordering_never_changes_the_verdict(sc, perm, seed, pid_shift):
    spec, missing, workers = sc
    ident = build(spec, missing, lambda r: r, lambda h: h, lambda p: p, 0, workers)
    hosts = {f"node{i}": f"gpu-{(i * 7 + seed) % 13:02d}x{i}" for i in range(4)}
    rmap = lambda r: None if r is None else perm[r]  # noqa: E731
    hmap = lambda h: hosts[h]  # noqa: E731
    pmap = lambda p: p * 3 + pid_shift  # noqa: E731
    moved = build(spec, missing, rmap, hmap, pmap, seed, workers)

    def relabel(c: Culprit) -> Culprit:
        return Culprit(hmap(c.host) if c.host else None, pmap(c.pid) if c.pid is not None else None, rmap(c.rank))

    expected = Counter({(k, frozenset(relabel(c) for c in cs)): n for (k, cs), n in verdict(ident).items()})
    assert verdict(moved) == expected


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["forward", "backward", "step", "compute_loss", "<listcomp>"]),
                          st.integers(1, 500), st.sampled_from(["active", "active+gil", None])), min_size=1, max_size=12),
       st.integers(0, 3))
def test_no_hang_signature_never_gets_a_culprit(busy, missing_none):
    procs = [Process(host="n", pid=10 + i, rank=i, role=ROLE_RANK,
                     threads=[Thread("1", "MainThread", user(Frame(fn, "model.py", line)), state=state, is_main=True)])
             for i, (fn, line, state) in enumerate(busy)]
    found = findings(Report(job=Job(processes=procs, world_size=len(procs))))
    assert [f.kind for f in found] == ["no-hang"]
    assert all(not f.culprits for f in found)
    assert all(not f.culprits for f in diagnose(Report(job=Job(processes=procs))))


# --- a rank's fatal stack against the others' records (hangdoc.analysis.fatal_rules) ---------------

def _fatal_case(fatal_line=27, fatal_records=False, other_lines=(38, 38, 38)):
    from hangdoc.model import CollectiveRecord, Frame, Job, Process, Report, Thread

    recs = [CollectiveRecord(rank=r, seq=7, op="all_reduce", call_site=f"/w/train.py:{line}:main", state="issued")
            for r, line in zip((0, 2, 3), other_lines)]
    if fatal_records:
        recs.append(CollectiveRecord(rank=1, seq=7, op="all_reduce", call_site="/w/train.py:27:log", state="issued"))
    stack = (Frame("main", "/w/train.py", 37), Frame("log", "/w/train.py", fatal_line),
             Frame("all_reduce", "torch/distributed/distributed_c10d.py", 3252))
    p = Process(host="n1", pid=9, rank=1, threads=[Thread("1", "MainThread", stack, is_main=True)],
                meta={"fatal_error": "Aborted"})
    return Report(job=Job(processes=[p], records=recs))


def test_fatal_stack_at_a_call_the_others_are_not_making_names_that_rank():
    from hangdoc.analysis import fatal_rules

    [f] = fatal_rules.findings(_fatal_case())
    assert f.kind == "collective-mismatch" and [c.rank for c in f.culprits] == [1]
    assert "train.py:27" in f.summary and "train.py:38" in f.summary


def test_fatal_stack_with_records_or_no_agreement_blames_nobody():
    """A rank whose own records exist (the record rules judge it), others that disagree among
    themselves: no finding."""
    from hangdoc.analysis import fatal_rules

    assert fatal_rules.findings(_fatal_case(fatal_records=True)) == []
    assert fatal_rules.findings(_fatal_case(other_lines=(38, 38, 40))) == []
    assert fatal_rules.findings(_fatal_case(fatal_line=38, fatal_records=True)) == []


def test_aborts_at_the_call_the_others_wait_in_name_the_smaller_side():
    """A size or type mismatch: gloo aborts the side whose buffers are too small, and the aborted
    ranks' records are lost. One rank aborted while three wait: it is the odd one; three aborted
    while one waits: the waiting one is; as many on each side: candidates, nobody named."""
    from hangdoc.analysis import fatal_rules
    from hangdoc.model import Frame, Process, Thread

    [f] = fatal_rules.findings(_fatal_case(fatal_line=38))
    assert f.kind == "collective-mismatch" and [c.rank for c in f.culprits] == [1] and f.confidence < 0.9
    assert "rank 1, the smaller side" in f.summary

    def aborted(rank):
        stack = (Frame("main", "/w/train.py", 38), Frame("all_reduce", "torch/distributed/distributed_c10d.py", 3252))
        return Process(host="n1", pid=20 + rank, rank=rank, threads=[Thread("1", "MainThread", stack, is_main=True)],
                       meta={"fatal_error": "Aborted"})

    report = _fatal_case(fatal_line=38)
    report.job.records = [r for r in report.job.records if r.rank == 0]
    report.job.processes += [aborted(2), aborted(3)]
    [f] = fatal_rules.findings(report)
    assert [c.rank for c in f.culprits] == [0] and "rank 0, the smaller side" in f.summary

    report = _fatal_case(fatal_line=38)
    report.job.records = [r for r in report.job.records if r.rank in (0, 2)]
    report.job.processes += [aborted(3)]
    [f] = fatal_rules.findings(report)
    assert f.culprits == [] and sorted(c.rank for c in f.candidates) == [1, 3]


def test_the_fatal_note_names_the_timeout_when_the_console_log_shows_one():
    """NCCL's watchdog aborts a rank once its collective times out: that rank's fatal stack is where it
    waited, and the note must say so rather than call it a failed check (the note with no log hedges)."""
    from hangdoc.model import LogEvent

    def note(events):
        report = _fatal_case()
        report.job.events = events
        lines = [e for f in diagnose(report) for e in f.evidence + f.detail if "died of a fatal signal" in e]
        assert len(lines) == 1, lines
        return lines[0]

    assert "or a process group's timeout" in note([])
    own = LogEvent(kind="timeout", source="job.log", line=3, rank=1, fields={"op": "ALLREDUCE", "seq": 469508})
    assert "after its collective (ALLREDUCE #469508) timed out" in note([own])
    other = LogEvent(kind="timeout", source="job.log", line=3, rank=0, fields={"op": "ALLREDUCE", "seq": 7})
    assert "while other ranks' collectives timed out" in note([other])
