"""The detector in real gloo jobs (torchrun, 2-4 ranks): the diverged rank is named seconds after the
divergent call, long before any hang timeout; correct programs are never flagged."""

from __future__ import annotations

import json
import os
import re
import textwrap
import time

from hangdoc.runtime import detect
from tests.procs import kill_group, spawn, torchrun_cmd

# Every script prints "DIVERGE_AT <time.time()>" right before its divergent call.
SKIP_BROADCAST = textwrap.dedent('''\
    import time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.ones(256)
    for step in range(200):
        if step == 150:
            print("DIVERGE_AT", time.time(), flush=True)
        dist.all_reduce(t)
        if not (step == 150 and rank == 1):  # the bug
            dist.broadcast(t, src=0)
    ''')

UNEVEN_LOOPS = textwrap.dedent('''\
    import time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.ones(16)
    steps = 59 if rank == 2 else 60   # one rank has one batch fewer
    for step in range(steps):
        dist.all_reduce(t)
    print("DIVERGE_AT", time.time(), flush=True)
    dist.barrier()
    ''')

SHAPE_MISMATCH = textwrap.dedent('''\
    import time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for step in range(80):
        n = 6 if (rank == 3 and step == 50) else 8
        if step == 50:
            print("DIVERGE_AT", time.time(), flush=True)
        dist.all_reduce(torch.ones(n))
    ''')

# A ring exchange that receives before it sends, on every rank: a receive cycle of all three.
RECV_CYCLE = textwrap.dedent('''\
    import time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.ones(16)
    for step in range(40):   # a healthy pipeline first: sends and receives that pair up
        if rank % 2 == 0:
            dist.send(x, dst=(rank + 1) % world) if rank + 1 < world else None
            dist.recv(x, src=rank - 1) if rank > 0 else None
        else:
            dist.recv(x, src=rank - 1)
            dist.send(x, dst=rank + 1) if rank + 1 < world else None
        dist.all_reduce(x)
    print("DIVERGE_AT", time.time(), flush=True)
    dist.recv(x, src=(rank - 1) % world)   # the bug: everybody receives first
    dist.send(x, dst=(rank + 1) % world)
    ''')

# A 3-stage pipeline 0 -> 1 -> 2 where rank 1 names the wrong source (2, not 0).
WRONG_PEER = textwrap.dedent('''\
    import time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    x = torch.ones(16)
    for step in range(20):
        dist.all_reduce(x)
    print("DIVERGE_AT", time.time(), flush=True)
    if rank == 0:
        dist.send(x, dst=1)
    elif rank == 1:
        dist.recv(x, src=2)   # the bug: its activation comes from rank 0
        dist.send(x, dst=2)
    else:
        dist.recv(x, src=1)
    dist.barrier()
    ''')

# Rank 1 raises between two collectives; a non-daemon thread keeps its process alive, so the others
# wait for it in the next all_reduce.
RAISES = textwrap.dedent('''\
    import threading, time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    threading.Thread(target=time.sleep, args=(120,)).start()
    t = torch.ones(32)
    for step in range(30):
        dist.all_reduce(t)
        if step == 20:
            print("DIVERGE_AT", time.time(), flush=True)
            if rank == 1:
                raise ValueError("loss is nan")
    ''')

# Rank 1 stops itself (SIGSTOP) before its 21st all_reduce. (Killed instead, it is torn down with
# the job by torchrun, 0.1 s after, before the others went quiet: examples/bugs/dead_rank.py, run by
# the bug matrix under a 0.5 s monitor interval, and tests/test_detect_gone.py cover that rule.)
STOPS = textwrap.dedent('''\
    import os, signal, time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.ones(32)
    for step in range(30):
        if step == 20:
            print("DIVERGE_AT", time.time(), flush=True)
            if rank == 1:
                os.kill(os.getpid(), signal.SIGSTOP)
        dist.all_reduce(t)
    ''')

