"""Bad input: every problem is one ParseError naming file and line; the rest is still used."""

from __future__ import annotations

import json
import os
import shutil

from hangdoc.model import STATUS_TRUNCATED, CollectiveRecord
from hangdoc.readers import read_paths, read_text

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "dumps")
PLAIN = os.path.join(FIXTURES, "dataloader_deadlock", "with-workers", "trace-node1.out")


def fixture_bytes(path: str = PLAIN) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def write(tmp_path, name: str, data: bytes) -> str:
    p = tmp_path / name
    p.write_bytes(data)
    return str(p)


def test_empty_and_missing_files(tmp_path):
    empty = write(tmp_path, "trace-a.out", b"")
    job = read_paths([empty, str(tmp_path / "nope.out"), PLAIN])
    msgs = {os.path.basename(e.source): (e.line, e.message) for e in job.errors}
    assert msgs == {"trace-a.out": (0, "empty file"), "nope.out": (0, "no such file or directory")}
    assert len(job.processes) == 4


def test_binary_garbage(tmp_path):
    garbage = write(tmp_path, "core.bin", bytes(range(256)) * 64)
    job = read_paths([garbage, PLAIN])
    (e,) = job.errors
    assert (e.source, e.line) == (garbage, 1) and "binary" in e.message
    assert len(job.processes) == 4


def test_random_bytes_without_nul(tmp_path):
    data = bytes((i * 7919) % 255 + 1 for i in range(50_000))
    job = read_paths([write(tmp_path, "noise.out", data)])
    assert job.processes == []
    assert [e.message for e in job.errors][0].startswith("bytes that are not UTF-8")
    assert job.errors[-1].message == "no stack dump or log event found"


def test_truncated_file_keeps_what_is_there(tmp_path):
    data = fixture_bytes()
    cut = data.index(b"CountingDataset.__getitem__") + 10  # in the middle of the stuck worker's top frame
    job = read_paths([write(tmp_path, "trace-node1.out", data[:cut])])
    assert len(job.processes) == 4
    last = job.processes[-1]
    # the file was cut, not the process (issue 18): the source is truncated, and a stack of which
    # nothing but a half frame was read is no stack ("log-only": known, never blamed)
    assert last.status == "log-only" and last.pid == 32731 and last.meta["cut_off"]
    assert job.sources[0].truncated
    lines = data[:cut].count(b"\n") + 1
    assert any(e.line == lines and "middle of a line" in e.message for e in job.errors)
    assert all(p.status != STATUS_TRUNCATED for p in job.processes)


def test_non_utf8_is_reported_once_with_its_line(tmp_path):
    data = fixture_bytes().replace(b"metrics_flusher", b"metrics_\xff\xfeflusher")
    job = read_paths([write(tmp_path, "trace-node1.out", data)])
    (e,) = job.errors
    first = data[: data.index(b"\xff")].count(b"\n") + 1
    assert e.line == first and "not UTF-8" in e.message
    assert len(job.processes) == 4
    assert any(f.function == "metrics_\ufffd\ufffdflusher" for p in job.processes for t in p.threads for f in t.frames)


def test_over_long_line_is_cut_once(tmp_path):
    data = b"x" * 300_000 + b"\n" + fixture_bytes() + b"y" * 200_000 + b"\n"
    job = read_paths([write(tmp_path, "trace-node1.out", data)])
    assert [(e.line, e.message.split(",")[0]) for e in job.errors] == [(1, "line longer than 65536 characters")]
    assert len(job.processes) == 4


def test_interleaved_unprefixed_lines_do_not_crash(tmp_path):
    a = fixture_bytes().decode().splitlines()
    b = fixture_bytes(os.path.join(FIXTURES, "pipeline_cycle", "plain", "trace-node1.out")).decode().splitlines()
    mixed = [x for pair in zip(a, b) for x in pair]
    path = write(tmp_path, "trace-mixed.out", "\n".join(mixed).encode() + b"\n")
    job = read_paths([path])
    assert job.processes  # what can be told apart is used
    n = len(mixed)
    assert all(e.source == path and 0 <= e.line <= n for e in job.errors)


