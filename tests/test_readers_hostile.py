"""Hostile input (issue 20): one number, one odd file or one odd byte never costs the diagnosis.

Each test builds the hostile input, runs ``hangdoc aggregate`` (or ``read_paths``) on it in a child
process with a hard timeout and an address-space cap, and checks that it finished quickly, with a
one-line ``file:line`` error for the bad part and the rest of the input still used. Before the fix
these hung (FIFO, ``/dev/zero``), ran out of memory (``world_size=9999999999999``), took seconds
(1,048,576 declared ranks, a 1M-frame stack) or lost a whole file (a 5,000-digit number).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import textwrap

import pytest

from tests.procs import env_for, run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "dumps")
PLAIN = os.path.join(FIXTURES, "dataloader_deadlock", "with-workers", "trace-node1.out")
PYSPY = ('Process {pid}: python train.py\nPython v3.11.7 (/usr/bin/python3.11)\n\n'
         'Thread {pid} (idle): "MainThread"\n    all_reduce (torch/distributed/distributed_c10d.py:3252)\n    main (train.py:40)\n')
#: address space of the child (a blow-up is a MemoryError there, not a machine out of memory)
AS_LIMIT = 1 << 30


def _limit() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))


def aggregate(*args: str, timeout: float = 20):
    """``hangdoc aggregate --format json ARGS`` in a child with a hard timeout and 1 GiB of address space."""
    res = run([sys.executable, "-m", "hangdoc", "aggregate", "--format", "json", *args], timeout=timeout,
              env=env_for(), cwd=ROOT, preexec_fn=_limit)
    assert not res.timed_out, f"aggregate still running after {timeout} s"
    return res


def report_of(res):
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout)


# The child's own peak RSS: VmHWM starts afresh at exec (ru_maxrss keeps the forking parent's, a
# pytest process of 200 MB).
HWM = """
def hwm_mb():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:")) / 1024
"""


def read_in_child(code: str, timeout: float = 20) -> dict:
    """Run ``code`` (which sets ``out``) after ``from hangdoc.readers import read_paths``; return ``out``."""
    prog = "import json\nfrom hangdoc.readers import read_paths\n" + HWM + textwrap.dedent(code) + "\nprint(json.dumps(out))\n"
    res = run([sys.executable, "-c", prog], timeout=timeout, env=env_for(), cwd=ROOT, preexec_fn=_limit)
    assert not res.timed_out, f"still reading after {timeout} s"
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


# --- 1. numbers that would enumerate the world -------------------------------------------------


def test_a_tag_line_world_size_of_ten_trillion_is_refused_not_enumerated(tmp_path):
    (tmp_path / "trace-n1.out").write_text("# hangdoc process host=n1 pid=42 rank=0 world_size=9999999999999\n" + PYSPY.format(pid=42))
    (tmp_path / "trace-n2.out").write_text("# hangdoc process host=n2 pid=43 rank=1 world_size=4\n" + PYSPY.format(pid=43))
    res = aggregate(str(tmp_path), timeout=20)
    rep = report_of(res)
    # the absurd world size is left out; the other dump's says 4: ranks 2-3 are missing
    assert rep["world_size"] == 4 and rep["missing_ranks"] == "2-3"
    assert res.elapsed < 10


def test_a_million_declared_ranks_are_reasoned_about_as_runs(tmp_path):
    recs = tmp_path / "collectives-n1-r0-7.jsonl"
    recs.write_text(json.dumps({"hangdoc": "collectives", "version": 1, "host": "n1", "rank": 0, "pid": 7,
                                "world_size": 1 << 20}) + "\n" + json.dumps({"rank": 0, "seq": 0, "op": "barrier"}) + "\n")
    res = aggregate(str(recs), timeout=30)
    rep = report_of(res)
    head = rep["findings"][0]
    assert head["kind"] == "missing-rank" and "ranks 1-1048575" in head["summary"]
    # every missing rank is in the summary and in missing_ranks; culprits name a bounded number
    assert len(head["culprits"]) == 10_000 and any("first 10000 of the 1048575" in e for e in head["evidence"])
    assert res.elapsed < 8, f"{res.elapsed:.1f} s"  # wall time, interpreter start included; > 10 s before


def test_rankset_arithmetic_never_enumerates():
    from hangdoc.ranges import RankSet, compress_ranks, describe_ranks

    s = RankSet.missing(10 ** 15, {0, 7, 10 ** 12})
    assert len(s) == 10 ** 15 - 3 and 5 in s and 7 not in s and (10 ** 12 + 1) in s
    assert compress_ranks(s) == "1-6,8-999999999999,1000000000001-999999999999999"
    assert s.minus(RankSet([(1, 6)])).runs[0] == (8, 10 ** 12 - 1)
    assert describe_ranks(s, max_runs=1) == f"ranks 1-6 … and {10 ** 15 - 9} more"
    assert RankSet.missing(4, [0, 2]) == [1, 3] and s.first(3) == [1, 2, 3]


# --- 4. Python's 4,300-digit int() limit -------------------------------------------------------

BIG = "9" * 5000


@pytest.mark.parametrize("name,text", [
    ("pyspy-process", f"Process {BIG}: python t.py\nPython v3.11.7 (/usr/bin/python3.11)\n\nThread 42 (idle): \"MainThread\"\n    main (t.py:3)\n"),
    ("pyspy-frame", f'Thread 42 (idle): "MainThread"\n    main (t.py:{BIG})\n'),
    ("faulthandler", f'Thread 0x00007f (most recent call first):\n  File "t.py", line {BIG} in main\n'),
    ("traceback", f'Traceback (most recent call last):\n  File "t.py", line {BIG}, in main\nValueError: x\n'),
    ("prefix", f"[rank{BIG}]:Thread 0x00007f (most recent call first):\n[rank1]:  File \"t.py\", line 3 in main\n"),
    ("elastic", f"  host      : n1\n  rank      : {BIG} (local_rank: 1)\n  exitcode  : 1 (pid: {BIG})\n"
                "Thread 0x00007f (most recent call first):\n  File \"t.py\", line 3 in main\n"),
    ("tag", f"# hangdoc process host=n1 pid={BIG} rank={BIG} world_size={BIG} main_thread=0x{'f' * 5000}\n"
            "Thread 0x00007f (most recent call first):\n  File \"t.py\", line 3 in main\n"),
])
def test_a_5000_digit_number_costs_that_value_not_the_file(tmp_path, name, text):
    from hangdoc.readers import read_paths

    p = tmp_path / f"{name}.out"
    p.write_text(text + PYSPY.format(pid=77))  # a valid dump after the bad one
    job = read_paths([str(p)])
    assert not [e for e in job.errors if "ValueError" in e.message or "could not read" in e.message], job.errors
    assert 77 in {q.pid for q in job.processes}, "the valid dump after the bad number was lost"
    assert len(job.processes) >= 2 or name in ("elastic",)


def test_flight_recorder_numbers_past_the_limit_cost_one_entry(tmp_path):
    from hangdoc.readers import read_paths

    good = {"profiling_name": "nccl:all_reduce", "collective_seq_id": 1, "p2p_seq_id": 0, "state": "completed",
            "input_sizes": [[8]], "process_group": ["0", "default_pg"]}
    bad = [dict(good, profiling_name=f"nccl:send {BIG}->1"), dict(good, collective_seq_id=10 ** 40),
           dict(good, time_created_ns=10 ** 400), dict(good, input_sizes=[[2 ** 70]]), "not an entry", dict(good, process_group=5)]
    p = tmp_path / "nccl_trace_rank_0"
    p.write_text(json.dumps({"version": "2.10", "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": f"[0, {BIG}]"}},
                             "entries": bad + [good]}))
    job = read_paths([str(p)])
    # a time out of bounds is no time (the entry stays); every other bad number costs its entry
    assert [(r.seq, r.time_issued) for r in job.records] == [(0, None), (0, None)]
    assert [e.line for e in job.errors] == [1, 2, 4, 5, 6] and all(e.message.startswith("bad Flight Recorder entry") for e in job.errors)


def test_records_numbers_past_the_limit_are_line_errors(tmp_path):
    from hangdoc.readers import read_paths

    p = tmp_path / "collectives-n1-r0-7.jsonl"
    head = json.dumps({"hangdoc": "collectives", "version": 1, "host": "n1", "rank": 0, "pid": 7, "world_size": 2})
    lines = [head, '{"rank": 0, "seq": 1%s, "op": "barrier"}' % BIG, json.dumps({"rank": 0, "seq": 0, "op": "barrier", "time_issued": 10 ** 400}),
             "[" * 100_000, json.dumps({"rank": 0, "seq": 2 ** 64, "op": "barrier"}), json.dumps({"rank": 0, "seq": 1, "op": "barrier"})]
    p.write_text("\n".join(lines) + "\n")
    job = read_paths([str(p)])
    assert [r.seq for r in job.records] == [1]
    assert [e.line for e in job.errors] == [2, 3, 4, 5]


# --- 2. odd files --------------------------------------------------------------------------------


def test_a_fifo_named_or_walked_never_blocks(tmp_path):
    d = tmp_path / "dumps"
    d.mkdir()
    (d / "trace-n1.out").write_text(PYSPY.format(pid=42))
    os.mkfifo(str(d / "trace-fifo.out"))  # a dump name: reported
    os.mkfifo(str(d / "other"))  # any other name: skipped quietly
    out = read_in_child(f"""
        job = read_paths([{str(d)!r}])
        named = read_paths([{str(d / 'trace-fifo.out')!r}, {str(d / 'trace-n1.out')!r}])
        out = {{"walk": [str(e) for e in job.errors], "walk_pids": [p.pid for p in job.processes],
               "named": [str(e) for e in named.errors], "named_pids": [p.pid for p in named.processes]}}
    """)
    fifo = str(d / "trace-fifo.out")
    assert out["walk"] == [f"{fifo}:0: cannot read: a FIFO (named pipe), not a regular file: not read"]
    assert out["named"] == out["walk"] and out["walk_pids"] == out["named_pids"] == [42]


def test_dev_zero_under_a_records_or_flight_recorder_name_is_refused(tmp_path):
    d = tmp_path / "dumps"
    d.mkdir()
    (d / "trace-n1.out").write_text(PYSPY.format(pid=42))
    for name in ("collectives-n1-r0-7.jsonl", "nccl_trace_rank_0", "trace-zero.out"):
        os.symlink("/dev/zero", str(d / name))
    out = read_in_child(f"""
        import glob
        walked = read_paths([{str(d)!r}])
        named = read_paths(sorted(glob.glob({str(d / '*')!r})))
        out = {{"walked": [e.message for e in walked.errors], "named": [e.message for e in named.errors],
               "pids": [p.pid for p in named.processes]}}
    """, timeout=20)
    # walked: links are not followed (one line each for the dump names); named: followed, and refused as a device
    # (collectives-*.jsonl is no name only dumps carry: met in a walk, a link to anything is skipped quietly)
    assert out["walked"] == ["cannot read: a symbolic link (not followed in a directory walk), not a regular file: not read"] * 2
    assert out["named"] == ["cannot read: a character device, not a regular file: not read"] * 3
    assert out["pids"] == [42]


def test_a_million_frame_stack_is_read_in_bounded_time_and_memory(tmp_path):
    p = tmp_path / "trace-n1.out"
    with open(p, "w") as f:
        f.write("Process 42: python t.py\nPython v3.11.7 (/usr/bin/python3.11)\n\nThread 42 (idle): \"MainThread\"\n")
        f.write("    recurse (t.py:5)\n" * 1_000_000)
        f.write("    main (t.py:9)\n\n")
        f.write(PYSPY.format(pid=43))
    out = read_in_child(f"""
        import time
        t = time.process_time()
        job = read_paths([{str(p)!r}])
        frames = [f.function for f in job.processes[0].main_thread.frames]
        out = {{"s": time.process_time() - t, "mb": hwm_mb(),
               "n": len(frames), "outer": frames[0], "inner": frames[-1], "mid": [f for f in frames if "not read" in f],
               "errors": [str(e) for e in job.errors], "pids": [q.pid for q in job.processes]}}
    """, timeout=60)
    assert out["pids"] == [42, 43]
    assert out["outer"] == "main" and out["inner"] == "recurse" and out["n"] == 2_001
    assert out["mid"] == ["<998001 frames not read>"]
    assert out["errors"] == [f"{p}:4: stack deeper than 2000 frames or 8 MiB: 998001 frame lines in its middle not read "
                             "(kept 2000 outermost and innermost)"]
    assert out["s"] < 8 and out["mb"] < 400, out


def test_flight_recorder_pickles_cannot_run_code_or_explode(tmp_path):
    import pickle

    marker = tmp_path / "ran"

    class Run:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    shared = list(range(5000))
    loop: list = []
    loop.append(loop)
    cases = {
        "nccl_trace_rank_0": pickle.dumps({"entries": [Run()]}, protocol=2),
        # memo index 2**30: the C unpickler sizes its memo by it (8 GiB; a MemoryError under the cap)
        "nccl_trace_rank_1": b"\x80\x04}\x94r\xff\xff\xff\x3f.",
        "nccl_trace_rank_2": pickle.dumps({"entries": [{"input_sizes": [shared] * 5000}] * 5000}, protocol=4),
        "nccl_trace_rank_3": pickle.dumps({"entries": loop}, protocol=2),
        # found by the fuzz run: 1 MB of MARKs made a million lists (64 MB traced, 215 MB RSS)
        "nccl_trace_rank_4": b"\x80\x04" + b"(" * 1_000_000 + b".",
        # no memo at all: DUP of a container, 40 times (150 bytes, 2**40 leaves), once unchecked: the
        # reader's str() of the process group never finished
        "nccl_trace_rank_5": (b"\x80\x02}(X\x07\x00\x00\x00entries]}(X\x0e\x00\x00\x00profiling_name"
                              b"X\x0f\x00\x00\x00nccl:all_reduceX\x0d\x00\x00\x00process_groupX\x01\x00\x00\x00a"
                              + b"2\x86" * 40 + b"uau."),
    }
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
    out = read_in_child(f"""
        import glob, time
        t = time.process_time()
        job = read_paths(sorted(glob.glob({str(tmp_path / 'nccl_trace_rank_*')!r})))
        out = {{"errors": [e.message for e in job.errors], "s": time.process_time() - t,
               "mb": hwm_mb()}}
    """)
    assert not marker.exists()
    assert out["errors"] == [
        "not a readable Flight Recorder pickle: UnpicklingError: refusing to load posix.system",
        "not a Flight Recorder dump: more than 10000000 values (shared references expanded)",
        "not a Flight Recorder dump: a container that contains itself",
        "not a readable Flight Recorder pickle: UnpicklingError: more than 1000 nested MARKs",
        "not a Flight Recorder dump: more than 10000000 values (shared references expanded)",
    ]
    assert out["s"] < 5 and out["mb"] < 100, out


# --- 5. colour codes and NUL holes ------------------------------------------------------------


def test_a_py_spy_dump_in_colour_reads_like_a_plain_one(tmp_path):
    from hangdoc.readers import read_paths

    plain = open(PLAIN, "rb").read()
    # py-spy and launchers colour words when they think they talk to a terminal
    colour = plain.replace(b"Process ", b"\x1b[1;33mProcess\x1b[0m ").replace(b"Thread ", b"\x1b[1mThread\x1b[0m ")
    colour = colour.replace(b"(idle)", b"\x1b[32m(idle)\x1b[0m").replace(b"    ", b"    \x1b[36m", 5)
    (tmp_path / "trace-node1.out").write_bytes(colour)
    a, b = read_paths([PLAIN]), read_paths([str(tmp_path)])
    assert [(p.pid, p.role, [f.function for f in p.main_thread.frames]) for p in b.processes] == \
        [(p.pid, p.role, [f.function for f in p.main_thread.frames]) for p in a.processes]
    assert b.errors == []


def test_a_log_with_a_nul_hole_is_read_around_the_hole(tmp_path):
    from hangdoc.readers import read_paths

    plain = open(PLAIN, "rb").read()
    cut = plain.index(b"\nProcess ", 100) + 1
    # copytruncate: the writer goes on at its old offset, the file starts with a hole
    (tmp_path / "trace-head.out").write_bytes(b"\x00" * 100_000 + plain)
    # a hole in the middle (a file cut while written, and written again)
    (tmp_path / "trace-mid.out").write_bytes(plain[:cut] + b"\x00" * 8192 + plain[cut:])
    for name in ("trace-head.out", "trace-mid.out"):
        for paths in ([str(tmp_path / name)], [str(tmp_path)]):
            job = read_paths(paths)
            mine = [p for p in job.processes if p.source.endswith(name)]
            assert len(mine) == 4, (name, paths, job.errors)
            errs = [e for e in job.errors if e.source.endswith(name)]
            assert len(errs) == 1 and "NUL bytes: a hole" in errs[0].message
    assert [e.line for e in read_paths([str(tmp_path / "trace-mid.out")]).errors] == [plain[:cut].count(b"\n") + 1]


def test_a_fifo_or_a_huge_rank_as_rank_map_is_one_line(tmp_path):
    fifo = tmp_path / "map.fifo"
    os.mkfifo(str(fifo))
    bad = tmp_path / "map.txt"
    bad.write_text(f"n1:42 {BIG}\n")
    res = aggregate(PLAIN, "--rank-map", str(fifo), timeout=20)
    assert res.returncode == 2 and res.stderr.strip().endswith("a FIFO (named pipe), not a regular file: not read"), res.stderr
    res = aggregate(PLAIN, "--rank-map", str(bad), timeout=20)
    assert res.returncode == 2 and f"{bad}:1: expected 'KEY RANK'" in res.stderr and "ValueError" not in res.stderr, res.stderr


def test_a_deep_stack_behind_a_launcher_prefix_is_bounded_too():
    from hangdoc.readers import read_text

    lines = ["[rank1]:Thread 0x00007f (most recent call first):"]
    lines += ['[rank1]:  File "t.py", line 5 in recurse'] * 30_000 + ['[rank1]:  File "t.py", line 9 in main', ""]
    job = read_text("\n".join(lines))
    (p,) = job.processes
    frames = [f.function for f in p.main_thread.frames]
    assert (p.rank, len(frames), frames[0], frames[-1]) == (1, 2_001, "main", "recurse")
    assert "<28001 frames not read>" in frames


def test_a_stack_of_ten_thousand_worker_loop_frames_is_diagnosed_in_linear_time(capsys):
    """Found by benchmarks/fuzz_aggregate.py (a duplicated line): the worker shape recursed once
    per _worker_loop frame, classifying the rest each time: 9 s and a RecursionError in a rule."""
    import time

    from hangdoc.analysis import analyse
    from hangdoc.readers import read_text

    frame = '  File "/usr/lib/python3.11/site-packages/torch/utils/data/_utils/worker.py", line 309 in _worker_loop'
    text = "\n".join(["Thread 0x00007f (most recent call first):", '  File "/usr/lib/python3.11/threading.py", line 320 in wait']
                     + [frame] * 9_999 + ['  File "train.py", line 3 in <module>', ""])
    t = time.process_time()
    report = analyse(read_text(text))
    assert time.process_time() - t < 2
    assert "failed" not in capsys.readouterr().err
    assert report.findings


def test_a_5000_digit_thread_id_in_a_collapsed_py_spy_listing_costs_that_pid_not_the_block():
    # int() of 5,000 digits raises (Python's 4,300-digit limit): the block's other processes went with it
    from hangdoc.readers import read_text

    huge = "9" * 5000
    job = read_text(f'Thread {huge} (idle): "MainThread"\nThread 4102 (idle): "MainThread"\n'
                    '    all_reduce (torch/distributed/distributed_c10d.py:2501)\n    main (train.py:40)\n'
                    'Thread 4103 (idle): "MainThread"\n    broadcast (torch/distributed/distributed_c10d.py:2100)\n'
                    '    main (train.py:38)\n')
    assert not job.errors, job.errors
    tops = sorted((p.pid or 0, p.main_thread.top.function) for p in job.processes)
    assert tops == [(0, "all_reduce"), (4102, "all_reduce"), (4103, "broadcast")], tops
