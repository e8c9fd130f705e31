"""Grouping, the merged tree, summaries and missing ranks, on jobs built from model objects.

The invariants (order independence, counts add up, rank ranges round-trip) are checked with
hypothesis; the BLOOM layout is checked literally.
"""

from __future__ import annotations

import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hangdoc.analysis.grouping import build_report, merge_tree, missing_ranks, summarize
from hangdoc.model import (
    ROLE_RANK,
    STATUS_OK,
    STATUS_UNRESPONSIVE,
    CollectiveRecord,
    Frame,
    Job,
    Process,
    Source,
    Thread,
)
from hangdoc.ranges import compress_ranks, expand_ranks
from hangdoc.renderers import RenderOptions, render

C10D = "torch/distributed/distributed_c10d.py"
ENGINE = "deepspeed/runtime/pipe/engine.py"

BASE = (
    Frame("<module>", "pretrain_gpt.py", 300),
    Frame("main", "pretrain_gpt.py", 290),
    Frame("_exception_logger.<locals>.wrapper", "torch/distributed/c10d_logger.py", 83),
    Frame("pretrain", "megatron/training.py", 150),
    Frame("train", "megatron/training.py", 700),
    Frame("train_step", "megatron/training.py", 400),
)
BCAST_A = BASE + (Frame("_exec_load_micro_batch", ENGINE, 650), Frame("_bcast_pipe_scalar", ENGINE, 123), Frame("broadcast", C10D, 1500))
DL_WAIT = BASE + (
    Frame("_exec_load_micro_batch", ENGINE, 640),
    Frame("_next_batch", ENGINE, 600),
    Frame("__next__", "torch/utils/data/dataloader.py", 630),
    Frame("_next_data", "torch/utils/data/dataloader.py", 1300),
    Frame("_get_data", "torch/utils/data/dataloader.py", 1150),
    Frame("wait", "threading.py", 320),
)
BCAST_B = BASE + (Frame("_exec_reduce_grads", ENGINE, 220), Frame("_bcast_pipe_scalar", ENGINE, 123), Frame("broadcast", C10D, 1500))


def proc(rank, frames, host=None, pid=None, status=STATUS_OK, others=(), source="trace.out", line=1):
    threads = [Thread("0x1", "MainThread", tuple(frames), is_main=True)]
    threads += [Thread(f"0x{i + 2}", name, tuple(fr)) for i, (name, fr) in enumerate(others)]
    return Process(
        host=host if host is not None else (f"node{rank // 4 + 1}" if rank is not None else None),
        pid=pid if pid is not None else (1000 + (rank or 0)),
        rank=rank,
        role=ROLE_RANK,
        threads=threads,
        status=status,
        status_detail="Error: Failed to get stack traces" if status != STATUS_OK else "",
        source=source,
        source_line=line,
    )


def bloom_job():
    procs = [proc(r, BCAST_A) for r in range(4)] + [proc(4, DL_WAIT)] + [proc(r, BCAST_B) for r in range(5, 8)]
    return Job(processes=procs, world_size=8)


def test_bloom_layout_falls_out_of_the_groups():
    report = build_report(bloom_job())
    got = [(g.count, compress_ranks(g.ranks), g.summary) for g in report.groups]
    assert got == [
        (4, "0-3", "broadcast ← _bcast_pipe_scalar (engine.py:123)"),
        (3, "5-7", "broadcast ← _bcast_pipe_scalar (engine.py:123)"),
        (1, "4", "wait ← _next_batch (engine.py:600)"),
    ]
    assert report.missing_ranks == []
    # the tree splits below train_step into the three groups, largest branch first
    node = report.tree
    for f in BASE:
        assert len(node.children) == 1
        node = node.children[0]
        assert node.frame == f and node.count == 8
    assert [(c.frame.function, c.frame.line, c.count) for c in node.children] == [
        ("_exec_load_micro_batch", 650, 4),
        ("_exec_reduce_grads", 220, 3),
        ("_exec_load_micro_batch", 640, 1),
    ]


def test_granularity_function_joins_stacks_that_differ_only_in_lines():
    a = BASE + (Frame("step", "t.py", 10),)
    b = BASE + (Frame("step", "t.py", 11),)
    job = Job(processes=[proc(0, a), proc(1, b), proc(2, a)])
    assert [g.count for g in build_report(job).groups] == [2, 1]
    (g,) = build_report(job, granularity="function").groups
    assert g.count == 3
    # the lines all members share stay; the one they disagree on is dropped
    assert g.stack[-1] == Frame("step", "t.py", None) and g.stack[0].line == 300
    with pytest.raises(ValueError):
        build_report(job, granularity="line")


