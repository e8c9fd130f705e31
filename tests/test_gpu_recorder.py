"""The recorder's CUDA completion logic, exercised on CPU: a tensor that says it is on CUDA, a fake
stream and fake events, real gloo Work objects. On a GPU host examples/gpu/recorder_fidelity.py
checks the same against NCCL (see docs/gpu.md)."""

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent('''
    import json, os, socket, sys
    N = int(sys.argv[2])
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    import torch, torch.distributed as dist
    from hangdoc.runtime import recorder as R
    dist.init_process_group("gloo")

    class OnCuda(torch.Tensor):  # the recorder's view only: gloo still runs it on CPU
        is_cuda = property(lambda s: True)
        __torch_function__ = torch._C._disabled_torch_function_impl
        def get_device(self): return 0

    import threading
    created_on = []

    class Event:
        def __init__(self):
            self.done = False
            created_on.append(threading.current_thread() is threading.main_thread())
        def query(self): return self.done

    class Stream:  # cudaStreamQuery: idle once the test says the GPU caught up
        idle = False
        def query(self): return Stream.idle
        def __repr__(self): return "stream-object"

    recorded = []
    launched = [0]  # calls that reached the backend: an event records how many ran before it
    _allreduce = dist.ProcessGroup.allreduce
    def counting_allreduce(self, *a, **k):
        launched[0] += 1
        return _allreduce(self, *a, **k)
    dist.ProcessGroup.allreduce = counting_allreduce
    R._CUR_STREAM[0] = lambda device: (3, 0, 1)
    R._STREAMS[(3, 0, 1)] = ("stream3", Stream())
    R._Event[0] = R._new_event = Event
    def record_event(ev, stream):  # re-recording an event resets it, as cudaEventRecord does
        ev.done = False
        recorded.append((ev, stream, launched[0]))

    R._record_event = record_event
    R._CUDA_COMPLETION = sys.argv[1]
    if os.environ.get("WARM") != "1":  # events made here are counted per call below
        R.Recorder._warm_pool = lambda self, stream, n=8: None
    rec = R.enable()
    if sys.argv[1] == "work":
        R._install_wait()
    t = torch.ones(4).as_subclass(OnCuda)
    import time
    # BURSTS="5,5,5": that many calls back to back, PAUSE seconds between bursts; else N calls
    bursts = [int(b) for b in os.environ.get("BURSTS", "").split(",") if b] or [N]
    for i, b in enumerate(bursts):
        if i:
            # IDLE_IN_PAUSE=1: a host sync between bursts drains the stream
            Stream.idle = os.environ.get("IDLE_IN_PAUSE") == "1"
            time.sleep(float(os.environ.get("PAUSE", "0")))
        for j in range(b):
            dist.all_reduce(t)
            Stream.idle = False
    N = sum(bursts)
    markers = sorted({type(m[0]).__name__ for st in rec._streams.values() for m in st.marks})
    pending_before = len(rec.pending())
    mode = sys.argv[3] if len(sys.argv) > 3 else "events"
    if mode == "events":  # the GPU got past every event, the stream is not idle yet
        for ev, _, _ in recorded:
            ev.done = True
    elif mode == "wedged":  # a CUDA query blocks behind the job's stuck call: callers must not
        import time
        Stream.query = lambda self: time.sleep(60)
        t0 = time.monotonic(); first = len(rec.pending()); t1 = time.monotonic()
        second = len(rec.pending()); t2 = time.monotonic()
        path = rec.dump(os.path.join(os.environ["OUT"], "c.jsonl")); t3 = time.monotonic()
        print(json.dumps({"first_s": t1 - t0, "second_s": t2 - t1, "dump_s": t3 - t2, "pending": [first, second],
                          "dumped": os.path.exists(path)}))
        os._exit(0)  # the query thread is still asleep
    elif mode.startswith("stop:"):  # the GPU hangs in call K+1: only the first K calls ran
        for ev, _, ran in recorded:
            ev.done = ran <= int(mode[5:])
    else:  # the stream drained: no event needs asking
        Stream.idle = True
    out = {"markers": markers, "events": len(recorded), "pending_before": pending_before,
           "pending_after": len(rec.pending()), "progress": rec.progress,
           "streams": sorted({r.stream for r in rec.records()}),
           "stream_objects": sorted({repr(s) for _, s, _ in recorded}),
           "event_after_calls": [ran for _, _, ran in recorded],
           "created_off_main_thread": created_on.count(False), "created": len(created_on)}
    R.disable()
    dist.destroy_process_group()
    print(json.dumps(out))
''')


