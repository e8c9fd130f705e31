"""A child forked while another thread held a lock (hangdoc.runtime.detect_fork): real forks, a real
child blocked on the inherited lock, the real main thread waiting for it."""

from __future__ import annotations

import os
import signal
import textwrap
import threading
import time

import pytest

from hangdoc.runtime import detect_fork
from hangdoc.runtime.detect_digest import Digests, Verdict
from tests.procs import module_from_source

SOURCE = textwrap.dedent('''
    import os, threading

    STATS_LOCK = threading.Lock()


    def flush(holding, stop):
        with STATS_LOCK:
            holding.set()
            stop.wait(30)


    def wait_for(pid):
        return os.waitpid(pid, 0)
''')

pytestmark = pytest.mark.skipif(not hasattr(os, "register_at_fork"), reason="os.register_at_fork: POSIX")


def load(tmp_path, name):
    return module_from_source(tmp_path, name, SOURCE)


def fork_and_wait(mod, child_takes_lock, hold=True):
    """Fork (a thread holding STATS_LOCK when ``hold``), the child taking the lock or exiting; the main
    thread waits for it in ``wait_for`` while a looker thread runs the detector's Watch; returns what
    the Watch found (None within 4 s) and the child's pid."""
    holding, stop = threading.Event(), threading.Event()
    holder = threading.Thread(target=mod.flush, args=(holding, stop), name="metrics", daemon=True)
    if hold:
        holder.start()
        assert holding.wait(10)
    detect_fork.install()
    try:
        pid = os.fork()
        if pid == 0:  # the child: block on the inherited lock, or leave at once
            try:
                if child_takes_lock:
                    with mod.STATS_LOCK:
                        pass
                else:
                    time.sleep(30)
            finally:
                os._exit(0)
        found = {}

        def look():
            try:
                watch, end = detect_fork.Watch(), time.monotonic() + 4
                while time.monotonic() < end:
                    v = watch.look(time.monotonic())
                    if v is not None:
                        found["v"] = v
                        return
                    time.sleep(0.25)
            finally:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:  # it went through and was reaped
                    pass

        looker = threading.Thread(target=look, daemon=True)
        looker.start()
        mod.wait_for(pid)  # the main thread waits for its child, as the rank does
        looker.join(10)
        return found.get("v"), pid
    finally:
        detect_fork.uninstall()
        stop.set()
        if hold:
            holder.join(10)


def test_a_child_forked_while_a_thread_held_a_lock_blocks_on_it_and_is_named(tmp_path):
    mod = load(tmp_path, "forky_a")
    before = len(detect_fork.hazards())
    v, pid = fork_and_wait(mod, child_takes_lock=True)
    assert v is not None, detect_fork.hazards()
    assert v["child"] == pid and v["waiting"] == "child" and not v["dataloader"]
    assert v["held"] == [{"lock": "STATS_LOCK", "thread": "metrics", "held_at": "forky_a.py:10", "held_in": "flush"}]
    assert v["forked_at"].startswith("test_detect_fork.py:") and len(detect_fork.hazards()) == before + 1
    verdict = detect_fork.verdict(1, v, Digests(), lambda rec: ("", ""))
    assert (verdict.kind, verdict.deviants, verdict.basis) == ("collective-mismatch", [1], "fork")
    assert verdict.summary.startswith(f"rank 1 waits for its child process (pid {pid}), blocked on a lock: it was "
                                      f"forked at {v['forked_at']} while thread 'metrics' held `STATS_LOCK` (taken at "
                                      f"forky_a.py:10 in flush)"), verdict.summary
    assert Verdict.from_json(verdict.to_json()).summary == verdict.summary
    assert detect_fork.verdict(1, dict(v, dataloader=True), Digests(), lambda rec: ("", "")).kind == "dataloader-stall"


def test_no_lock_held_at_fork_or_a_child_not_blocked_on_one_says_nothing(tmp_path):
    mod = load(tmp_path, "forky_b")
    detect_fork._state["hazards"].clear()
    v, _pid = fork_and_wait(mod, child_takes_lock=True, hold=False)  # nothing held: the child goes through
    assert v is None and detect_fork.hazards() == []
    v, _pid = fork_and_wait(mod, child_takes_lock=False)  # held at fork, but the child sleeps (not a futex)
    assert v is None and len(detect_fork.hazards()) == 1


def test_paused_watch_notes_nothing(tmp_path):
    mod = load(tmp_path, "forky_c")
    detect_fork._state["hazards"].clear()
    holding, stop = threading.Event(), threading.Event()
    holder = threading.Thread(target=mod.flush, args=(holding, stop), daemon=True)
    holder.start()
    holding.wait(10)
    try:
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
    finally:
        stop.set()
        holder.join(10)
    assert detect_fork.hazards() == []  # not installed, or uninstalled: the hook does nothing


def test_only_a_child_started_at_a_noted_fork_is_blamed(monkeypatch):
    """A fork with a lock held long ago (its child went through) says nothing about a child started
    later that sits in a futex wait for another reason: the child's start must match the fork."""
    noted = {"held": [{"lock": "L", "thread": "t", "held_at": "x.py:3", "held_in": "f"}], "forked_at": "x.py:9",
             "forked_in": "main", "dataloader": False, "time": 1000.0}
    monkeypatch.setitem(detect_fork._state, "hazards", [noted])
    monkeypatch.setattr(detect_fork, "main_waits_for_child", lambda: "child")
    for started, named in ((1000.3, True), (1000.0 + 60, False)):
        monkeypatch.setattr(detect_fork, "blocked_children", lambda started=started: {4242: started})
        watch = detect_fork.Watch()
        assert watch.look(10.0) is None  # seen once: not yet
        found = watch.look(11.5)
        assert (found is not None) == named, found
        if named:
            assert found["child"] == 4242 and found["forked_at"] == "x.py:9"