def test_unresponsive_and_stackless_processes_stay_visible_as_their_own_groups():
    job = Job(processes=[proc(0, BCAST_A), proc(1, (), status=STATUS_UNRESPONSIVE), proc(2, BCAST_A), Process(host="n9", pid=5)])
    report = build_report(job)
    assert sum(g.count for g in report.groups) == 4
    bad = [g for g in report.groups if g.status == STATUS_UNRESPONSIVE]
    assert len(bad) == 1 and bad[0].ranks == [1]
    assert bad[0].summary == "unresponsive: Error: Failed to get stack traces"
    empty = [g for g in report.groups if g.status == STATUS_OK and not g.stack]
    assert len(empty) == 1 and empty[0].summary == "no stack"
    # the unresponsive group sorts after the ok group of the same size
    assert report.groups[0].count == 2


def test_locals_do_not_split_groups_and_are_not_kept_on_the_group_stack():
    f1 = Frame("broadcast", C10D, 1500, locals=(("tensor", "tensor([1.])"),))
    f2 = Frame("broadcast", C10D, 1500, locals=(("tensor", "tensor([2.])"),))
    job = Job(processes=[proc(0, BASE + (f1,)), proc(1, BASE + (f2,))])
    (g,) = build_report(job).groups
    assert g.count == 2 and g.stack[-1].locals == ()


def test_other_threads_are_grouped_separately():
    pin = (Frame("_bootstrap", "threading.py", 995), Frame("_pin_memory_loop", "torch/utils/data/_utils/pin_memory.py", 50))
    hb = (Frame("_bootstrap", "threading.py", 995), Frame("_heartbeat", "hangdoc/runtime/watchdog.py", 10))
    job = Job(processes=[
        proc(0, BCAST_A, others=[("Thread-1 (_pin_memory_loop)", pin), ("Thread-2", pin)]),
        proc(1, BCAST_A, others=[("Thread-1 (_pin_memory_loop)", pin), ("hb", hb)]),
    ])
    report = build_report(job)
    assert [g.count for g in report.groups] == [2]
    tg = report.thread_groups
    assert [(g.threads, g.count, g.ranks) for g in tg] == [(3, 2, [0, 1]), (1, 1, [1])]
    assert tg[0].thread_names == ["Thread-1 (_pin_memory_loop)", "Thread-2"]
    assert tg[1].summary == "_heartbeat (watchdog.py:10)"


def test_missing_ranks_count_records_as_evidence():
    job = Job(processes=[proc(0, BCAST_A), proc(2, BCAST_A)], world_size=5, records=[CollectiveRecord(rank=3, seq=0, op="broadcast")])
    assert missing_ranks(job) == [1, 4]
    assert missing_ranks(Job(processes=[proc(0, BCAST_A)])) == []


def test_summary_prefers_python_frames_and_skips_plumbing():
    native = (Frame("pthread_cond_wait", "libc.so.6", None, native=True),)
    s = summarize(BCAST_A + native)
    assert s == "broadcast ← _bcast_pipe_scalar (engine.py:123)"
    assert summarize((Frame("main", "train.py", 5), Frame("sleep_forever", "train.py", 9))) == "sleep_forever (train.py:9)"
    # nothing but library code: the innermost frame itself
    assert summarize((Frame("_bootstrap", "threading.py", 995), Frame("wait", "threading.py", 320))) == "wait (threading.py:320)"
    assert summarize(()) == "no stack"


def test_merge_tree_shares_nodes_between_groups():
    report = build_report(bloom_job())
    nodes = 0
    work = [report.tree]
    while work:
        n = work.pop()
        nodes += 1
        work.extend(n.children)
    # 6 shared frames + 3 branches of 3, 3 and 6 frames, plus the root
    assert nodes == 1 + 6 + 3 + 3 + 6
    assert report.tree.count == 8


# -- invariants ---------------------------------------------------------------------------------

FRAMES = [
    Frame("<module>", "train.py", 1),
    Frame("main", "train.py", 10),
    Frame("main", "train.py", 11),
    Frame("step", "engine.py", 5),
    Frame("broadcast", C10D, 1500),
    Frame("all_reduce", C10D, 1600),
    Frame("wait", "threading.py", 320),
    Frame("pthread_cond_wait", "libc.so.6", None, native=True),
]

frames_st = st.lists(st.sampled_from(FRAMES), max_size=5).map(tuple)
thread_st = st.tuples(st.sampled_from(["Thread-1", "pin", "hb"]), frames_st)