def run(mode, n=40, gpu="events", gap_ms=0, out="/tmp", warm=False, bursts="", pause=0.0, idle_in_pause=False):
    """The script above in its own process. ``gap_ms=0`` (an event after every call) unless a test
    is about the default spacing of events."""
    env = dict(os.environ, PYTHONPATH=ROOT, OUT=str(out), WARM="1" if warm else "0", BURSTS=bursts, PAUSE=str(pause),
               IDLE_IN_PAUSE="1" if idle_in_pause else "0")
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        env.pop(name, None)
    env["HANGDOC_CUDA_EVENT_GAP_MS"] = str(gap_ms)
    r = subprocess.run([sys.executable, "-c", SCRIPT, mode, str(n), gpu], capture_output=True, text=True, timeout=60, env=env,
                       cwd=ROOT, start_new_session=True)
    assert r.returncode == 0, r.stderr
    import json

    return json.loads(r.stdout.strip().splitlines()[-1])


def test_work_mode_uses_the_backends_work_and_records_no_event():
    out = run("work", 42)
    # c10d's own wait() handed over the Work: no CUDA event of ours, completion from is_completed().
    # The hot path sweeps every 4 markers: the last two are still queued at the end.
    assert out["markers"] == ["Work"] and out["events"] == 0
    assert out["pending_after"] == 0 and out["progress"] == 42 and out["streams"] == ["stream3"]


def test_event_mode_completes_in_stream_order_only_when_events_complete():
    out = run("event")
    # One event after every call (the default): no tail event needed.
    assert out["events"] == 40 and out["stream_objects"] == ["stream-object"]
    # Nothing is completed before its event is: a sync CUDA call returning is not completion.
    assert out["pending_before"] == 40
    assert out["pending_after"] == 0 and out["progress"] == 40


def test_event_mode_is_exact_at_the_hang_boundary():
    # The GPU ran the first 25 calls and hangs in the 26th: exactly 15 stay issued, so "blocked
    # in" names call 26, not an earlier one (what a sampled event would blur).
    out = run("event", 40, gpu="stop:25")
    assert out["pending_before"] == 40 and out["pending_after"] == 15 and out["progress"] == 25


def test_by_default_a_tight_loop_gets_one_event_per_gap_and_an_idle_stream_completes_the_rest():
    # 1000 calls back to back (well inside the 1 ms default gap, a few at most past it) and no GPU
    # progress: an event after the stream's first call and hardly any more; the sweeps find none
    # completed. No event is recorded off the job's thread; once the stream is idle all complete.
    out = run("event", 1000, gap_ms=1000, warm=True)
    assert out["pending_before"] == 1000
    assert out["events"] == 8 + 1  # the warm pool, the stream's first call
    assert out["pending_after"] == 999 and out["progress"] == 1
    out = run("event", 1000, gpu="idle", gap_ms=1000, warm=True)
    assert out["pending_after"] == 0 and out["progress"] == 1000


def test_a_pause_marks_the_end_of_the_burst_before_it():
    # Three bursts of 5 calls, 0.3 s apart, gap 200 ms: an event after call 1 (the stream's first)
    # and one before the first call of each later burst, so each burst's end is marked.
    out = run("event", gpu="stop:10", gap_ms=200, bursts="5,5,5", pause=0.3)
    assert out["event_after_calls"] == [1, 5, 10]
    # The GPU ran bursts 1 and 2 and hangs in the first call of burst 3: exact, as with an
    # event after every call.
    assert out["pending_after"] == 5 and out["progress"] == 10


