"""Signatures: what a frame and a stack wait in, across torch 1.x-2.x, Python 3.8-3.13 and dumpers."""

from __future__ import annotations

import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hangdoc.analysis.signatures import (
    CATEGORIES,
    classify,
    classify_stack,
    in_loop,
    is_launcher_stack,
    is_library,
)
from hangdoc.model import Frame

SITE = "/opt/conda/lib/python3.8/site-packages/"


def F(function, file="", line=None, native=False, **locals_):
    return Frame(function, file, line, native, tuple((k, str(v)) for k, v in locals_.items()))


def stack(*frames):
    """Frames given innermost first (as dumpers print them); returned outermost first."""
    return tuple(reversed(frames))


USER = (F("train_step", "train.py", 12), F("main", "train.py", 40), F("<module>", "train.py", 44))


@pytest.mark.parametrize(
    "frame, category, op",
    [
        # torch 1.x, py-spy short paths, full paths, site-packages-relative paths (normalised)
        (F("broadcast", "torch/distributed/distributed_c10d.py", 1191), "collective", "broadcast"),
        (F("broadcast", SITE + "torch/distributed/distributed_c10d.py", 1191), "collective", "broadcast"),
        (F("all_reduce", "torch/distributed/distributed_c10d.py", 1316), "collective", "all_reduce"),
        (F("all_gather_into_tensor", "torch/distributed/distributed_c10d.py", 2900), "collective", "all_gather_into_tensor"),
        (F("_reduce_scatter_base", "torch/distributed/distributed_c10d.py", 2900), "collective", "_reduce_scatter_base"),
        (F("all_to_all_single", "torch/distributed/distributed_c10d.py", 3700), "collective", "all_to_all_single"),
        (F("monitored_barrier", "torch/distributed/distributed_c10d.py", 4000), "collective", "monitored_barrier"),
        (F("broadcast_object_list", "torch/distributed/distributed_c10d.py", 3000), "collective", "broadcast_object_list"),
        (F("recv", "torch/distributed/distributed_c10d.py", 1002), "p2p", "recv"),
        (F("batch_isend_irecv", "torch/distributed/distributed_c10d.py", 1002), "p2p", "batch_isend_irecv"),
        # DeepSpeed comm layer and pipe p2p, Megatron mappings
        (F("all_reduce", "deepspeed/comm/comm.py", 500), "collective", "all_reduce"),
        (F("all_reduce", "deepspeed/comm/torch.py", 120), "collective", "all_reduce"),
        (F("recv", "deepspeed/runtime/pipe/p2p.py", 83), "p2p", "recv"),
        (F("_reduce", "megatron/core/tensor_parallel/mappings.py", 24), "collective", "all_reduce"),
        (F("_gather_along_first_dim", "megatron/mpu/mappings.py", 80), "collective", "all_gather"),
        # host syncs
        (F("synchronize", "torch/cuda/__init__.py", 566), "host-sync", "synchronize"),
        (F("cudaStreamSynchronize", "libcudart.so.12", native=True), "host-sync", "synchronize"),
        (F("cudaMemcpy", "libcudart.so.11.0"), "host-sync", "synchronize"),
        (F("at::native::_local_scalar_dense_cuda", "libtorch_cuda.so", native=True), "host-sync", "item"),
        (F("c10d::ProcessGroupNCCL::WorkNCCL::synchronize", "libtorch_cuda.so", native=True), "host-sync", "synchronize"),
        (F("c10d::Work::wait", "libtorch_cpu.so", native=True), "host-sync", "wait"),
        # native collectives
        (F("gloo::transport::tcp::UnboundBuffer::waitRecv", "libtorch_cpu.so", native=True), "collective", "gloo"),
        (F("gloo::allreduce", "libtorch_cpu.so", native=True), "collective", "all_reduce"),
        (F("ncclGroupEnd", "libnccl.so.2", native=True), "collective", "nccl"),
        (F("c10d::ProcessGroupGloo::RecvWork::wait", "libtorch_cpu.so", native=True), "p2p", "recv"),
        # DataLoader
        (F("_try_get_data", "torch/utils/data/dataloader.py", 1011), "dataloader-wait", "next batch"),
        (F("_MultiProcessingDataLoaderIter._get_data", "torch/utils/data/dataloader.py", 1464), "dataloader-wait", "next batch"),
        (F("_worker_loop", "torch/utils/data/_utils/worker.py", 334), "dataloader-worker", "worker"),
        # locks, sleeps, io: Python 3.8 names and 3.11+ qualified names, stdlib short and full paths
        (F("wait", "threading.py", 306), "lock", "lock"),
        (F("Condition.wait", "/usr/lib/python3.12/threading.py", 355), "lock", "lock"),
        (F("Thread._wait_for_tstate_lock", "threading.py", 1119), "lock", "lock"),
        (F("Queue.get", "queue.py", 171), "lock", "queue"),
        (F("PyThread_acquire_lock_timed", "libpython3.11.so", native=True), "lock", "lock"),
        (F("pthread_mutex_lock", "libc.so.6", native=True), "lock", "lock"),
        (F("clock_nanosleep", "libc.so.6", native=True), "sleep", "sleep"),
        (F("_PollLikeSelector.select", "selectors.py", 415), "io", "io"),
        (F("select_poll_poll_impl", "selectmodule.c", 655), "io", "io"),
        (F("Connection._poll", "multiprocessing/connection.py", 440), "io", "io"),
        (F("socket.accept", "/usr/lib/python3.9/socket.py", 293), "io", "io"),
        # not waits
        (F("train_step", "train.py", 12), None, None),
        (F("wrapper", "torch/distributed/c10d_logger.py", 83), None, None),
        (F("forward", "torch/nn/modules/linear.py", 114), None, None),
        (F("broadcast", "mylib/comm.py", 10), None, None),
    ],
)
def test_classify(frame, category, op):
    sig = classify(frame)
    if category is None:
        assert sig is None
    else:
        assert sig is not None and (sig.category, sig.op) == (category, op)


