"""A rank's other threads in the stack rules: a main thread waiting on a queue for a comm thread
is read per rank (with every rank's main thread alike), each rank counted once, and the rules of
two threads in collectives at once, of a main thread waiting for a thread that is gone, and of an
idle ``backward`` (hangdoc.analysis: stack_rules, thread_collectives, orphan_waits, signatures)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hangdoc.analysis.diagnose import diagnose
from hangdoc.analysis.signatures import BACKWARD_OP, classify_stack
from hangdoc.model import Frame, Job, Process, Report, Thread

C10D = "torch/distributed/distributed_c10d.py"
TOP = (Frame("<module>", "train.py", 90), Frame("main", "train.py", 80))
QUEUE_WAIT = TOP + (Frame("Queue.get", "queue.py", 171), Frame("Condition.wait", "threading.py", 355))


def _comm(op, line):
    return Thread("2", "grad-comm", (Frame("_bootstrap", "threading.py", 1030), Frame("_loop", "train.py", 70),
                                     Frame("_reduce", "train.py", line), Frame(op, C10D, 3075)), state="idle")


def _rank(r, side, extra=0):
    threads = [Thread("1", "MainThread", QUEUE_WAIT, state="idle", is_main=True), side]
    threads += [Thread(str(10 + i), None, ()) for i in range(extra)]  # native threads: no Python frames
    return Process(host="n", pid=100 + r, rank=r, threads=threads)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=4, max_size=4), st.integers(0, 3))
def test_a_comm_threads_collective_is_its_ranks_and_each_rank_counts_once(extras, odd):
    # every main thread alike; rank `odd`'s comm thread in another collective; the native threads
    # differ from rank to rank (what made one bucket sit under several keys)
    procs = [_rank(r, _comm("all_reduce", 83) if r == odd else _comm("all_gather", 88), extras[r]) for r in range(4)]
    [f, *_] = diagnose(Report(job=Job(processes=procs)))
    assert f.kind == "collective-mismatch" and [c.rank for c in f.culprits] == [odd], f.summary
    # each process in exactly one bucket of the stack rules
    from hangdoc.analysis.stack_rules import _buckets

    members = [p.pid for b in _buckets(procs) for p in b.procs]
    assert sorted(members) == [100, 101, 102, 103]


def test_every_rank_in_collectives_on_two_threads_names_no_one():
    main = TOP + (Frame("all_reduce", C10D, 3075),)
    procs = [Process(host="n", pid=100 + r, rank=r,
                     threads=[Thread("1", "MainThread", main, state="idle", is_main=True), _comm("all_gather", 88)])
             for r in range(3)]
    [f, *_] = diagnose(Report(job=Job(processes=procs)))
    assert (f.kind, f.culprits) == ("collective-mismatch", [])
    assert "on two threads at once" in f.summary


def test_a_queue_with_no_thread_left_to_feed_it_is_a_rank_that_failed():
    waiting = [Process(host="n", pid=100 + r, rank=r, threads=[
        Thread("1", "MainThread", TOP + (Frame("all_reduce", C10D, 3075),), state="idle", is_main=True)]) for r in (0, 2)]
    alone = Process(host="n", pid=101, rank=1, threads=[Thread("1", "MainThread", QUEUE_WAIT, state="idle", is_main=True),
                                                         Thread("9", None, ())])
    [f, *_] = diagnose(Report(job=Job(processes=waiting + [alone])))
    assert f.kind == "rank-failed" and [c.rank for c in f.culprits] == [1], f.summary
    # with a live thread that could put, it is a wait outside any collective, no failure
    fed = Process(host="n", pid=101, rank=1, threads=[Thread("1", "MainThread", QUEUE_WAIT, state="idle", is_main=True),
                                                       _comm("all_gather", 88)])
    assert diagnose(Report(job=Job(processes=waiting + [fed])))[0].kind != "rank-failed"


def test_idle_in_backward_is_a_gradient_collective_and_active_is_compute():
    frames = TOP + (Frame("Tensor.backward", "torch/_tensor.py", 631), Frame("backward", "torch/autograd/__init__.py", 381),
                    Frame("_engine_run_backward", "torch/autograd/graph.py", 869))
    w = classify_stack(frames, "idle")
    assert (w.category, w.op, w.call_site.label()) == ("collective", BACKWARD_OP, "main (train.py:80)")
    assert classify_stack(frames, "active").category == "compute"
