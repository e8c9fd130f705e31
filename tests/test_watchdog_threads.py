"""The watchdog and the job's other threads: a thread that died of an exception heads the stall's
dump (a real process), and a rank that never made progress dumps once another rank reported a stall
(its first call stuck: a broadcast from a root nobody else names)."""

from __future__ import annotations

import glob
import subprocess
import sys
import textwrap
import time

from hangdoc.runtime import exchange
from hangdoc.runtime.watchdog import Watchdog
from tests.procs import env_for

JOB = textwrap.dedent('''
    import queue, sys, threading, time
    from hangdoc.runtime import watchdog

    watchdog.start(hang_timeout=1.0, out_dir=sys.argv[1], record=False, report=False)
    batches = queue.Queue()

    def prefetch():
        for i in range(3):
            if i == 2:
                raise ValueError("truncated record 17")
            batches.put(i)

    threading.Thread(target=prefetch, name="prefetch").start()
    for _ in range(3):
        watchdog.step()
        batches.get()  # the third never comes: the thread that would put it is dead
''')


def test_a_dead_threads_traceback_heads_the_stall_dump(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, str(script), str(out)], env=env_for(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, start_new_session=True)
    try:
        end = time.monotonic() + 60
        while time.monotonic() < end and not glob.glob(str(out / "stacks-*.txt")):
            time.sleep(0.1)
        time.sleep(0.3)
    finally:
        p.kill()
        p.wait(10)
    [stacks] = glob.glob(str(out / "stacks-*.txt"))
    text = open(stacks).read()
    assert "Exception in thread prefetch:" in text and "ValueError: truncated record 17" in text
    assert text.index("Exception in thread") < text.index("most recent call first")  # before the threads
    assert b"ValueError: truncated record 17" in p.stderr.read()  # Python's own report still printed
    from hangdoc.readers import read_paths

    [proc] = read_paths([stacks]).processes
    assert "truncated record 17" in proc.meta.get("exception", "")


class FakeStore:
    def __init__(self):
        self.keys = set()

    def check(self, keys):
        return all(k in self.keys for k in keys)


def test_a_rank_without_progress_dumps_once_another_rank_reported_a_stall(tmp_path, monkeypatch):
    store = FakeStore()
    monkeypatch.setattr(exchange, "job_store", lambda: store)
    dog = Watchdog(hang_timeout=0.2, out_dir=str(tmp_path), record=False, report=True, startup_grace=60)
    dog._store_ready = True
    dumps = []
    monkeypatch.setattr(dog, "dump_now", lambda reason="": dumps.append(reason) or ())
    monkeypatch.setattr(exchange, "share", lambda *a, **k: None)
    dog._seen = dog._progress()
    time.sleep(0.3)
    dog._tick()
    assert dumps == []  # past the timeout, but in its startup grace and nobody reported anything
    store.keys.add(exchange.CLAIM)  # a rank took the report of a stall over
    dog._peer_look = 0.0
    dog._tick()
    assert len(dumps) == 1 and dumps[0].startswith("no progress for")
