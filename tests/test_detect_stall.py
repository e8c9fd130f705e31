"""A rank stalled outside any collective (hangdoc.runtime.detect_stall): real DataLoader workers
blocked in the kernel or computing, a real thread that died, real gloo jobs under ``--detect``."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from hangdoc.runtime import detect_stall
from tests.test_detect_gloo import _said, _wait_verdict

# The main thread iterates a DataLoader (one worker); batch 2's sample blocks in the worker: on a FIFO
# nobody writes to (MODE=fifo), or in a busy loop (MODE=busy). A looker thread runs the Watch (1 s)
# and prints what it found, or null after 6 s.
LOOKER = textwrap.dedent('''\
    import json, os, queue, signal, sys, tempfile, threading, time
    import torch
    from torch.utils.data import DataLoader, Dataset
    from hangdoc.runtime import detect_stall

    MODE = sys.argv[1]
    FIFO = os.path.join(tempfile.mkdtemp(), "never")
    os.mkfifo(FIFO)

    class Slow(Dataset):
        def __len__(self):
            return 16
        def __getitem__(self, i):
            if i == 4 and MODE == "fifo":
                with open(FIFO, "rb") as f:
                    f.read(1)
            if i == 4 and MODE == "busy":
                end = time.time() + 30
                while time.time() < end:
                    pass
            return torch.zeros(2)

    def look():
        watch, end, found = detect_stall.Watch(), time.monotonic() + 6, None
        while time.monotonic() < end and found is None:
            found = watch.look(time.monotonic(), 1.0)
            time.sleep(0.25)
        if found is not None:
            found.pop("key")
        print(json.dumps(found), flush=True)
        os.killpg(0, signal.SIGKILL)  # with the worker: it holds our stdout too

    detect_stall.install()
    if MODE == "thread":
        q = queue.Queue()
        def produce():
            q.put(1)
            raise ValueError("truncated record")
        threading.Thread(target=produce, name="prefetch").start()
    if MODE == "ended":  # the producer returns without setting the event, and without an exception
        ready = threading.Event()
        threading.Thread(target=lambda: None, name="prefetch").start()
    if MODE == "queue":  # a live producer that is only slow: no thread died
        q = queue.Queue()
        threading.Thread(target=lambda: (time.sleep(20), q.put(1)), daemon=True).start()
    threading.Thread(target=look, name="hangdoc-test-looker", daemon=True).start()
    if MODE == "sleep":
        time.sleep(30)
    if MODE == "spin":
        n = 0
        while n >= 0:
            n += 1
    if MODE == "child":
        import subprocess
        p = subprocess.Popen([sys.executable, "-c", "print('x' * 300000)"], stdout=subprocess.PIPE)
        p.wait()
    if MODE == "ended":
        ready.wait()
    if MODE in ("thread", "queue"):
        while True:
            q.get()
    for batch in DataLoader(Slow(), batch_size=2, num_workers=1):
        pass
    ''')


def _look(tmp_path, mode):
    path = tmp_path / "looker.py"
    path.write_text(LOOKER)
    # its own session: the worker it leaves behind dies with the group
    proc = subprocess.Popen([sys.executable, str(path), mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        from tests.procs import kill_group

        kill_group(proc)
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines, err[-2000:]
    return json.loads(lines[-1]), err


def test_a_worker_asleep_in_the_kernel_is_a_stall_of_its_batch(tmp_path):
    found, _err = _look(tmp_path, "fifo")
    assert found is not None
    assert (found["what"], found["batch"], found["worker"]) == ("dataloader", 2, 0), found
    assert found["site"] == "looker.py:62" and found["waited"] >= 1.0 and found["cpu"] < 0.2, found
    assert found["wchan"] != "?", found  # the kernel says where it sleeps (a FIFO's open here)


def test_a_worker_that_computes_is_slow_not_stalled(tmp_path):
    found, _err = _look(tmp_path, "busy")
    assert found is None


def test_a_thread_that_died_while_the_main_thread_waits_on_its_queue(tmp_path):
    found, err = _look(tmp_path, "thread")
    assert found is not None and found["what"] == "thread", found
    assert found["error"][:3] == ["prefetch", "ValueError: truncated record", "looker.py:38"], found
    assert found["site"] == "looker.py:61" and found["code"] == "q.get()", found
    assert "ValueError: truncated record" in err  # Python's own hook still printed it


def test_a_wait_no_thread_is_left_to_end(tmp_path):
    found, _err = _look(tmp_path, "ended")
    assert found is not None and found["what"] == "thread" and "error" not in found, found
    assert found["code"] == "ready.wait()", found


@pytest.mark.parametrize("mode,how,code", [("sleep", "sleep", ["time.sleep(30)"]), ("spin", "run", ["n += 1", "while n >= 0:"]),
                                           ("child", "child", ["p.wait()"])])
def test_a_main_thread_standing_in_its_own_frame(tmp_path, mode, how, code):
    found, _err = _look(tmp_path, mode)
    assert found is not None and (found["what"], found["how"]) == ("frame", how) and found["code"] in code, found
    if mode == "spin":
        assert found["cpu"] >= 0.1, found  # busy: its own CPU time grew (by how much depends on the load)
    if mode == "child":
        assert found["child"] > 0, found  # blocked writing to the pipe it never reads


def test_a_wait_on_a_live_producer_is_not_a_stall(tmp_path):
    found, _err = _look(tmp_path, "queue")
    assert found is None


def test_the_wait_asked_for_grows_with_the_loops_own_pauses():
    assert detect_stall.threshold([]) == detect_stall.STALL
    assert detect_stall.threshold([0.0, 0.1, 0.2]) == detect_stall.STALL
    assert detect_stall.threshold([0.0, 10.0, 10.1]) == pytest.approx(30.0)


# Real jobs (2-3 gloo ranks): the others wait in all_reduce for the stalled rank.
STUCK_WORKER = textwrap.dedent('''\
    import os, tempfile, time, torch, torch.distributed as dist
    from torch.utils.data import DataLoader, Dataset
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    fifo = os.path.join(tempfile.mkdtemp(), "remote")
    os.mkfifo(fifo)

    class Remote(Dataset):
        def __len__(self):
            return 64
        def __getitem__(self, i):
            if rank == 1 and i == 40:
                with open(fifo, "rb") as f:
                    f.read(1)
            return torch.full((4,), float(i))

    for step, batch in enumerate(DataLoader(Remote(), batch_size=4, num_workers=1)):
        if step == 9:
            print("DIVERGE_AT", time.time(), flush=True)
        dist.all_reduce(batch)
    ''')

DEAD_PREFETCH = textwrap.dedent('''\
    import queue, threading, time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    batches = queue.Queue(maxsize=2)

    def prefetch():
        for i in range(30):
            if rank == 2 and i == 12:
                raise OSError("remote shard unreadable")
            batches.put(torch.full((8,), float(i)))

    threading.Thread(target=prefetch, name="prefetch", daemon=True).start()
    for step in range(30):
        if step == 12:
            print("DIVERGE_AT", time.time(), flush=True)
        x = batches.get()
        dist.all_reduce(x)
    ''')


def test_a_rank_waiting_for_its_stuck_worker_is_a_dataloader_stall(tmp_path):
    v, latency, _out, err = _wait_verdict(tmp_path, STUCK_WORKER, 2)
    assert (v["kind"], v["deviants"], v["agreeing"], v["basis"]) == ("dataloader-stall", [1], [0], "stall"), v
    assert v["summary"].startswith("rank 1 waits at train.py:17 for batch 10 from its DataLoader worker 0 (pid "), v
    assert "rank 0 waits for it in all_reduce([4,4] float32) at train.py:20 (#10 of default_pg)" in v["summary"], v
    assert latency <= 15.0
    _said(err, v)


def test_a_rank_whose_prefetch_thread_died_failed(tmp_path):
    v, latency, _out, err = _wait_verdict(tmp_path, DEAD_PREFETCH, 3)
    assert (v["kind"], v["deviants"], v["agreeing"], v["basis"]) == ("rank-failed", [2], [0, 1], "stall"), v
    assert v["summary"].startswith("rank 2: thread 'prefetch' died of OSError: remote shard unreadable at "
                                   "train.py:9; the main thread has waited at train.py:16 (`x = batches.get()`)"), v
    assert "ranks 0-1 wait for it in all_reduce([8] float32) at train.py:17 (#" in v["summary"], v
    assert latency <= 15.0
    _said(err, v)


# Rank 1's worker sleeps 14 s once (a remote read that was only slow): reported as a stall at ~4 s,
# then withdrawn when rank 1 goes on; under the abort policy the job still ends normally.
SLOW_WORKER = STUCK_WORKER.replace('''            with open(fifo, "rb") as f:
                f.read(1)''', '''            time.sleep(14)''')


def test_a_stall_that_ends_is_withdrawn_and_never_aborts(tmp_path):
    from tests.procs import kill_group
    from tests.test_detect_gloo import _start

    assert SLOW_WORKER != STUCK_WORKER
    proc, out = _start(tmp_path, SLOW_WORKER, 2, "--detect-policy", "abort")
    try:
        rc = proc.wait(timeout=90)
    finally:
        kill_group(proc)
    err = (tmp_path / "stderr.txt").read_text(errors="replace")
    assert rc == 0, err[-3000:]
    v = json.loads((out / "divergence.json").read_text())
    assert (v["kind"], v["deviants"], v["basis"]) == ("dataloader-stall", [1], "stall"), v
    assert 1.0 <= v["resumed_after"] <= 11.0, v  # stalled at 4 s (later under load), went on at 14 s
    line = next(line for line in err.splitlines() if "hangdoc: RESUMED:" in line)
    assert "rank 1 went on " in line and "slow, not hung (withdrawn: rank 1 waits at train.py:16" in line, line
    assert "DivergenceError" not in err


# Rank 1 stands in its own loop (asleep) until a file appears; the test then kills rank 0 and makes
# the file: rank 1 goes on into an all_reduce that can never complete. Its main thread moved and it
# issued a call, but the job did not go on: no RESUMED (what a launcher's kill used to look like,
# its child dying first under `proc.wait()`).
STANDING = textwrap.dedent('''\
    import os, sys, time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    print("PID", rank, os.getpid(), flush=True)
    release = sys.argv[1]
    t = torch.ones(4)
    for step in range(40):
        if step == 5 and rank == 1:
            print("DIVERGE_AT", time.time(), flush=True)
            while not os.path.exists(release):
                time.sleep(0.02)
        dist.all_reduce(t)
    ''')


def test_a_stall_whose_rank_moves_on_into_a_call_that_never_completes_is_not_withdrawn(tmp_path):
    import os
    import re
    import signal
    import time

    from tests.procs import kill_group, spawn, torchrun_cmd

    path = tmp_path / "train.py"
    path.write_text(STANDING)
    out, release = tmp_path / "out", tmp_path / "release"
    cmd = torchrun_cmd(2, "-m", "hangdoc", "--detect", "--out", str(out), str(path), str(release))
    proc = spawn(cmd, cwd=str(tmp_path), stdout=open(tmp_path / "stdout.txt", "w"), stderr=open(tmp_path / "stderr.txt", "w"))
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (out / "divergence.json").exists():
            time.sleep(0.1)
        assert (out / "divergence.json").exists(), (tmp_path / "stderr.txt").read_text()[-3000:]
        pids = dict(re.findall(r"PID (\d) (\d+)$", (tmp_path / "stdout.txt").read_text(), re.M))
        os.kill(int(pids["0"]), signal.SIGKILL)
        release.write_text("")
        proc.wait(timeout=60)
    finally:
        kill_group(proc)
    err = (tmp_path / "stderr.txt").read_text(errors="replace")
    v = json.loads((out / "divergence.json").read_text())
    assert (v["deviants"], v["basis"]) == ([1], "stall"), v
    assert "hangdoc: RESUMED:" not in err and "resumed_after" not in v, err[-3000:]