# A correct program: several groups, p2p, async ops, object collectives, ranks that pause.
CORRECT = textwrap.dedent('''\
    import time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = pairs[rank // 2]
    evens = dist.new_group([0, 2])
    t = torch.ones(8)
    n = 0
    for step in range(350):  # odd ranks still issue over 1,000 calls; 500 steps took 20 s on 2 busy cores
        dist.all_reduce(t); n += 1
        dist.all_reduce(torch.ones(4), group=mine); n += 1
        if rank % 2 == 0:
            dist.broadcast(torch.ones(3), src=0, group=evens); n += 1
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        if rank % 2 == 0:
            dist.send(torch.ones(2), nxt); dist.recv(torch.ones(5), prv)
        else:
            dist.recv(torch.ones(2), prv); dist.send(torch.ones(5), nxt)
        ops = [dist.P2POp(dist.isend, torch.ones(1), nxt), dist.P2POp(dist.irecv, torch.ones(1), prv)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        w = dist.all_reduce(torch.ones(2), async_op=True); n += 1
        w.wait()
        if step % 100 == 0:
            dist.broadcast_object_list([{"step": step}], src=0); n += 1
            got = [None] * world
            dist.all_gather_object(got, list(range(rank + step))); n += 1  # objects differ by rank
            time.sleep(0.2 * (rank + 1))  # ranks quiet at different times
        if step % 50 == 0:
            outs = [torch.zeros(6) for _ in range(world)]
            dist.all_gather(outs, torch.ones(6)); n += 1
    from hangdoc.runtime import detect
    det = detect.get()
    node = det.node
    print("STATS", n, node.writes - node.early if node else -1, node.reads if node else -1, det.verdict is None,
          node.early if node else -1, flush=True)
    dist.barrier()
    ''')

# Two groups of all four ranks, created in the opposite order on rank 3 (torch numbers groups by
# creation order): each group's calls agree on every rank that issued them, yet ranks 0-2 wait in
# group 1 for rank 3, which waits in group 2 for them (examples/bugs/group_order.py)
GROUP_ORDER = textwrap.dedent('''\
    import time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for step in range(20):
        dist.all_reduce(torch.ones(8))
    a, b = dist.new_group([0, 1, 2, 3]), dist.new_group([0, 1, 2, 3])
    param, grad = (b, a) if rank == 3 else (a, b)   # the bug
    print("DIVERGE_AT", time.time(), flush=True)
    for step in range(5):
        dist.all_reduce(torch.ones(4), group=param)
        dist.all_reduce(torch.ones(16), group=grad)
    ''')

# gloo blocks in a mismatched collective; asynchronous calls (as NCCL's always are) go on, so the
# next collective comes and raises.
ABORT = textwrap.dedent('''\
    import time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.ones(256)
    for step in range(2000):
        if step == 20:
            print("DIVERGE_AT", time.time(), flush=True)
        if step == 20 and rank == 1:
            dist.all_reduce(t, async_op=True)  # the bug: rank 0 broadcasts here
        else:
            (dist.broadcast(t, src=0, async_op=True) if step == 20 else dist.all_reduce(t, async_op=True))
        time.sleep(0.005)
    print("NOT ABORTED", flush=True)
    ''')


def _start(tmp_path, script: str, nproc: int, *opts: str):
    path = tmp_path / "train.py"
    path.write_text(script)
    out = tmp_path / "out"
    cmd = torchrun_cmd(nproc, "-m", "hangdoc", "--detect", *opts, "--out", str(out), str(path))
    proc = spawn(cmd, cwd=str(tmp_path), stdout=open(tmp_path / "stdout.txt", "w"), stderr=open(tmp_path / "stderr.txt", "w"))
    return proc, out


def _wait_verdict(tmp_path, script: str, nproc: int, *opts: str, then: str = "", said: str = "",
                  limit: float = 45.0):
    """Run until divergence.json (and then ``then``, and ``said`` in the job's stderr) appears (or
    ``limit``), then kill the job; returns (verdict, seconds from the divergent call to the verdict,
    stdout, stderr)."""
    proc, out = _start(tmp_path, script, nproc, *opts)
    verdict = None
    try:
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                verdict = verdict or json.loads((out / "divergence.json").read_text())
                if (not then or (out / then).exists()) and (
                        not said or said in (tmp_path / "stderr.txt").read_text(errors="replace")):
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.1)
    finally:
        kill_group(proc)
    stdout, stderr = (tmp_path / "stdout.txt").read_text(), (tmp_path / "stderr.txt").read_text()
    assert verdict is not None, stderr[-3000:]
    starts = [float(x) for x in re.findall(r"DIVERGE_AT (\S+)", stdout)]
    assert starts, stdout
    latency = verdict["time"] - min(starts)
    print(f"detection latency {latency:.2f}s: {verdict['summary']}")  # shown with -s: the real figure
    return verdict, latency, stdout, stderr