def test_torch1_and_torch2_collective_same_verdict():
    torch1 = stack(F("broadcast", "torch/distributed/distributed_c10d.py", 1191), *USER)
    torch2 = stack(F("broadcast", "torch/distributed/distributed_c10d.py", 2793),
                   F("_exception_logger.<locals>.wrapper", "torch/distributed/c10d_logger.py", 83), *USER)
    native = stack(F("pthread_cond_wait", "libc.so.6", native=True), F("c10d::Work::wait", "libtorch_cpu.so", native=True),
                   F("pybind11::cpp_function::dispatcher", "libtorch_python.so", native=True),
                   F("broadcast", "torch/distributed/distributed_c10d.py", 2793),
                   F("wrapper", "torch/distributed/c10d_logger.py", 75), *USER)
    for s in (torch1, torch2, native):
        w = classify_stack(s)
        assert (w.category, w.op, w.frame.function, w.call_site) == ("collective", "broadcast", "broadcast", USER[0])


def test_outermost_operation_wins_inside_wrappers():
    ds = stack(F("broadcast", "torch/distributed/distributed_c10d.py", 1191), F("recv", "deepspeed/runtime/pipe/p2p.py", 83),
               F("_exec_recv_activations", "deepspeed/runtime/pipe/engine.py", 1073), F("_exec_schedule", "deepspeed/runtime/pipe/engine.py", 1380))
    w = classify_stack(ds)
    assert (w.category, w.op, w.call_site.function) == ("p2p", "recv", "_exec_recv_activations")
    obj = stack(F("broadcast", "torch/distributed/distributed_c10d.py", 1), F("broadcast_object_list", "torch/distributed/distributed_c10d.py", 2), *USER)
    assert classify_stack(obj).op == "broadcast_object_list"
    ds_comm = stack(F("all_reduce", "torch/distributed/distributed_c10d.py", 1), F("all_reduce", "deepspeed/comm/torch.py", 120),
                    F("log_wrapper", "deepspeed/comm/comm.py", 117), F("all_reduce", "deepspeed/comm/comm.py", 496),
                    F("allreduce_bucket", "deepspeed/runtime/zero/stage_1_and_2.py", 1400))
    w = classify_stack(ds_comm)
    assert (w.op, w.call_site.function) == ("all_reduce", "allreduce_bucket")


