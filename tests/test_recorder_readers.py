"""The record readers: hangdoc JSONL and Flight Recorder (pickle and JSON), on bad input too."""

from __future__ import annotations

import glob
import json
import os
import pickle

from hypothesis import given, settings
from hypothesis import strategies as st

from hangdoc.model import CollectiveRecord, Source
from hangdoc.readers import flight_recorder, records
from tests.procs import ROOT

FIXTURES = os.path.join(ROOT, "tests", "fixtures", "records")


def _write(tmp_path, name, data):
    p = tmp_path / name
    p.write_bytes(data if isinstance(data, bytes) else data.encode())
    return str(p)


def test_bad_lines_are_parse_errors_with_line_numbers_and_the_rest_is_read(tmp_path):
    header = json.dumps({"hangdoc": "collectives", "version": 1, "host": "n1", "rank": 3, "pid": 9, "world_size": 4})
    good = json.dumps({"seq": 0, "op": "all_reduce", "shapes": [[8]], "dtypes": ["float32"]})
    lines = [header, good, "{oops", "[1, 2]", json.dumps({"seq": "x", "op": "barrier", "shapes": [["a"]]}),
             json.dumps({"seq": 1, "op": "barrier"}), ""]
    p = _write(tmp_path, "collectives-n1-r3-9.jsonl", "\n".join(lines))
    src = Source(p)
    recs = records.read(p, src)
    assert [(r.rank, r.host, r.pid, r.seq, r.op) for r in recs] == [(3, "n1", 9, 0, "all_reduce"), (3, "n1", 9, 1, "barrier")]
    assert [e.line for e in src.errors] == [3, 4, 5]
    assert all(e.source == p for e in src.errors)
    assert records.looks_like(p, open(p, "rb").read(200)) and records.world_size(p) == 4


def test_missing_file_is_one_error(tmp_path):
    src = Source(str(tmp_path / "nope.jsonl"))
    assert records.read(src.path, src) == [] and len(src.errors) == 1
    assert flight_recorder.read(src.path, src) == [] and len(src.errors) == 2


_FIELDS = st.dictionaries(
    st.sampled_from(["rank", "seq", "op", "shapes", "dtypes", "group_ranks", "root", "state"]),
    st.one_of(st.integers(-3, 9), st.text(max_size=5), st.lists(st.integers(0, 4), max_size=3), st.none()))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.one_of(st.text(max_size=60), st.builds(json.dumps, _FIELDS)), max_size=20))
def test_records_reader_never_raises(tmp_path_factory, lines):
    p = tmp_path_factory.mktemp("fuzz") / "collectives-x-r0-1.jsonl"
    p.write_text("\n".join(lines))
    src = Source(str(p))
    for r in records.read(str(p), src):
        assert isinstance(r, CollectiveRecord) and isinstance(r.seq, int)


def test_flight_recorder_real_gloo_dump():
    path = os.path.join(FIXTURES, "skip_broadcast", "fr_trace_rank_0")
    head = open(path, "rb").read(256)
    assert flight_recorder.looks_like(path, head) and not records.looks_like(path, head)
    src = Source(path)
    recs = flight_recorder.read(path, src)
    assert src.errors == []
    assert [(r.rank, r.seq, r.op, r.state) for r in recs] == [
        (0, 0, "all_reduce", "completed"), (0, 1, "all_reduce", "completed"), (0, 2, "all_reduce", "completed"),
        (0, 3, "broadcast", "issued")]
    assert recs[0].shapes == ((8,),) and recs[0].dtypes == ("float32",) and recs[0].group == "default_pg"
    assert recs[-1].call_site.endswith("examples/records/skip_broadcast.py:13:<module>")


def test_flight_recorder_json_form_reads_like_the_pickle(tmp_path):
    src_path = os.path.join(FIXTURES, "uneven_inputs", "fr_trace_rank_2")
    dump = flight_recorder.load(src_path)
    for e in dump["entries"]:  # the JSON form writes 0 for unset times and lists for tuples
        e["time_discovered_completed_ns"] = e["time_discovered_completed_ns"] or 0
    p = _write(tmp_path, "nccl_trace_rank_2.json", json.dumps(dump))
    assert flight_recorder.looks_like(p, open(p, "rb").read(4096))
    a = flight_recorder.read(src_path, Source(src_path))
    b = flight_recorder.read(p, Source(p))
    assert [(r.op, r.seq, r.state, r.shapes) for r in a] == [(r.op, r.seq, r.state, r.shapes) for r in b]
    assert a[-1].op == "barrier" and a[-1].state == "issued"