def _said(stderr: str, verdict) -> None:
    line = next(line for line in stderr.splitlines() if "hangdoc: DIVERGENCE:" in line)
    assert re.match(r"\[[^\]:]+:\d+\] hangdoc: DIVERGENCE: ", line), line  # [host:rank] prefixed
    assert verdict["summary"] in line


def test_skipped_broadcast_named_within_seconds_and_dumped(tmp_path):
    # the report is printed after its file is written: the job is killed once both are there
    v, latency, _out, err = _wait_verdict(tmp_path, SKIP_BROADCAST, 2, "--detect-policy", "dump", then="report.txt",
                                          said="culprit: rank")
    assert (v["deviants"], v["agreeing"], v["index"], v["exact"]) == ([1], [0], 301, True)
    assert v["summary"].startswith("rank 1 diverged from rank 0 in default_pg at collective #301: "
                                   "all_reduce([256] float32) at train.py:8 vs broadcast([256] float32, src=0) at train.py:10")
    assert latency <= 5.0  # measured 0.15-0.3 s here; the acceptance is 2 s
    _said(err, v)
    # dump: every rank's stacks and records, and the watchdog's report naming rank 1
    files = sorted(os.listdir(tmp_path / "out"))
    assert sum(f.startswith("stacks-") for f in files) == 2 and sum(f.startswith("collectives-") for f in files) == 2, files
    assert "culprit: rank 1" in err
    # the report's headline says why it was taken: the divergence, not a hang
    assert "hangdoc: DUMP: divergence in default_pg at collective #301" in err and "hangdoc: HANG:" not in err


def test_uneven_loop_counts_majority_names_the_short_rank(tmp_path):
    v, latency, _out, err = _wait_verdict(tmp_path, UNEVEN_LOOPS, 3)
    assert (v["deviants"], v["agreeing"], v["index"], v["basis"]) == ([2], [0, 1], 59, "majority")
    assert v["summary"].startswith("rank 2 diverged from ranks 0-1 in default_pg at collective #59: barrier() at train.py:9 ")
    assert v["deviant"][1] == "barrier()" and v["deviant"][2] == "train.py:9"
    assert v["expected"][1] == "all_reduce([16] float32)" and v["expected"][2] == "train.py:7"
    assert latency <= 5.0
    _said(err, v)


def test_shape_mismatch_among_four(tmp_path):
    v, latency, _out, _err = _wait_verdict(tmp_path, SHAPE_MISMATCH, 4)
    assert (v["deviants"], v["index"], v["basis"]) == ([3], 50, "majority")
    assert len(v["agreeing"]) >= 2 and set(v["agreeing"]) <= {0, 1, 2}  # the opinions it read
    assert v["deviant"][1] == "all_reduce([6] float32)" and v["expected"][1] == "all_reduce([8] float32)"
    assert latency <= 5.0


def test_groups_entered_in_opposite_orders_name_the_odd_rank(tmp_path):
    v, latency, _out, err = _wait_verdict(tmp_path, GROUP_ORDER, 4)
    assert (v["deviants"], v["agreeing"], v["basis"]) == ([3], [0, 1, 2], "groups"), v
    assert v["group"] != v["other_group"]
    assert "rank 3 waits in all_reduce([4] float32) at train.py:10 of group" in v["summary"], v["summary"]
    assert "the ranks entered the two groups in opposite orders" in v["summary"]
    assert latency <= 10.0  # quiet 0.5 s, then the wait must stand for 2 s
    _said(err, v)


def test_receive_cycle_names_every_rank_of_it(tmp_path):
    v, latency, _out, err = _wait_verdict(tmp_path, RECV_CYCLE, 3)
    assert (v["kind"], v["deviants"], v["basis"]) == ("p2p-cycle", [0, 1, 2], "p2p"), v
    assert "(0 <- 2 <- 1 <- 0) and none sends" in v["summary"] and "at train.py:14" in v["summary"], v["summary"]
    assert latency <= 10.0  # quiet, then the wait must stand for 2 s
    _said(err, v)