def test_dataloader_wait_beats_the_lock_inside_it_py38_and_py311():
    py38 = stack(F("wait", "threading.py", 306), F("get", "queue.py", 179), F("_try_get_data", "torch/utils/data/dataloader.py", 1011),
                 F("_get_data", "torch/utils/data/dataloader.py", 1163), F("_next_data", "torch/utils/data/dataloader.py", 1207),
                 F("__next__", "torch/utils/data/dataloader.py", 530), F("_next_batch", "deepspeed/runtime/pipe/engine.py", 627))
    py311 = stack(F("_PollLikeSelector.select", "selectors.py", 415), F("wait", "multiprocessing/connection.py", 947),
                  F("Queue.get", "multiprocessing/queues.py", 113),
                  F("_MultiProcessingDataLoaderIter._try_get_data", "torch/utils/data/dataloader.py", 1291),
                  F("_MultiProcessingDataLoaderIter._get_data", "torch/utils/data/dataloader.py", 1464),
                  F("_BaseDataLoaderIter.__next__", "torch/utils/data/dataloader.py", 725), F("main", "dl.py", 60))
    assert classify_stack(py38).category == classify_stack(py311).category == "dataloader-wait"
    assert classify_stack(py38).call_site.function == "_next_batch"


def test_single_process_loader_in_user_dataset_is_not_a_dataloader_wait():
    s = stack(F("__getitem__", "ds.py", 9), F("fetch", "torch/utils/data/_utils/fetch.py", 51),
              F("_SingleProcessDataLoaderIter._next_data", "torch/utils/data/dataloader.py", 674),
              F("__next__", "torch/utils/data/dataloader.py", 630), F("main", "train.py", 3))
    w = classify_stack(s, state="active")
    assert w.category == "compute" and w.call_site.function == "__getitem__"
    assert classify_stack(s, state="idle").category == "unknown"


def test_worker_idle_vs_stuck():
    fork = (F("main", "dl.py", 60), F("DataLoader.__iter__", "torch/utils/data/dataloader.py", 505),
            F("BaseProcess._bootstrap", "multiprocessing/process.py", 314), F("BaseProcess.run", "multiprocessing/process.py", 108),
            F("_worker_loop", "torch/utils/data/_utils/worker.py", 334))
    idle = fork + (F("Queue.get", "multiprocessing/queues.py", 113), F("_PollLikeSelector.select", "selectors.py", 415))
    stuck = fork + (F("fetch", "torch/utils/data/_utils/fetch.py", 54), F("CountingDataset.__getitem__", "dl.py", 35))
    native_stuck = stuck + (F("PyThread_acquire_lock_timed", "libpython3.11.so", native=True), F("sem_clockwait", "libc.so.6", native=True))
    assert classify_stack(idle, "idle").detail == "idle"
    assert classify_stack(stuck, "idle").detail == "blocked"
    w = classify_stack(native_stuck, "idle")
    assert (w.category, w.detail, w.call_site.function) == ("dataloader-worker", "stuck in a lock", "CountingDataset.__getitem__")


@pytest.mark.parametrize(
    "locals_on, frame_locals, expect",
    [
        ("recv", {"src": 3}, (3, False)),
        ("wrapper", {"kwargs": '{"src": 5}'}, (5, False)),  # py-spy 0.4 JSON-ish repr
        ("wrapper", {"kwargs": "{'dst': 7, 'group': None}"}, (7, False)),  # Python repr
        ("recv", {"src": "None", "group_src": 1}, (1, True)),
        ("recv", {}, (None, False)),
    ],
)
def test_peer_from_locals(locals_on, frame_locals, expect):
    op = "send" if "dst" in str(frame_locals) else "recv"
    inner = F(op, "torch/distributed/distributed_c10d.py", 1002, **(frame_locals if locals_on == "recv" else {}))
    wrapper = F("wrapper", "torch/distributed/c10d_logger.py", 83, **(frame_locals if locals_on == "wrapper" else {}))
    w = classify_stack(stack(inner, wrapper, *USER))
    assert (w.category, w.peer, w.peer_is_group_rank) == ("p2p", expect[0], expect[1])