def test_prefixed_interleaving_is_taken_apart():
    text = "\n".join([
        "[rank0]: Traceback (most recent call last):",
        "[rank1]: Traceback (most recent call last):",
        '[rank0]:   File "/w/train.py", line 9, in <module>',
        '[rank1]:   File "/w/train.py", line 9, in <module>',
        "[rank0]:     main()",
        '[rank1]:   File "/w/train.py", line 5, in main',
        "[rank0]: RuntimeError: boom",
        "[rank1]:     dist.barrier()",
        "[rank1]: RuntimeError: timeout",
    ]) + "\n"
    job = read_text(text)
    assert job.errors == []
    got = {p.rank: [f.function for f in p.main_thread.frames] for p in job.processes}
    assert got == {0: ["<module>"], 1: ["<module>", "main"]}


def test_big_file_streams(tmp_path):
    import re

    block = fixture_bytes()
    path = tmp_path / "trace-big.out"
    with open(path, "wb") as f:
        for i in range(2000):  # 8,000 processes (distinct pids: one pid twice is one process), ~190,000 lines
            f.write(re.sub(rb"^Process (\d+)", lambda m: b"Process %d" % (int(m.group(1)) + 100_000 * i), block, flags=re.M))
    job = read_paths([str(path)])
    assert len(job.processes) == 8000 and job.errors == []
    # identical stacks share one tuple: memory grows with distinct stacks, not processes
    assert len({id(p.main_thread.frames) for p in job.processes}) <= 8


def test_hangdoc_tag_lines_and_own_file_names(tmp_path):
    text = (
        "# hangdoc process host=iam07 pid=4242 rank=12 local_rank=4 world_size=16 ppid=4000\n"
        "Current thread 0x00007f2d6808cb80 (most recent call first):\n"
        '  File "/opt/conda/lib/python3.8/site-packages/torch/distributed/distributed_c10d.py", line 3252 in all_reduce\n'
        '  File "/home/alice/train.py", line 28 in train_step\n'
        "\n"
        "# hangdoc process host=iam07 pid=4300 ppid=4242\n"
        "Current thread 0x00007f2d6808cb80 (most recent call first):\n"
        '  File "/opt/conda/lib/python3.8/site-packages/torch/utils/data/_utils/worker.py", line 308 in _worker_loop\n'
    )
    path = write(tmp_path, "stacks-iam07-r12-4242.txt", text.encode())
    job = read_paths([path])
    assert job.errors == []
    rank, worker = job.processes
    assert (rank.host, rank.pid, rank.rank, rank.local_rank, rank.ppid, rank.role) == ("iam07", 4242, 12, 4, 4000, "rank")
    assert rank.main_thread.top.file == "torch/distributed/distributed_c10d.py"
    assert rank.main_thread.frames[0].file == "~/train.py"
    assert (worker.pid, worker.role, worker.ppid, worker.parent_rank) == (4300, "dataloader-worker", 4242, 12)
    assert job.world_size == 16


def test_records_files_are_delegated(tmp_path):
    header = {"hangdoc": "collectives", "version": 1, "host": "n1", "rank": 2, "pid": 7, "world_size": 8}
    rec = CollectiveRecord(rank=2, seq=0, op="broadcast", shapes=((8,),), dtypes=("float32",), root=0)
    path = tmp_path / "collectives-n1-r2-7.jsonl"
    path.write_text(json.dumps(header) + "\n" + json.dumps(rec.to_json()) + "\n{broken\n")
    shutil.copy(PLAIN, tmp_path / "trace-n1.out")
    job = read_paths([str(tmp_path)])
    assert [r.op for r in job.records] == ["broadcast"]
    assert job.world_size == 8
    (e,) = job.errors
    assert e.source == str(path) and e.line == 3
    assert len(job.processes) == 4


def test_reader_never_raises_on_odd_blocks():
    odd = "\n".join([
        "Process abc: not a pid",
        "Thread 12 (idle)",
        "    no parens here",
        "Traceback (most recent call last):",
        '  File "x.py", line notanumber, in f',
        "Thread 0xZZ (most recent call first):",
        "Traceback for thread 1 (python) [] (most recent call last):",
        "    (C) File broken",
        "Thread 1 (Thread 0x1 (LWP 5) \"x\"):",
        "#0  ",
        "[",
        '  {"pid": ',
    ])
    job = read_text(odd)
    assert all(e.line >= 0 for e in job.errors)


