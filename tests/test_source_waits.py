"""A rank blocked on a lock or a child process that Python frames hide (``with LOCK:``,
``os.waitpid``): named from its source line, and the verdict names it, not 'compute'."""

from __future__ import annotations

import os
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hangdoc.analysis.diagnose import diagnose
from hangdoc.analysis.signatures import classify_stack
from hangdoc.analysis.source_waits import blocking_call, blocking_call_in
from hangdoc.model import CollectiveRecord, Frame, Job, Process, Report, Thread

C10D = "torch/distributed/distributed_c10d.py"

SOURCE = """import threading
STATS_LOCK = threading.Lock()

def record(x):
    with STATS_LOCK:
        pass

def update_stats(x):
    with STATS_LOCK:
        record(x)
"""


@pytest.fixture
def train(tmp_path):
    p = tmp_path / "train.py"
    p.write_text(SOURCE)
    return str(p)


def test_a_frame_at_a_with_lock_line_is_a_lock_wait(train):
    frames = (Frame("main", train, 20), Frame("update_stats", train, 10), Frame("record", train, 5))
    w = classify_stack(frames, state="active")
    assert w.category == "lock"
    assert w.describe() == f"waiting for a lock (`with STATS_LOCK:`) at record ({train}:5)"
    # the same stack where the source is not readable here: nobody can tell, it computes
    assert classify_stack(tuple(Frame(f.function, "/nonexistent/train.py", f.line) for f in frames)).category == "compute"


def test_a_fifo_or_device_named_as_the_source_is_not_read(tmp_path):
    fifo = tmp_path / "x.py"
    os.mkfifo(fifo)
    t0 = time.monotonic()
    assert blocking_call(str(fifo), 1) is None
    assert blocking_call("/dev/zero", 1) is None
    assert time.monotonic() - t0 < 2


def records(world=4, behind=2, seq=3):
    out = []
    for r in range(world):
        for i in range(seq + (r != behind)):
            out.append(CollectiveRecord(rank=r, seq=i, op="all_reduce", shapes=((32,),), dtypes=("float32",),
                                        call_site="train.py:47:main",
                                        state="completed" if i < seq else "issued", host="vm", pid=100 + r))
    return out


def job(stack_of_2):
    procs = []
    for r in range(4):
        frames = stack_of_2 if r == 2 else (Frame("main", "train.py", 47), Frame("all_reduce", C10D, 2501))
        procs.append(Process(host="vm", pid=100 + r, rank=r, threads=[Thread("1", "MainThread", frames, "active", True)]))
    return Job(processes=procs, records=records(), world_size=4)


def test_a_rank_behind_because_it_waits_for_a_lock_is_the_mismatch_culprit(train):
    from hangdoc.analysis.grouping import build_report as build

    report = build(job((Frame("main", train, 20), Frame("update_stats", train, 10), Frame("record", train, 5))))
    head = diagnose(report)[0]
    assert head.kind == "collective-mismatch"
    assert [c.rank for c in head.culprits] == [2]
    assert head.summary.startswith("rank 2 is blocked waiting for a lock (`with STATS_LOCK:`) at record (")
    assert "never issued all_reduce #3 (train.py:47) that ranks 0-1,3 wait in" in head.summary


def test_without_the_source_the_rank_is_only_behind(train):
    from hangdoc.analysis.grouping import build_report as build

    report = build(job((Frame("main", "/nonexistent/train.py", 20), Frame("record", "/nonexistent/train.py", 5))))
    head = diagnose(report)[0]
    # no lock said: the records' "behind" finding heads, its stack outside any collective (compute)
    # making it a mismatch of rank 2 (docs/findings/collective-wait.md)
    assert head.kind == "collective-mismatch" and [c.rank for c in head.culprits] == [2]
    assert head.summary.endswith("behind and never issued it"), head.summary


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_any_line_is_classified_quickly_and_never_raises(text):
    got = blocking_call_in(text)
    assert got is None or got[0] in {"a lock", "a child process", "a thread or process to end", "an event or condition"}


def test_linear_on_a_long_adversarial_line():
    t0 = time.monotonic()
    for line in ("with " + "a" * 1_000_000, "x." + "lock" * 250_000 + ".wait", "(" * 1_000_000):
        blocking_call_in(line)
    assert time.monotonic() - t0 < 1
