"""A rank whose main thread waits on a queue for its communication thread waits in that thread's
collective (ZeRO-3/FSDP-style overlap): stacks alone then name the rank that is elsewhere."""

from hangdoc.analysis.diagnose import diagnose
from hangdoc.analysis.grouping import build_report
from hangdoc.analysis.signatures import wait_of
from hangdoc.model import Frame, Job, Process, Thread

C10D = "torch/distributed/distributed_c10d.py"
QUEUE_WAIT = (Frame("<module>", "train.py", 80), Frame("main", "train.py", 70),
              Frame("get", "/usr/lib/python3.11/queue.py", 171), Frame("wait", "/usr/lib/python3.11/threading.py", 327))
COMM = (Frame("_bootstrap", "/usr/lib/python3.11/threading.py", 1002), Frame("comm_thread", "train.py", 36),
        Frame("reduce_scatter_tensor", C10D, 4200))
UNSHARD = (Frame("<module>", "train.py", 80), Frame("main", "train.py", 66), Frame("unshard", "train.py", 42),
           Frame("all_gather_into_tensor", C10D, 3900))
IDLE_COMM = (Frame("_bootstrap", "/usr/lib/python3.11/threading.py", 1002), Frame("comm_thread", "train.py", 34),
             Frame("get", "/usr/lib/python3.11/queue.py", 171), Frame("wait", "/usr/lib/python3.11/threading.py", 327))


def rank(r):
    main, comm = (UNSHARD, IDLE_COMM) if r == 2 else (QUEUE_WAIT, COMM)
    return Process(host="n", pid=100 + r, rank=r, threads=[Thread("1", "MainThread", main, "idle", True),
                                                         Thread("2", "comm", comm, "idle", False)])


def test_the_main_thread_waiting_for_its_comm_thread_waits_in_that_collective():
    w = wait_of(rank(0))
    assert (w.category, w.op) == ("collective", "reduce_scatter_tensor")
    assert "comm thread" in w.detail
    assert wait_of(rank(2)).op == "all_gather_into_tensor"  # its own main thread's collective


def test_stacks_alone_name_the_rank_in_the_other_collective():
    head = diagnose(build_report(Job(processes=[rank(r) for r in range(4)])))[0]
    assert head.kind == "collective-mismatch"
    assert [c.rank for c in head.culprits] == [2]