def test_a_receive_from_the_wrong_peer_names_the_receiver_and_its_sender(tmp_path):
    v, latency, _out, err = _wait_verdict(tmp_path, WRONG_PEER, 3)
    assert (v["kind"], v["deviants"], v["expected_peer"]) == ("p2p-stall", [1], 0), v
    assert v["summary"].startswith("rank 1 waits in recv([16] float32, peer=2) at train.py:11 for a message from rank 2"), v
    assert ("a send of rank 0 to rank 1 is unmatched (1 sent, 0 received): rank 1 receives from the wrong peer; its "
            "message is from rank 0") in v["summary"], v["summary"]
    assert latency <= 10.0
    _said(err, v)


def test_a_rank_that_raised_is_named_with_its_exception(tmp_path):
    v, latency, _out, err = _wait_verdict(tmp_path, RAISES, 3)
    assert (v["kind"], v["deviants"], v["basis"]) == ("rank-failed", [1], "raised"), v
    assert v["summary"] == ("rank 1 raised ValueError: loss is nan at train.py:11 in <module>; its last collective was "
                            "#20 of default_pg, all_reduce([32] float32) at train.py:7: the other ranks wait for it at "
                            "their next collective"), v["summary"]
    assert latency <= 5.0
    _said(err, v)


def test_a_stopped_rank_is_named_by_a_rank_on_its_host(tmp_path):
    v, latency, _out, err = _wait_verdict(tmp_path, STOPS, 3)
    assert (v["kind"], v["deviants"], v["basis"]) == ("unresponsive-process", [1], "process"), v
    assert v["summary"].startswith("rank 1 has not issued all_reduce([32] float32) at train.py:10 (#20 of default_pg) "
                                   "that rank "), v["summary"]
    assert "is stopped (SIGSTOP, a debugger, a suspended job step)" in v["summary"]
    assert latency <= 10.0
    _said(err, v)


def test_correct_program_with_groups_and_p2p_is_never_flagged(tmp_path):
    proc, out = _start(tmp_path, CORRECT, 4)
    try:
        rc = proc.wait(timeout=90)
    finally:
        kill_group(proc)
    stdout, stderr = (tmp_path / "stdout.txt").read_text(), (tmp_path / "stderr.txt").read_text()
    assert rc == 0, stderr[-3000:]
    assert "DIVERGENCE" not in stderr and not (out / "divergence.json").exists()
    stats = [line.split()[-5:] for line in stdout.splitlines() if "STATS" in line]
    assert len(stats) == 4, stdout
    for n, writes, reads, clean, early in stats:
        assert int(n) >= 1000 and clean == "True"
        assert int(reads) > 0 and 0 < int(writes) <= 20  # compared, at a bounded rate
        # and a publication at once per signature new to the rank (its first calls), within the budget
        assert 0 < int(early) <= detect.EARLY


def test_abort_raises_in_the_main_thread_at_the_next_collective(tmp_path):
    proc, out = _start(tmp_path, ABORT, 2, "--detect-policy", "abort")
    # each rank's traceback behind one rank prefix: hangdoc's "[host:R] " (torch's "[rankR]: " is
    # left out where hangdoc's names the rank)
    pattern = re.compile(r"^\[[^\]\s]+:(\d)\] hangdoc\.runtime\.detect\.DivergenceError: hangdoc: rank 1 diverged from rank 0", re.M)
    try:
        # gloo never finishes the mismatched work queued before the abort, so the ranks raise but
        # do not exit: watch for both tracebacks, then kill the job
        deadline = time.monotonic() + 45
        while time.monotonic() < deadline and proc.poll() is None:
            if len(set(pattern.findall((tmp_path / "stderr.txt").read_text()))) == 2:
                break
            time.sleep(0.2)
    finally:
        kill_group(proc)
    stdout, stderr = (tmp_path / "stdout.txt").read_text(), (tmp_path / "stderr.txt").read_text()
    assert "NOT ABORTED" not in stdout, stderr[-2000:]
    assert sorted(set(pattern.findall(stderr))) == ["0", "1"], stderr[-3000:]  # every rank, not only the reporter
    assert re.search(r'File ".*train\.py", line 11, in <module>', stderr)  # raised at the user's call
    v = json.loads((out / "divergence.json").read_text())
    assert (v["deviants"], v["index"], v["exact"]) == ([1], 20, True)
    assert v["deviant"][1:] == ["all_reduce([256] float32)", "train.py:9", 20]  # first seen there: new