@st.composite
def jobs(draw):
    n = draw(st.integers(0, 25))
    ranks = draw(st.lists(st.one_of(st.none(), st.integers(0, 40)), min_size=n, max_size=n))
    procs = []
    for i, r in enumerate(ranks):
        procs.append(
            proc(
                r,
                draw(frames_st),
                host=draw(st.sampled_from(["node01", "node02", "node10", "login", None])),
                pid=draw(st.integers(1, 60)),
                status=draw(st.sampled_from([STATUS_OK, STATUS_OK, STATUS_UNRESPONSIVE])),
                others=draw(st.lists(thread_st, max_size=2)),
                source=draw(st.sampled_from(["a.out", "b.out"])),
                line=i,
            )
        )
    ws = draw(st.one_of(st.none(), st.integers(1, 45)))
    sources = [Source("a.out", processes=1), Source("b.out")]
    return Job(processes=procs, world_size=ws, sources=sources)


def _fingerprint(report):
    return "".join(render(report, fmt, RenderOptions()) for fmt in ("json", "text", "markdown"))


@settings(max_examples=60, deadline=None)
@given(jobs(), st.randoms(use_true_random=False), st.sampled_from(["function+line", "function"]))
def test_permuting_processes_never_changes_the_report(job, rnd, granularity):
    before = _fingerprint(build_report(job, granularity))
    shuffled = list(job.processes)
    rnd.shuffle(shuffled)
    # a reader may also hand out each stack as its own tuple object instead of a shared one
    copies = []
    for p in shuffled:
        q = Process(**{k: getattr(p, k) for k in p.__dataclass_fields__})
        q.threads = [Thread(t.ident, t.name, tuple(list(t.frames)), t.state, t.is_main) for t in p.threads]
        copies.append(q)
    after = _fingerprint(build_report(Job(processes=copies, world_size=job.world_size, sources=job.sources), granularity))
    assert before == after


@settings(max_examples=80, deadline=None)
@given(jobs(), st.sampled_from(["function+line", "function"]))
def test_group_invariants(job, granularity):
    report = build_report(job, granularity)
    groups = report.groups
    assert sum(g.count for g in groups) == len(job.processes)
    assert sorted(id(p) for g in groups for p in g.members) == sorted(id(p) for p in job.processes)
    assert [g.count for g in groups] == sorted((g.count for g in groups), reverse=True)
    for g in groups:
        assert expand_ranks(compress_ranks(g.ranks)) == sorted(set(g.ranks))
        assert len({p.status for p in g.members}) == 1 and g.members[0].status == g.status
        key = lambda fr: tuple((f.function, f.file, f.native) + ((f.line,) if granularity == "function+line" else ()) for f in fr)
        assert len({key(p.main_thread.frames) for p in g.members}) == 1
        assert g.summary
    # distinct groups have distinct (status, stack)
    assert len({(g.status, tuple((f.function, f.file, f.native) for f in g.stack)) for g in groups}) == len(groups) or granularity == "function+line"
    assert report.tree.count == len(job.processes)
    # every group's stack is a path of the tree
    same = (lambda a, b: a == b) if granularity == "function+line" else (lambda a, b: (a.function, a.file, a.native) == (b.function, b.file, b.native))
    for g in groups:
        node = report.tree
        for f in g.stack:
            node = next(c for c in node.children if same(c.frame, f))
            assert any(x is g for x in node.groups)
    present = {p.rank for p in job.processes if p.rank is not None}
    assert not present & set(report.missing_ranks)
    if job.world_size:
        assert set(report.missing_ranks) | present >= set(range(job.world_size))
    assert sum(g.threads for g in report.thread_groups) == sum(len(p.threads) - 1 for p in job.processes)


@settings(max_examples=40, deadline=None)
@given(jobs())
def test_function_granularity_is_coarser(job):
    fine = build_report(job, "function+line").groups
    coarse = build_report(job, "function").groups
    where = {id(p): i for i, g in enumerate(coarse) for p in g.members}
    for g in fine:
        assert len({where[id(p)] for p in g.members}) == 1
    assert len(coarse) <= len(fine)


def test_large_job_groups_by_distinct_stacks():
    # 20,000 processes sharing three stack objects: the tree stays three branches wide
    odd = {1000: BCAST_B, 5000: DL_WAIT}
    procs = [proc(r, odd.get(r, BCAST_A), host=f"node{r // 8:04d}") for r in range(20000)]
    random.Random(0).shuffle(procs)
    report = build_report(Job(processes=procs, world_size=20001))
    assert [(g.count, compress_ranks(g.ranks)) for g in report.groups] == [(19998, "0-999,1001-4999,5001-19999"), (1, "1000"), (1, "5000")]
    assert report.missing_ranks == [20000]
    assert len(report.tree.children[0].children) == 1