def test_hangdoc_dump_status_tags_and_main_thread(tmp_path):
    text = (
        "# hangdoc process host=n1 pid=77 ppid=70 rank=1 world_size=2 role=rank status=stopped reason=state_T\n"
        "Error: py-spy exit 1: Error: Failed to get stack traces; gdb timed out after 10s\n"
        "\n"
        "# hangdoc process host=n1 pid=78 ppid=77 parent_rank=1 role=dataloader-worker source=hangdoc-dump\n"
        "Process 78: python train.py\n"
        "\n"
        'Thread 78 (idle): "MainThread"\n'
        "    _worker_loop (torch/utils/data/_utils/worker.py:334)\n"
        "# hangdoc process host=n1 pid=80 rank=0 main_thread=0x00007f0000000002 source=watchdog reason=no_progress\n"
        "Thread 0x00007f0000000001 (most recent call first):\n"
        '  File "/w/train.py", line 3 in <module>\n'
        "\n"
        "Thread 0x00007f0000000002 (most recent call first):\n"
        '  File "/w/helper.py", line 9 in loop\n'
    )
    job = read_paths([write(tmp_path, "dump-n1.txt", text.encode())])
    assert job.errors == []
    stopped, worker, watched = job.processes
    assert (stopped.pid, stopped.rank, stopped.status, stopped.status_detail) == (77, 1, "stopped", "state T")
    assert "gdb timed out" in stopped.meta["error"]
    assert (worker.role, worker.parent_rank, worker.ppid, worker.meta["source"]) == ("dataloader-worker", 1, 77, "hangdoc-dump")
    assert watched.main_thread.ident == "0x00007f0000000002" and watched.meta["reason"] == "no_progress"
    assert job.world_size == 2


def test_directory_walk_skips_reports_logs_and_traces(tmp_path):
    shutil.copy(PLAIN, tmp_path / "trace-node1.out")
    (tmp_path / "report.txt").write_text("Thread 12 (idle): \"MainThread\"\n    main (t.py:1)\n")
    (tmp_path / "train.log").write_text("Thread pool started\nProcess group initialised\n")
    (tmp_path / "trace-node1-0-4242.txt").write_text("train.py:12: x = 1\n")
    job = read_paths([str(tmp_path)])
    assert [os.path.basename(s.path) for s in job.sources] == ["trace-node1.out"]
    assert job.errors == [] and len(job.processes) == 4
    # named on the command line, the same log is read and its emptiness reported
    job = read_paths([str(tmp_path / "train.log")])
    assert [e.message for e in job.errors] == ["no stack dump or log event found"]


def test_directory_walk_reports_empty_and_garbage_dump_files(tmp_path):
    """A node whose dump came out empty or corrupt is news: named like a dump, it is reported even
    when found by walking a directory (other files still quietly skipped)."""
    shutil.copy(PLAIN, tmp_path / "trace-node1.out")
    (tmp_path / "trace-node2.out").write_bytes(b"")
    (tmp_path / "trace-node3.out").write_bytes(bytes(range(256)) * 8)
    (tmp_path / "stacks-node4-r3-77.txt").write_text("nothing here\n")
    (tmp_path / "nccl_trace_rank_1").write_bytes(b"garbage")
    (tmp_path / "notes.txt").write_text("hello\n")
    job = read_paths([str(tmp_path)])
    errs = {os.path.basename(e.source): e.message for e in job.errors}
    assert errs == {"trace-node2.out": "empty file", "trace-node3.out": "binary file, not a stack dump or a log; skipped",
                    "stacks-node4-r3-77.txt": "no stack dump or log event found",
                    "nccl_trace_rank_1": errs.get("nccl_trace_rank_1")}
    assert errs["nccl_trace_rank_1"].startswith("not a Flight Recorder")
    assert len(job.processes) == 4


def test_error_lines_of_other_programs_are_not_processes():
    text = (
        "Error: failed to load checkpoint step_100.pt, starting from scratch\n"
        "Error: Permission Denied: Try running again with elevated permissions by going 'sudo env \"PATH=$PATH\" !!'\n"
    )
    job = read_text(text)
    assert [(p.status, p.status_detail[:25]) for p in job.processes] == [("unresponsive", "Error: Permission Denied:")]


def test_crlf_line_ends(tmp_path):
    data = fixture_bytes().replace(b"\n", b"\r\n")
    job = read_paths([write(tmp_path, "trace-node1.out", data)])
    assert job.errors == [] and len(job.processes) == 4
    assert job.processes[0].command.endswith("dataloader_deadlock.py")
    assert all(not f.file.endswith("\r") for p in job.processes for t in p.threads for f in t.frames)