def test_nccl_style_p2p_names_and_pg_config(tmp_path):
    dump = {"version": "2.10", "pg_config": {"5": {"name": "5", "desc": "pp", "ranks": "[4, 6]"}}, "entries": [
        {"record_id": 0, "pg_id": 5, "process_group": ("5", "pp"), "collective_seq_id": 0, "p2p_seq_id": 1,
         "profiling_name": "nccl:send 0->1", "input_sizes": [[2, 3]], "input_dtypes": ["BFloat16"],
         "state": "started", "retired": False, "time_created_ns": 5_000_000_000},
        {"record_id": 1, "pg_id": 5, "process_group": ("5", "pp"), "collective_seq_id": 7, "p2p_seq_id": 1,
         "profiling_name": "nccl:_allgather_base", "input_sizes": [[4]], "input_dtypes": ["Half"], "state": "completed"}]}
    p = _write(tmp_path, "nccl_trace_rank_4", pickle.dumps(dump))
    send, ag = flight_recorder.read(p, Source(p))
    assert (send.op, send.peer, send.seq, send.group, send.group_ranks, send.state) == ("send", 6, 0, "5", (4, 6), "issued")
    assert send.dtypes == ("bfloat16",) and send.time_issued == 5.0
    assert (ag.op, ag.seq, ag.dtypes, ag.state) == ("all_gather_into_tensor", 6, ("float16",), "completed")


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch " + _Evil.marker,))


def test_hostile_pickle_is_refused_not_run(tmp_path):
    _Evil.marker = str(tmp_path / "pwned")
    p = _write(tmp_path, "nccl_trace_rank_0", pickle.dumps({"version": "2.10", "entries": [_Evil()]}))
    src = Source(p)
    assert flight_recorder.read(p, src) == []
    assert not os.path.exists(_Evil.marker)
    assert len(src.errors) == 1 and "refusing to load" in src.errors[0].message