def test_summary_of_a_c_only_stack_names_the_recognised_wait_not_libc():
    gdb = (
        Frame("_start", "", None, native=True),
        Frame("_PyEval_EvalFrameDefault", "Python/ceval.c", 5000, native=True),
        Frame("c10d::Work::wait(std::chrono::duration<long, std::ratio<1l, 1000l> >)", "libtorch_cpu.so", None, native=True),
        Frame("std::condition_variable::wait(std::unique_lock<std::mutex>&)", "libstdc++.so.6", None, native=True),
        Frame("__futex_abstimed_wait_common64", "./nptl/futex-internal.c", 57, native=True),
    )
    assert summarize(gdb) == "c10d::Work::wait (libtorch_cpu.so)"


def test_summary_of_a_forked_worker_stops_at_the_child_start():
    parent = (Frame("<module>", "train.py", 71), Frame("main", "train.py", 61),
              Frame("_MultiProcessingDataLoaderIter.__init__", "torch/utils/data/dataloader.py", 1176),
              Frame("Popen._launch", "multiprocessing/popen_fork.py", 71),
              Frame("BaseProcess._bootstrap", "multiprocessing/process.py", 314),
              Frame("BaseProcess.run", "multiprocessing/process.py", 108))
    idle = parent + (Frame("_worker_loop", "torch/utils/data/_utils/worker.py", 334), Frame("Queue.get", "multiprocessing/queues.py", 113),
                     Frame("_PollLikeSelector.select", "selectors.py", 415))
    stuck = parent + (Frame("_worker_loop", "torch/utils/data/_utils/worker.py", 374), Frame("__getitem__", "train.py", 35),
                      Frame("acquire", "logging/__init__.py", 230))
    assert summarize(idle) == "_PollLikeSelector.select ← _worker_loop (worker.py:334)"
    assert summarize(stuck) == "acquire ← __getitem__ (train.py:35)"


def test_function_granularity_merges_tree_nodes_that_differ_only_in_line():
    a = (Frame("main", "t.py", 10), Frame("step", "t.py", 1), Frame("x", "t.py", 5))
    b = (Frame("main", "t.py", 12), Frame("step", "t.py", 1), Frame("y", "t.py", 6))
    job = Job(processes=[proc(0, a), proc(1, a), proc(2, b)])
    fine = build_report(job)
    assert [c.frame for c in fine.tree.children] == [a[0], b[0]]
    coarse = build_report(job, granularity="function")
    (main,) = coarse.tree.children
    assert main.frame == Frame("main", "t.py", None) and main.count == 3
    (step,) = main.children
    assert step.frame == Frame("step", "t.py", 1)  # the line all of them agree on stays
    assert [(c.frame.function, c.count) for c in step.children] == [("x", 2), ("y", 1)]


def test_hangdocs_own_recorder_wrapper_is_not_the_user_frame():
    stack = (Frame("<module>", "/work/proj/examples/skip_broadcast.py", 11),
             Frame("wrapper", "/work/proj/hangdoc/runtime/recorder.py", 613),
             Frame("all_reduce", C10D, 3252))
    assert summarize(stack) == "all_reduce ← <module> (skip_broadcast.py:11)"
    installed = (stack[0], Frame("wrapper", "hangdoc/runtime/recorder.py", 613), stack[2])
    assert summarize(installed) == "all_reduce ← <module> (skip_broadcast.py:11)"


def _expand_hosts(text):
    """SLURM hostlist expansion (the inverse of compress_hosts), for the property below."""
    import re

    out = set()
    for m in re.finditer(r"([^,\[\]]+)\[([^\]]+)\]|([^,\[\]]+)", text):
        if m.group(3):
            out.add(m.group(3))
            continue
        prefix = m.group(1)
        for run in m.group(2).split(","):
            a, _, b = run.partition("-")
            width = len(a) if a.startswith("0") and len(a) > 1 else 0
            for n in range(int(a), int(b or a) + 1):
                out.add(f"{prefix}{n:0{width}d}")
    return out


@settings(max_examples=200, deadline=None)
@given(st.sets(st.one_of(
    st.builds(lambda p, n: f"{p}{n}", st.sampled_from(["n", "gpu", "node-a"]), st.integers(0, 130)),
    st.builds(lambda p, n: f"{p}{n:03d}", st.sampled_from(["n", "gpu"]), st.integers(0, 130)),
    st.sampled_from(["login", "localhost"])), min_size=1, max_size=40))
def test_compressed_hosts_expand_to_the_same_hosts(hosts):
    from hangdoc.ranges import compress_hosts

    text = compress_hosts(hosts)
    assert _expand_hosts(text) == hosts
    # one bracket per prefix and padding: n8..n11 is n[8-11], never n[8-9],n[10-11]
    assert len(re.findall(r"\[", text)) <= len({re.match(r"(.*?)(\d*)$", h).group(1) for h in hosts}) * 2
