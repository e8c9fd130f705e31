"""Threads waiting for each other's locks in a cycle (hangdoc.runtime.detect_lock_order), on real
deadlocked threads running code from real source files, and the detector naming it in a real job."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time

from hangdoc.runtime import detect_lock_order
from hangdoc.runtime.detect_digest import Digests, Verdict
from tests.procs import module_from_source

SOURCE = textwrap.dedent('''
    import threading, time

    A = threading.Lock()
    B = threading.Lock()
    C = threading.Lock()


    def take(first, second, ready, go):
        with first:
            ready.set()
            go.wait(10)
            with second:
                pass


    def hold(lock, seconds, ready):
        with lock:
            ready.set()
            time.sleep(seconds)


    def wait_for(lock):
        with lock:
            pass
''')


def start(target, *args):
    def run():
        try:
            target(*args)
        except RuntimeError:  # released from outside: the ``with`` finds it unlocked at its end
            pass

    t = threading.Thread(target=run, daemon=True, name=f"t-{target.__name__}-{len(args)}")
    t.start()
    return t


def blocked_on(t, lock, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        frame = sys._current_frames().get(t.ident)
        if frame is not None and frame.f_code.co_name in ("take", "wait_for") and lock.locked():
            time.sleep(0.05)
            return
        time.sleep(0.01)
    raise AssertionError("the thread never blocked")


def deadlock(mod, pairs):
    """Threads each taking its pair's first lock, then (all holding one) its second: a cycle."""
    go = threading.Event()
    threads = []
    for first, second in pairs:
        ready = threading.Event()
        threads.append(start(mod.take, first, second, ready, go))
        assert ready.wait(10)
    go.set()
    for t, (_, second) in zip(threads, pairs):
        blocked_on(t, second)
    return threads


def free(threads, *locks):
    for _ in range(3):
        for lock in locks:
            if lock.locked():
                lock.release()
        time.sleep(0.05)
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads)


def test_two_threads_taking_two_locks_in_opposite_orders_are_a_cycle(tmp_path):
    mod = module_from_source(tmp_path, "abba_a", SOURCE)
    threads = deadlock(mod, [(mod.A, mod.B), (mod.B, mod.A)])
    try:
        found = detect_lock_order.cycle(sys._current_frames(), threads[0].ident)
    finally:
        free(threads, mod.A, mod.B)
    assert found is not None and len(found) == 2
    first, second = found
    assert (first["thread"], first["holder"], second["thread"], second["holder"]) == (
        threads[0].ident, threads[1].ident, threads[1].ident, threads[0].ident)
    assert (first["lock"], first["at"], first["in"], first["held_at"]) == ("second", "abba_a.py:13", "take", "abba_a.py:10")
    v = detect_lock_order.verdict(2, [dict(s, thread="the main thread" if i == 0 else "thread 'x'",
                                          holder="thread 'x'" if i == 0 else "the main thread")
                                      for i, s in enumerate(found)], Digests(), lambda rec: ("", ""))
    assert (v.kind, v.deviants, v.basis) == ("collective-mismatch", [2], "lock")
    assert v.summary.startswith("rank 2 is deadlocked between its own threads: the main thread waits for `second` at "
                                "abba_a.py:13 in take, held by thread 'x' (taken at abba_a.py:10 in take)")
    assert Verdict.from_json(v.to_json()).summary == v.summary


def test_three_threads_in_a_ring_and_a_thread_waiting_into_it(tmp_path):
    mod = module_from_source(tmp_path, "abba_b", SOURCE)
    threads = deadlock(mod, [(mod.A, mod.B), (mod.B, mod.C), (mod.C, mod.A)])
    late = start(mod.wait_for, mod.B)  # not on the ring, waits for a lock held on it
    blocked_on(late, mod.B)
    try:
        frames = sys._current_frames()
        ring = detect_lock_order.cycle(frames, threads[2].ident)
        lead = detect_lock_order.cycle(frames, late.ident)
    finally:
        free(threads + [late], mod.A, mod.B, mod.C)
    assert [s["thread"] for s in ring] == [threads[2].ident, threads[0].ident, threads[1].ident]
    # late waits for B, which the second thread holds; round the ring back to it
    assert [s["thread"] for s in lead] == [late.ident, threads[1].ident, threads[2].ident, threads[0].ident]
    assert lead[-1]["holder"] == threads[1].ident


def test_a_holder_that_is_not_waiting_for_a_lock_is_no_cycle(tmp_path):
    mod = module_from_source(tmp_path, "abba_c", SOURCE)
    ready = threading.Event()
    holder = start(mod.hold, mod.A, 3.0, ready)
    assert ready.wait(10)
    waiter = start(mod.wait_for, mod.A)
    blocked_on(waiter, mod.A)
    try:
        frames = sys._current_frames()
        assert detect_lock_order.cycle(frames, waiter.ident) is None  # the holder sleeps: it may let go
        assert detect_lock_order.cycle(frames, holder.ident) is None  # sleeping, waits for no lock
        assert detect_lock_order.cycle(frames, threading.get_ident()) is None  # this thread runs
    finally:
        free([holder, waiter])


JOB = textwrap.dedent('''
    import os, sys, threading, time
    import hangdoc
    import torch.distributed as dist

    A = threading.Lock()
    B = threading.Lock()


    def exporter():
        with B:
            time.sleep(0.5)
            with A:
                pass


    def main():
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        t = __import__("torch").ones(4)
        dist.all_reduce(t)
        if rank == 1:
            threading.Thread(target=exporter, name="metrics-exporter", daemon=True).start()
            with A:
                time.sleep(0.5)
                with B:
                    pass
        dist.all_reduce(t)
        dist.destroy_process_group()


    hangdoc.wrap(main, detect=True, out=sys.argv[1])()
''')


def test_the_detector_names_the_rank_whose_threads_deadlock(tmp_path):
    """A real two-rank gloo job: rank 1's main thread and its exporter take two locks in opposite
    orders; rank 0 waits in all_reduce. The detector names rank 1 and both threads."""
    from tests.procs import kill_group, spawn, torchrun_cmd

    script = tmp_path / "abba_job.py"
    script.write_text(JOB)
    out = tmp_path / "out"
    p = spawn(torchrun_cmd(2, str(script), str(out)), stderr=subprocess.STDOUT)
    found = out / "divergence.json"
    try:
        end = time.monotonic() + 90
        while time.monotonic() < end and not found.exists() and p.poll() is None:
            time.sleep(0.2)
    finally:
        kill_group(p)
    assert found.exists(), p.stdout.read()[-3000:]
    v = json.loads(found.read_text())
    text = json.dumps(v)
    assert "rank 1 is deadlocked between its own threads" in text
    assert "metrics-exporter" in text and "the main thread" in text
