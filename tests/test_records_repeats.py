"""A records file that repeats its lines (a copy gone wrong; the fuzz run's 8 MB of one duplicated
line) is read once per call: the recorder writes each seq of a group and rank once. Issue 20:
no input over 2 s."""

import json
import time

from hangdoc.analysis import analyse
from hangdoc.readers import read_paths

HEADER = {"hangdoc": "collectives", "version": 1, "host": "vm", "rank": 0, "pid": 7, "world_size": 3}


def _rec(seq, op="all_reduce"):
    return {"rank": 0, "seq": seq, "op": op, "group": "default_pg", "group_ranks": [0, 1, 2], "shapes": [[1, 4]],
            "dtypes": ["float32"], "call_site": "train.py:39:main", "time_issued": 1700000000.0 + seq, "state": "completed"}


def _write(tmp_path, lines):
    p = tmp_path / "collectives-vm-r0-7.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in [HEADER] + lines) + "\n")
    return str(p)


def test_8_mb_of_one_repeated_record_line_is_one_record_and_fast(tmp_path):
    line = _rec(0)
    n = (8 << 20) // len(json.dumps(line))
    path = _write(tmp_path, [line] * n)
    c0 = time.process_time()
    job = read_paths([path])
    analyse(job)
    cpu = time.process_time() - c0
    assert len(job.records) == 1
    assert any("repeated records" in e.message and str(n - 1) in e.message for e in job.errors), job.errors
    assert cpu < 1.0, cpu  # 2.3 s CPU before (18,000 records aligned)


def test_a_repeat_that_is_not_the_line_before_is_read_once_too(tmp_path):
    path = _write(tmp_path, [_rec(0), _rec(1), _rec(0), _rec(2, "broadcast"), _rec(1)])
    job = read_paths([path])
    assert [(r.seq, r.op) for r in job.records] == [(0, "all_reduce"), (1, "all_reduce"), (2, "broadcast")]
    assert any("2 repeated records" in e.message for e in job.errors), job.errors


def test_a_flight_recorder_entry_referred_to_20000_times_is_read_once_and_fast(tmp_path):
    import pickle

    entry = {"record_id": 1, "pg_id": 0, "process_group": ["0", "default_pg"], "collective_seq_id": 2,
             "p2p_seq_id": 0, "op_id": 2, "profiling_name": "nccl:all_reduce", "time_created_ns": 1700000000000000000,
             "input_sizes": [[4]], "input_dtypes": ["Float"], "output_sizes": [[4]], "output_dtypes": ["Float"],
             "state": "completed", "frames": [{"name": "all_reduce", "filename": "train.py", "line": 9}]}
    first = dict(entry, record_id=0, collective_seq_id=1)
    dump = {"version": "2.10", "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}},
            "entries": [first] + [entry] * 20000}  # one object, pickled once and referred to by memo
    path = tmp_path / "nccl_trace_rank_0"
    path.write_bytes(pickle.dumps(dump, protocol=4))
    c0 = time.process_time()
    job = read_paths([str(path)])
    analyse(job)
    cpu = time.process_time() - c0
    assert [r.seq for r in job.records] == [0, 1], [r.seq for r in job.records]
    assert any("19999 repeated Flight Recorder entries" in e.message for e in job.errors), job.errors
    assert cpu < 1.5, cpu
