"""A thread waiting for a lock it holds itself (hangdoc.runtime.detect_lock), on real blocked threads
running code from real source files."""

from __future__ import annotations

import sys
import textwrap
import threading
import time

from hangdoc.runtime import detect_lock
from hangdoc.runtime.detect_digest import Digests, Verdict
from tests.procs import module_from_source

SOURCE = textwrap.dedent('''
    import threading, time

    STATS_LOCK = threading.Lock()


    class Box:
        lock = threading.Lock()


    def record():
        with STATS_LOCK:
            pass


    def update_stats():
        with STATS_LOCK:
            record()


    def explicit():
        with Box.lock:
            Box.lock.acquire()


    def make_callback():
        with STATS_LOCK:
            def callback():
                with STATS_LOCK:
                    pass
            return callback


    def hold(seconds):
        with STATS_LOCK:
            time.sleep(seconds)
''')


def load(tmp_path, name):
    return module_from_source(tmp_path, name, SOURCE)


def blocked(target, lock):
    """Run ``target`` in a thread until it blocks on ``lock``; returns (thread, its innermost frame)."""
    def run():
        try:
            target()
        except RuntimeError:  # released from outside below: the outer ``with`` finds it unlocked
            pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    end = time.monotonic() + 10
    while time.monotonic() < end:
        frame = sys._current_frames().get(t.ident)
        if frame is not None and lock.locked() and frame.f_code.co_name not in ("run", "target"):
            time.sleep(0.05)
            return t, sys._current_frames().get(t.ident)
        time.sleep(0.01)
    raise AssertionError("the thread never blocked")


def release(t, lock):
    lock.release()
    t.join(5)
    assert not t.is_alive()


def test_a_lock_taken_twice_through_two_functions_is_a_self_deadlock(tmp_path):
    mod = load(tmp_path, "stats_a")
    t, frame = blocked(mod.update_stats, mod.STATS_LOCK)
    try:
        found = detect_lock.self_deadlock(frame)
    finally:
        release(t, mod.STATS_LOCK)
    assert found == {"lock": "STATS_LOCK", "at": "stats_a.py:12", "in": "record", "held_at": "stats_a.py:17",
                     "held_in": "update_stats"}
    v = detect_lock.verdict(2, found, Digests(), lambda rec: ("", ""))
    assert (v.kind, v.deviants, v.basis) == ("collective-mismatch", [2], "lock")
    assert v.summary.startswith("rank 2 waits for the lock `STATS_LOCK` at stats_a.py:12 in record, which its own "
                                "thread took at stats_a.py:17 in update_stats and still holds: a self-deadlock")
    assert Verdict.from_json(v.to_json()).summary == v.summary


def test_acquire_inside_with_on_a_class_attribute(tmp_path):
    mod = load(tmp_path, "stats_b")
    t, frame = blocked(mod.explicit, mod.Box.lock)
    try:
        found = detect_lock.self_deadlock(frame)
    finally:
        release(t, mod.Box.lock)
    assert found is not None and found["in"] == found["held_in"] == "explicit"
    assert found["lock"] in ("Box.lock", "the lock")  # ast.unparse is 3.9+


def test_a_lock_held_by_another_thread_or_a_def_inside_a_with_is_no_self_deadlock(tmp_path):
    mod = load(tmp_path, "stats_c")
    callback = mod.make_callback()
    holder, _ = blocked(lambda: mod.hold(2), mod.STATS_LOCK)  # another thread holds it, sleeping
    t, frame = blocked(mod.record, mod.STATS_LOCK)
    # callback's line lies inside make_callback's ``with`` body, but it runs in a function of its own
    t2, frame2 = blocked(callback, mod.STATS_LOCK)
    try:
        assert frame.f_code.co_name == "record" and frame2.f_code.co_name == "callback"
        assert detect_lock.self_deadlock(frame) is None
        assert detect_lock.self_deadlock(frame2) is None
        assert detect_lock.self_deadlock(sys._current_frames()[holder.ident]) is None  # sleeping, not acquiring
    finally:
        mod.STATS_LOCK.release()
        for th in (t, t2, holder):
            th.join(10)


def test_an_unreadable_or_vanished_source_says_nothing(tmp_path):
    mod = load(tmp_path, "stats_d")
    t, frame = blocked(mod.update_stats, mod.STATS_LOCK)
    try:
        (tmp_path / "stats_d.py").unlink()
        detect_lock._index.cache_clear()
        detect_lock._source.cache_clear()
        assert detect_lock.self_deadlock(frame) is None
        (tmp_path / "stats_d.py").mkdir()  # not a regular file
        assert detect_lock.self_deadlock(frame) is None
    finally:
        release(t, mod.STATS_LOCK)
    assert detect_lock.main_thread_deadlock() is None  # called from the main thread: nothing