def test_truncated_pickle_and_nameless_file(tmp_path):
    good = pickle.dumps({"version": "2.10", "entries": []})
    p = _write(tmp_path, "nccl_trace_rank_1", good[: len(good) // 2])
    src = Source(p)
    assert flight_recorder.read(p, src) == [] and src.errors[0].line == 0
    q = _write(tmp_path, "trace_dump", good)
    src = Source(q)
    assert flight_recorder.read(q, src) == [] and "rank" in src.errors[0].message


def test_bad_entry_is_skipped_with_its_index(tmp_path):
    dump = {"version": "2.10", "entries": [{"profiling_name": "nccl:all_reduce"},
                                           {"profiling_name": "gloo:barrier", "collective_seq_id": 3, "p2p_seq_id": 0,
                                            "state": "scheduled", "process_group": ["0", "default_pg"]}]}
    p = _write(tmp_path, "fr_rank_7.json", json.dumps(dump))
    src = Source(p)
    [r] = flight_recorder.read(p, src)
    assert (r.rank, r.op, r.seq, r.group, r.state) == (7, "barrier", 2, "default_pg", "issued")
    assert [e.line for e in src.errors] == [1]


def test_every_fixture_dump_reads_cleanly():
    for path in glob.glob(os.path.join(FIXTURES, "*", "fr_trace_rank_*")):
        src = Source(path)
        assert flight_recorder.read(path, src) and src.errors == []


def test_wrong_field_types_and_ranks_outside_the_world_are_line_errors(tmp_path):
    """Each corrupt field is named with its file and line; none reaches the rules (where a dict group
    crashed the aggregator and a rank of 1,000,000 made it list 999,996 missing ranks)."""
    from hangdoc.analysis import analyse
    from hangdoc.readers import read_paths

    header = {"hangdoc": "collectives", "version": 1, "host": "n1", "pid": 7, "world_size": 2}
    ok = {"seq": 0, "op": "all_reduce", "shapes": [[8]], "dtypes": ["float32"], "state": "completed", "call_site": "t.py:5:main"}
    bad = [({"rank": 1_000_000}, "rank 1000000 is outside the world of 2 ranks"),
           ({"group": {}}, "'group' must be a string, not object"),
           ({"call_site": 12}, "'call_site' must be a string, not int"),
           ({"time_issued": "soon"}, "'time_issued' must be a number of seconds or null, not string"),
           ({"peer": [1]}, "'peer' must be an integer, not array"),
           ({"root": 2}, "root 2 is outside the world of 2 ranks"),
           ({"group_ranks": [0, -1]}, "group ranks -1 is outside the world of 2 ranks"),
           ({"shapes": [[8, "x"]]}, "'shapes' must be an array of arrays of non-negative integers"),
           ({"state": "done"}, "'state' must be one of issued, completed, failed, not 'done'"),
           ({"async_op": 1}, "'async_op' must be true or false, not int"),
           ({"seq": True}, "'seq' must be a non-negative integer, not True"),
           ({"op": ""}, "'op' must be a non-empty string, not string")]
    paths = []
    for rank in (0, 1):
        lines = [dict(header, rank=rank), dict(ok), dict(ok, seq=1, state="issued", call_site=f"t.py:{6 - rank}:main")]
        if rank == 0:
            lines[2]["op"] = "broadcast"
            lines[2]["root"] = 0
            lines += [{**ok, "seq": 2, **field} for field, _ in bad]
        paths.append(_write(tmp_path, f"collectives-n1-r{rank}-{7 + rank}.jsonl", "\n".join(map(json.dumps, lines))))
    job = read_paths(paths)
    assert [(os.path.basename(e.source), e.line, e.message) for e in job.errors] == [
        ("collectives-n1-r0-7.jsonl", 4 + i, f"bad record: {msg}") for i, (_, msg) in enumerate(bad)]
    assert len(job.records) == 4 and job.world_size == 2
    head = analyse(job).findings[0]
    assert head.kind == "collective-mismatch" and [c.rank for c in head.culprits] == [0]


def test_header_world_size_must_be_a_positive_integer(tmp_path):
    p = _write(tmp_path, "collectives-n1-r0-7.jsonl", "\n".join(map(json.dumps, [
        {"hangdoc": "collectives", "version": 1, "host": "n1", "rank": 0, "pid": 7, "world_size": "4"},
        {"seq": 0, "op": "barrier"}])))
    src = Source(p)
    assert [r.op for r in records.read(p, src)] == ["barrier"]
    assert [(e.line, e.message) for e in src.errors] == [(1, "bad header: world_size '4' is not a positive integer up to 1048576")]
    assert records.world_size(p) is None


_ANY = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-2, 2_000_000), st.floats(), st.text(max_size=4)),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=2),
                    max_leaves=6)
_RECORD = st.fixed_dictionaries({"seq": st.integers(0, 3), "op": st.sampled_from(["all_reduce", "broadcast", "send", "recv"])},
                                optional={k: _ANY for k in ("rank", "group", "group_ranks", "shapes", "dtypes", "root", "peer",
                                                            "async_op", "call_site", "stream", "phase", "time_issued",
                                                            "time_completed", "state", "host", "pid", "origin")})


@settings(max_examples=80, deadline=None)
@given(st.lists(_RECORD, max_size=12))
def test_what_the_reader_accepts_the_analysis_can_use(tmp_path_factory, recs):
    """Any value in any field: the reader keeps a record only if every field has its type and every
    rank is inside the header's world, and the analysis of what it kept never raises."""
    from hangdoc.analysis import analyse
    from hangdoc.readers import read_paths

    d = tmp_path_factory.mktemp("anyfield")
    with open(d / "collectives-n1-r0-7.jsonl", "w") as f:
        f.write(json.dumps({"hangdoc": "collectives", "version": 1, "host": "n1", "rank": 0, "pid": 7, "world_size": 4}) + "\n")
        for r in recs:
            f.write(json.dumps(r) + "\n")
    job = read_paths([str(d)])
    # a repeated record (a seq of a group and rank already read) is read once; its repeats are
    # counted in one error line ("N repeated records ...")
    repeats = sum(int(e.message.split()[0]) for e in job.errors if "repeated record" in e.message)
    others = sum(1 for e in job.errors if "repeated record" not in e.message)
    assert len(job.records) + repeats + others == len(recs)
    for r in job.records:
        assert 0 <= r.rank < 4 and all(0 <= g < 4 for g in r.group_ranks)
        assert isinstance(r.group, str) and isinstance(r.call_site, str) and isinstance(r.async_op, bool)
    report = analyse(job)
    assert report.findings and all(0 <= c.rank < 4 for f in report.findings for c in f.culprits if c.rank is not None)