def test_a_stream_drained_by_a_host_sync_completes_its_queue_without_an_event():
    # Between bursts the job waited on the GPU (.item()): the first call after the pause finds the
    # stream idle before its launch and completes everything queued, exactly; no event is needed.
    out = run("event", gpu="stop:0", gap_ms=200, bursts="5,5,5", pause=0.3, idle_in_pause=True)
    # Events only after the first call of each burst (a gap since the last one): none before
    # a burst, the query made it needless.
    assert out["event_after_calls"] == [1, 6, 11]
    assert out["pending_after"] == 5 and out["progress"] == 10


def test_inside_a_burst_the_states_blur_to_the_last_event():
    # The trade-off of spacing events, pinned down: the GPU ran 7 calls and hangs in the 8th (the
    # third of burst 2). The last event it passed marks the end of burst 1, so calls 6-7 still
    # read issued: at most one gap's worth of calls (Flight Recorder, where on, lifts them).
    out = run("event", gpu="stop:7", gap_ms=200, bursts="5,5,5", pause=0.3)
    assert out["pending_after"] == 10 and out["progress"] == 5


def test_an_idle_stream_completes_its_records_without_asking_events():
    out = run("event", 100, gpu="idle")
    # cudaStreamQuery said idle: everything queued so far is done, at once and exactly.
    assert out["pending_before"] == 100
    assert out["pending_after"] == 0 and out["progress"] == 100


def test_a_dump_takes_exact_states_from_this_processs_flight_recorder(monkeypatch):
    # The in-job half of the refinement: with Flight Recorder on, Recorder.dump() reads this
    # process's Flight Recorder buffer (torch._C._distributed_c10d._dump_nccl_trace) and lifts the
    # records it saw complete. Fed with the 2 x H200 capture whose events were sampled.
    import torch._C._distributed_c10d as c10d_c

    from hangdoc.readers import records as records_reader
    from hangdoc.runtime import recorder as R

    base = os.path.join(ROOT, "tests", "fixtures", "gpu", "hangdoc-run-sampled", "nccl_pipeline_cycle")
    rec_file = [f for f in os.listdir(os.path.join(base, "records")) if "-r0-" in f][0]
    mine = records_reader.read(os.path.join(base, "records", rec_file))
    assert [r.state for r in mine] == ["issued"] * 8
    with open(os.path.join(base, "fr", "nccl_trace_rank_0"), "rb") as f:
        blob = f.read()
    monkeypatch.setattr(c10d_c, "_dump_nccl_trace", lambda **kw: blob, raising=False)
    monkeypatch.setattr(c10d_c, "_dump_fr_trace", lambda **kw: b"", raising=False)
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "2000")
    assert R._refine_from_flight_recorder(mine) == 6
    assert [r.state for r in mine] == ["completed"] * 6 + ["issued"] * 2
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "0")  # Flight Recorder off: nothing is asked
    assert R._refine_from_flight_recorder(mine) == 0


def test_a_wedged_cuda_query_never_blocks_the_caller(tmp_path):
    # The 2 x H200 dataloader capture: the job's thread sat inside NCCL and a CUDA query from the
    # watchdog's thread blocked behind it, so that rank never dumped. Queries now run on their own
    # thread and the caller waits at most a second.
    out = run("event", 40, gpu="wedged", out=tmp_path)
    assert out["pending"] == [40, 40] and out["dumped"]
    assert out["first_s"] < 2.0 and out["second_s"] < 0.2 and out["dump_s"] < 2.0, out


def test_events_are_created_on_the_jobs_thread_only():
    # Creating a CUDA event takes the driver's context lock for writing; on 2 x H200 a query
    # thread blocked there behind the job's thread stuck in cuLaunchKernel. The pool is warmed at a
    # stream's first call (the job's thread), and no other thread records one.
    out = run("event", 5, gpu="idle", gap_ms=1000, warm=True)
    assert out["created"] >= 8 and out["created_off_main_thread"] == 0
    assert out["pending_after"] == 0 and out["progress"] == 5