def _stderr_of(code: str) -> str:
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60)
    return p.stdout.decode()


def test_faulthandler_variants_from_real_interpreters():
    # more than 100 frames: faulthandler prints "  ..." and the main thread is marked truncated
    deep = read_text(_stderr_of(
        "import faulthandler\n"
        "def deep(n):\n"
        "    if n == 0:\n"
        "        faulthandler.dump_traceback(all_threads=False)\n"
        "        return\n"
        "    deep(n - 1)\n"
        "deep(120)\n"))
    (p,) = deep.processes
    assert p.status == STATUS_TRUNCATED and len(p.main_thread.frames) == 100
    assert p.main_thread.top.function == "deep" and p.main_thread.top.line == 4
    # dump_traceback_later: a "Timeout (0:00:00.200000)!" line before the threads
    later = read_text(_stderr_of("import faulthandler, time\nfaulthandler.dump_traceback_later(0.2, exit=True)\ntime.sleep(5)\n"))
    assert [p.main_thread.top.function for p in later.processes] == ["<module>"] and later.errors == []
    # a fatal error
    fatal = read_text(_stderr_of("import faulthandler, ctypes\nfaulthandler.enable()\nctypes.string_at(0)\n"))
    (p,) = fatal.processes
    assert p.meta["fatal_error"] == "Segmentation fault" and p.main_thread.top.function == "string_at"


def test_rank_map_matches_short_host_names_and_reports_what_matched_nothing():
    """A map written with FQDNs still applies; entries for hosts no dump came from are reported and
    do not widen the world (a map for the wrong job used to invent missing ranks silently)."""
    from hangdoc.analysis import analyse

    job = read_paths([PLAIN], rank_map={"node1.cluster.example:32380": 0, "node1:32383": 1,
                                        "othernode:5": 2, "othernode:6": 3})
    assert [(p.pid, p.rank) for p in job.processes if p.role == "rank"] == [(32380, 0), (32383, 1)]
    assert [p.parent_rank for p in job.processes if p.role == "dataloader-worker"] == [0, 1]
    assert [str(e) for e in job.errors] == [
        "rank map:0: 2 entries name hosts no dump came from (othernode); the dumps' hosts are node1"]
    # the map's names are the dumps' (two entries matched): othernode did not dump, ranks 2-3 missing
    assert job.world_size == 4
    # a map of another job (or other host names): nothing matched by host, nothing invented
    job = read_paths([PLAIN], rank_map={"gpu-a:32380": 0, "gpu-a:32383": 1, "gpu-b:5": 2, "gpu-b:6": 3})
    assert job.world_size is None and len(job.errors) == 1
    assert "missing-rank" not in [f.kind for f in analyse(job).findings]
    job = read_paths([PLAIN], rank_map={"node1:32380": 0, "node1:999": 3})
    assert [str(e) for e in job.errors] == ["rank map:0: 1 entry matches no process read (node1:999=3)"]
    assert job.world_size == 4  # the map says rank 3 is on node1, and it was not dumped: that is news


def test_rank_map_refuses_negative_and_contradictory_ranks(tmp_path):
    import pytest

    from hangdoc.cli import UsageError
    from hangdoc.cli.aggregate import read_rank_map

    with pytest.raises(ValueError, match="non-negative"):
        read_paths([PLAIN], rank_map={"node1:32380": -1})
    p = tmp_path / "map.txt"
    p.write_text("node1:1 0\nnode1:2 -3\n")
    with pytest.raises(UsageError, match=r"map.txt:2: expected 'KEY RANK'"):
        read_rank_map(str(p))
    p.write_text("node1:1 0\nnode1:1 2\n")
    with pytest.raises(UsageError, match=r"map.txt:2: node1:1 is given rank 2 here and rank 0 before"):
        read_rank_map(str(p))


def test_a_py_spy_json_block_that_is_no_list_is_reported_with_its_line(tmp_path):
    text = ('Process 7: python t.py\n\nThread 7 (idle): "MainThread"\n    main (t.py:3)\n\n'
            '{"pid": 5, "thread_id": 5, "frames": []}\n')
    job = read_paths([write(tmp_path, "trace-n1.out", text.encode())])
    assert [p.pid for p in job.processes] == [7]
    assert [(e.line, e.message) for e in job.errors] == [(6, "bad py-spy JSON: not a list of threads")]