def test_root_of_broadcast_from_locals_but_not_for_all_reduce():
    b = classify_stack(stack(F("broadcast", "torch/distributed/distributed_c10d.py", 1, src=0), *USER))
    a = classify_stack(stack(F("all_reduce", "torch/distributed/distributed_c10d.py", 1, op="SUM"), *USER))
    assert (b.root, b.peer, a.root) == (0, None, None)


def test_native_only_and_compute_and_sleep():
    assert classify_stack(stack(F("cudaStreamSynchronize", "libcudart.so", native=True), F("THPVariable_item", "libtorch_python.so", native=True), *USER)).op == "item"
    assert classify_stack(stack(F("nanosleep", "libc.so.6"), F("time_sleep", "timemodule.c", 400), *USER)).category == "sleep"
    w = classify_stack(stack(*USER), state="active")
    assert (w.category, w.call_site) == ("compute", USER[0])
    assert classify_stack(()).category == "unknown"


def test_library_and_launchers():
    assert is_library(F("get", "/usr/lib/python3.10/queue.py", 179))
    assert is_library(F("forward", SITE + "torch/nn/modules/module.py", 1))
    assert not is_library(F("main", "/home/u/torchy_project/train.py", 1))
    agent = stack(F("SimpleElasticAgent._invoke_run", "torch/distributed/elastic/agent/server/api.py", 908), F("main", "torch/distributed/run.py", 900))
    assert is_launcher_stack(agent)
    spawn_parent = stack(F("join", "torch/multiprocessing/spawn.py", 140), F("start_processes", "torch/multiprocessing/spawn.py", 198), F("<module>", "t.py", 3))
    spawn_child = stack(F("all_reduce", "torch/distributed/distributed_c10d.py", 1), F("_wrap", "torch/multiprocessing/spawn.py", 69))
    assert is_launcher_stack(spawn_parent) and not is_launcher_stack(spawn_child)
    assert not is_launcher_stack(stack(F("wrapper", "torch/distributed/elastic/multiprocessing/errors/__init__.py", 345), *USER))


def test_in_loop(tmp_path):
    src = tmp_path / "t.py"
    src.write_text(textwrap.dedent("""\
        import x
        def f():
            x.setup()
            for i in range(3):
                x.all_reduce(i)
            while True:
                if i:
                    x.barrier()
        x.done()
        """))
    assert [in_loop(str(src), n) for n in (3, 5, 8, 9)] == [False, True, True, False]
    assert in_loop(str(tmp_path / "missing.py"), 1) is None


frames_st = st.builds(
    Frame,
    function=st.sampled_from(["broadcast", "recv", "wait", "get", "_try_get_data", "_worker_loop", "main", "Condition.wait",
                              "cudaStreamSynchronize", "gloo::allreduce", "sleep", "select", "0x7f00", "<module>", "x" * 3]),
    file=st.sampled_from(["", "train.py", "threading.py", "queue.py", "torch/distributed/distributed_c10d.py", "libc.so.6",
                          "torch/utils/data/dataloader.py", "torch/utils/data/_utils/worker.py", "deepspeed/comm/comm.py"]),
    line=st.one_of(st.none(), st.integers(0, 5000)),
    native=st.booleans(),
    locals=st.lists(st.tuples(st.sampled_from(["src", "dst", "kwargs", "group_src", "x"]),
                              st.sampled_from(["0", "3", "None", "{'src': 2}", "{", "-1", "nan"])), max_size=3).map(tuple),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(frames_st, max_size=12), st.sampled_from([None, "idle", "active", "active+gil"]))
def test_classify_stack_total(frames, state):
    """Any stack gets one category from the list; the wait frame and call site are frames of it."""
    w = classify_stack(frames, state)
    assert w.category in CATEGORIES
    assert w.frame is None or w.frame in frames
    assert w.call_site is None or w.call_site in frames
    # the cache never mixes up stacks that differ only in locals
    bare = tuple(Frame(f.function, f.file, f.line, f.native) for f in frames)
    v = classify_stack(bare, state)
    assert (v.category, v.op) == (w.category, w.op)
    assert v.peer is None and v.root is None
