"""The recorder in this process on a one-rank gloo group: wrapping, ring buffer, containment, dump."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from hangdoc.model import Source  # noqa: E402
from hangdoc.readers import records as records_reader  # noqa: E402
from hangdoc.runtime import recorder  # noqa: E402
from tests.procs import ROOT  # noqa: E402


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    store = tmp_path_factory.mktemp("store") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield
    finally:
        recorder.disable()
        dist.destroy_process_group()


@pytest.fixture
def rec(group, tmp_path):
    r = recorder.enable(capacity=1000, out_dir=str(tmp_path))
    try:
        yield r
    finally:
        recorder.disable()


def test_enable_is_idempotent_and_disable_restores(group):
    original = dist.all_reduce
    r = recorder.enable()
    try:
        assert recorder.enable() is r and recorder.get() is r
        assert dist.all_reduce is not original and dist.all_reduce.__wrapped__ is original
        import torch.distributed.distributed_c10d as c10d

        assert c10d.all_reduce is dist.all_reduce  # torch's own module globals are wrapped too
    finally:
        recorder.disable()
    assert dist.all_reduce is original and recorder.get() is None


def test_torch_modules_that_imported_new_group_by_name_are_patched_too(group):
    # DeviceMesh holds its own reference (``from ...distributed_c10d import new_group``), taken before
    # hangdoc came: init_device_mesh's group creations must be recorded as new_group calls
    import torch.distributed.device_mesh as device_mesh

    original = device_mesh.new_group
    recorder.enable()
    try:
        assert device_mesh.new_group is not original and device_mesh.new_group.__hangdoc_original__ is original
    finally:
        recorder.disable()
    assert device_mesh.new_group is original


def test_discovery_covers_the_known_floor_and_more(group):
    import torch.distributed.distributed_c10d as c10d

    found = recorder.discover(c10d)
    present = {n for n in recorder.KNOWN if hasattr(c10d, n)}
    assert present <= set(found)
    assert {"all_reduce", "broadcast", "send", "recv", "isend", "irecv", "barrier", "batch_isend_irecv",
            "all_gather_object", "broadcast_object_list", "reduce_scatter_tensor", "all_to_all_single"} <= set(found)
    assert not {"get_rank", "new_group", "init_process_group", "destroy_process_group"} & set(found)
    # discovery, not the list, found these (present in 2.13 and absent from KNOWN)
    assert set(found) - set(recorder.KNOWN)


def test_ring_buffer_keeps_the_newest(group, tmp_path):
    r = recorder.enable(capacity=5, out_dir=str(tmp_path))
    try:
        t = torch.ones(3)
        for _ in range(8):
            dist.all_reduce(t)
        recs = r.records()
        assert [x.seq for x in recs] == [3, 4, 5, 6, 7]
        assert r.progress == 8 and r.pending() == []
        header = json.loads(open(r.dump()).readline())
        assert header["dropped"] == 3 and header["capacity"] == 5
    finally:
        recorder.disable()


def test_recorder_failure_is_contained_and_reported_once(rec, monkeypatch, capsys):
    def broken(group):
        raise RuntimeError("boom")

    monkeypatch.setattr(recorder, "_reported", [False])
    # the generated wrappers look groups up in the module's namespace: break the lookup there
    monkeypatch.setattr(recorder, "_group_info", broken)
    monkeypatch.setattr(recorder, "_groups", {})
    t = torch.ones(4)
    dist.all_reduce(t)
    dist.all_reduce(t)
    assert t.tolist() == [1.0] * 4  # the user's calls ran (world size 1: sum is the identity)
    err = capsys.readouterr().err
    assert err.count("hangdoc recorder: RuntimeError: boom") == 1
    assert rec.errors == 2 and rec.records() == []


def test_failed_call_is_recorded_and_reraised(rec):
    with pytest.raises(Exception) as info:
        dist.broadcast(torch.ones(2), src=5)  # no rank 5 in a world of one
    assert "hangdoc" not in str(info.value)
    last = rec.records()[-1]
    assert (last.op, last.state, last.root) == ("broadcast", "failed", 5)


def test_dump_round_trips_through_the_reader(rec, tmp_path):
    dist.all_reduce(torch.ones(2, 3, dtype=torch.float16))
    with recorder.phase("outer"):
        with recorder.phase("inner"):
            dist.barrier()
        dist.all_gather([torch.empty(1)], torch.ones(1))
    w = dist.all_reduce(torch.ones(1), async_op=True)
    w.wait()
    path = rec.dump()
    assert os.path.dirname(path) == str(tmp_path)
    assert [p for p in os.listdir(tmp_path) if p.endswith(".tmp")] == []
    src = Source(path)
    back = records_reader.read(path, src)
    assert src.errors == []
    assert back == rec.records()
    assert [(r.op, r.phase) for r in back] == [("all_reduce", None), ("barrier", "inner"), ("all_gather", "outer"),
                                              ("all_reduce", None)]
    assert back[0].shapes == ((2, 3),) and back[0].dtypes == ("float16",)
    assert back[-1].async_op and back[-1].state == "completed"


def test_work_wait_is_patched_only_after_an_async_call(group):
    import torch.distributed.distributed_c10d as c10d

    original = c10d.Work.wait
    recorder.enable()
    try:
        dist.all_reduce(torch.ones(1))
        assert c10d.Work.wait is original  # synchronous calls alone never pay for it
        dist.all_reduce(torch.ones(1), async_op=True).wait()
        assert c10d.Work.wait is not original
    finally:
        recorder.disable()
    assert c10d.Work.wait is original


def test_without_torch_enable_returns_none():
    code = ("import sys; sys.modules['torch'] = None\n"
            "from hangdoc.runtime import recorder\n"
            "print(recorder.enable(), recorder.get())\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["None", "None"]


def test_calls_torch_turns_into_no_ops_or_errors_leave_no_record(rec, capsys):
    import torch.distributed.distributed_c10d as c10d

    dist.all_reduce(torch.ones(1), group=c10d.GroupMember.NON_GROUP_MEMBER)  # torch: a no-op
    assert rec.records() == [] and rec.errors == 0
    assert "hangdoc recorder" not in capsys.readouterr().err


def test_an_unexpected_torch_leaves_everything_unpatched(group, monkeypatch, capsys):
    original = dist.all_reduce

    def broken(c10d):
        raise TypeError("surprising torch")

    monkeypatch.setattr(recorder, "discover", broken)
    monkeypatch.setattr(recorder, "_reported", [False])
    assert recorder.enable() is None and recorder.get() is None
    assert dist.all_reduce is original
    assert "hangdoc recorder: TypeError: surprising torch" in capsys.readouterr().err


def test_wrapper_keeps_the_signature_and_passes_every_argument_through(rec):
    seen = []

    def fake(tensor, /, op=None, group=None, *, async_op=False, extra="d"):
        seen.append((tensor, op, group, async_op, extra))

    import inspect

    w = recorder._wrap(fake, recorder._Spec("all_reduce", list(inspect.signature(fake).parameters)))
    assert inspect.signature(w) == inspect.signature(fake) and w.__name__ == "fake"
    t = torch.ones(2)
    w(t)
    w(t, "sum", None, async_op=False, extra="x")
    assert seen == [(t, None, None, False, "d"), (t, "sum", None, False, "x")]
    with pytest.raises(TypeError, match="fake"):
        w(tensor=t)  # positional-only, as in the original
    assert [r.shapes for r in rec.records()[-2:]] == [((2,),), ((2,),)]


def test_a_failing_call_from_c10d_itself_runs_once_and_raises_unchanged(rec, monkeypatch):
    calls = []

    def broadcast(tensor, src=None, group=None, async_op=False):
        calls.append(1)
        raise RuntimeError("peer gone")

    w = recorder._wrap(broadcast, recorder._Spec("broadcast", ["tensor", "src", "group", "async_op"]))
    # calls from this file count as torch.distributed's own (broadcast_object_list -> broadcast)
    monkeypatch.setattr(recorder, "_c10d_file", __file__)
    monkeypatch.setattr(recorder, "_internal_code", {})
    with pytest.raises(RuntimeError, match="peer gone"):
        w(torch.ones(1), src=0)
    assert calls == [1] and rec.errors == 0 and rec.records() == []


def test_records_are_untracked_by_the_young_collection(group):
    import gc

    r = recorder.enable(capacity=10_000)
    try:
        t = torch.ones(3, 2)
        for _ in range(100):
            dist.all_reduce(t)
        gc.collect()  # twice: a new group's info tuple may need a second look (startup only)
        gc.collect()
        for _ in range(3000):
            dist.all_reduce(t)
        gc.collect(0)  # one young collection: a record holding a fresh nested tuple survives it tracked
        assert sum(gc.is_tracked(x) for x in list(r._buf)[100:]) == 0
        assert r.records()[-1].shapes == ((3, 2),)
    finally:
        recorder.disable()


def test_a_collective_torch_issues_inside_a_recorded_one_is_not_a_call_of_its_own(group, monkeypatch):
    """Seen on torch 2.11 with CUDA tensors: every all_reduce was recorded twice, the second time
    at hangdoc's own wrapper ('<string>:69'), because torch issued a patched collective from a module
    other than c10d inside the recorded call. Modelled here: c10d's broadcast calls all_reduce from
    a helper that lives in torch's tree."""
    import functools

    from torch.distributed import distributed_c10d as c10d

    real = c10d.broadcast
    helper_file = os.path.join(os.path.dirname(torch.__file__), "distributed", "_hangdoc_nested_helper.py")
    ns = {"torch": torch, "real": real}
    exec(compile("def broadcast(*args, **kwargs):\n"
                 "    torch.distributed.all_reduce(torch.ones(1))  # torch-internal work, itself a patched collective\n"
                 "    return real(*args, **kwargs)\n", helper_file, "exec"), ns)
    broadcast = functools.wraps(real)(ns["broadcast"])

    monkeypatch.setattr(c10d, "broadcast", broadcast)
    monkeypatch.setattr(dist, "broadcast", broadcast)
    r = recorder.enable(capacity=100)
    try:
        dist.broadcast(torch.ones(2), src=0)
        dist.all_reduce(torch.ones(2))  # a call of its own: recorded, numbered after the broadcast's
        got = [(x.op, x.seq, os.path.basename(x.call_site.rsplit(":", 2)[0])) for x in r.records()]
    finally:
        recorder.disable()
    assert got == [("broadcast", 0, "test_recorder_unit.py"), ("all_reduce", 1, "test_recorder_unit.py")]


def test_new_group_is_a_record_of_its_own_sequence_with_its_members(rec):
    dist.all_reduce(torch.ones(1))
    dist.new_group([0])
    dist.barrier()
    got = [(x.op, x.group, x.seq, x.shapes, x.state, os.path.basename(x.call_site.rsplit(":", 2)[0]))
           for x in rec.records()]
    assert got == [("all_reduce", "default_pg", 0, ((1,),), "completed", "test_recorder_unit.py"),
                   ("new_group", "new_group", 0, ((0,),), "completed", "test_recorder_unit.py"),
                   ("barrier", "default_pg", 1, (), "completed", "test_recorder_unit.py")]
