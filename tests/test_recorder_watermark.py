"""CUDA completion by per-stream watermarks, against a stand-in GPU (no torch.distributed needed).

The recorder never rewrites a queued CUDA record: a completed event or an idle stream moves the
stream's watermark, and ``records()``/``pending()`` read each record's state off it. Hypothesis
drives random call/pause/GPU-progress/sweep sequences and checks what must hold whatever the
timing: nothing reads completed that the GPU has not run, completed calls form a prefix of the
stream's calls, an idle stream reads fully completed, ``progress`` counts completed calls, and a
call still inside its launch reads issued.
"""

import collections

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hangdoc.runtime import recorder as R

pytestmark = pytest.mark.filterwarnings("ignore")


class GPU:
    """Runs the stream's calls in order; ``ran`` of the ``launched`` are done."""

    def __init__(self):
        self.launched = 0
        self.ran = 0


class Event:
    def __init__(self):
        self.after = None  # calls launched before it was recorded
        self.gpu = None

    def query(self):
        return self.gpu.ran >= self.after


class Stream:
    def __init__(self, gpu):
        self.gpu = gpu

    def query(self):
        return self.gpu.ran >= self.gpu.launched


@pytest.fixture
def fake_cuda(monkeypatch):
    gpu = GPU()

    def record(ev, stream):
        ev.after, ev.gpu = gpu.launched, gpu

    monkeypatch.setattr(R, "_new_event", Event)
    monkeypatch.setattr(R, "_record_event", record)
    saved = R._Event[0]
    R._Event[0] = Event
    yield gpu, ("stream7", Stream(gpu))
    R._Event[0] = saved


def _record(seq, t0, stream="stream7", async_op=False):
    return (seq, "all_reduce", ("default_pg", (0, 1)), ((4,),), ("float32",), None, None, async_op,
            None, stream, None, t0, None, "issued")


def _call(rec_, gpu, stream, seq, t0):
    """What the generated wrapper does for one synchronous call on a CUDA tensor."""
    st_ = rec_._streams.get(stream[0])
    if st_ is not None and t0 - st_.last_call >= min(R._EVENT_GAP, R._IDLE_AFTER) and st_.n != st_.marked_n:
        rec_._close_burst(st_, t0)
    r = _record(seq, t0)
    rec_._buf.append(r)
    gpu.launched += 1  # the launch, inside the call
    rec_._track_cuda(r, stream, t0)
    return r


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("call"), st.sampled_from([0.00001, 0.0002, 0.002])),  # pause before it
        st.tuples(st.just("run"), st.integers(0, 6)),  # the GPU runs up to that many more calls
        st.tuples(st.just("drain"), st.none()),  # a host sync: the GPU caught up
        st.tuples(st.just("sweep"), st.none()),  # the watchdog's poll
    ),
    max_size=80,
)


def _check(rec_, gpu, n_calls, capacity):
    states = [(r[R._SEQ], r[R._STATE], r[R._T0], r[R._T1]) for r in rec_._resolved()]
    done = [s for s in states if s[1] == "completed"]
    # Completed calls form a prefix of the stream's calls (of those still in the buffer) ...
    assert [s[1] for s in states] == ["completed"] * len(done) + ["issued"] * (len(states) - len(done))
    # ... and the GPU ran every one of them.
    assert all(seq < gpu.ran for seq, *_ in done)
    # Times seen completed: after the call, in order.
    assert all(t1 >= t0 for _, _, t0, t1 in done)
    assert [t1 for *_, t1 in done] == sorted(t1 for *_, t1 in done)
    # progress counts every completed call, the evicted ones too.
    evicted = n_calls - len(states)
    if done:
        assert rec_._progress == evicted + len(done)
    else:
        assert rec_._progress <= evicted
    assert len(states) == min(n_calls, capacity)


# The fixture's GPU is reset by hand per example; the recorder is new each time.
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, capacity=st.sampled_from([8, 1000]))
def test_watermarks_never_complete_what_the_gpu_has_not_run(fake_cuda, ops, capacity):
    gpu, stream = fake_cuda
    gpu.launched = gpu.ran = 0
    rec_ = R.Recorder(capacity=capacity)
    t, seq = 1000.0, 0
    for op, arg in ops:
        if op == "call":
            t += arg
            _call(rec_, gpu, stream, seq, t)
            seq += 1
        elif op == "run":
            gpu.ran = min(gpu.launched, gpu.ran + arg)
        elif op == "drain":
            gpu.ran = gpu.launched
        else:
            rec_._sweep()
        _check(rec_, gpu, seq, capacity)
        assert rec_._progress <= gpu.ran
    # A host sync and the watchdog's poll: everything launched reads completed, exactly.
    gpu.ran = gpu.launched
    rec_._sweep()
    states = [r[R._STATE] for r in rec_._resolved()]
    assert states == ["completed"] * min(seq, capacity)
    assert rec_._progress == seq


def test_a_call_inside_its_launch_reads_issued_when_the_stream_is_idle(fake_cuda):
    # The job's thread is inside the launch of call 5 (its record is buffered, the call has not
    # returned, the kernel is not queued): the stream reads idle, calls 0-4 complete, 5 does not.
    gpu, stream = fake_cuda
    rec_ = R.Recorder()
    for i in range(5):
        _call(rec_, gpu, stream, i, 1000.0 + i * 1e-5)
    rec_._buf.append(_record(5, 1000.1))
    gpu.ran = gpu.launched
    rec_._sweep()
    assert [r[R._STATE] for r in rec_._resolved()] == ["completed"] * 5 + ["issued"]
    assert [r.seq for r in rec_.pending()] == [5] and rec_._progress == 5


def test_other_records_keep_their_own_states(fake_cuda):
    # Async calls on the same stream complete through their Work, CPU calls at once, failed calls
    # stay failed: the watermark walk passes them by.
    gpu, stream = fake_cuda
    rec_ = R.Recorder()
    _call(rec_, gpu, stream, 0, 1000.0)
    rec_._buf.append(_record(1, 1000.00001, async_op=True))
    rec_._buf.append(_record(2, 1000.00002, stream=None))
    rec_._buf.append(_record(3, 1000.00003)[:R._T1] + (1000.00004, "failed"))
    _call(rec_, gpu, stream, 4, 1000.00005)
    gpu.ran = gpu.launched
    rec_._sweep()
    assert [r[R._STATE] for r in rec_._resolved()] == ["completed", "issued", "issued", "failed", "completed"]


def test_a_batch_of_ten_thousand_completes_without_touching_a_record(fake_cuda):
    # What the watermark is for: completion costs the same for 1 call or 10,000 (the records are
    # the very objects the calls buffered until someone reads them).
    gpu, stream = fake_cuda
    rec_ = R.Recorder()
    calls = [_call(rec_, gpu, stream, i, 1000.0 + i * 1e-6) for i in range(10_000)]
    gpu.ran = gpu.launched
    rec_._sweep()
    assert all(a is b for a, b in zip(calls, rec_._buf)) and rec_._progress == 10_000
    assert collections.Counter(r[R._STATE] for r in rec_._resolved()) == {"completed": 10_000}


def test_the_watermark_history_keeps_no_evicted_record_alive(fake_cuda):
    # A ring of 8 records, the GPU catching up every 4th call: each completion covers 4 calls,
    # so 8 batches would span 32 calls. The history names only records still in the ring, so it
    # holds no evicted record alive.
    gpu, stream = fake_cuda
    rec_ = R.Recorder(capacity=8)
    for i in range(200):
        _call(rec_, gpu, stream, i, 1000.0 + i * 0.002)  # 2 ms apart: an event after each
        if i % 4 == 3:
            gpu.ran = gpu.launched
            rec_._sweep()
    st = rec_._streams["stream7"]
    in_ring = {id(r) for r in rec_._buf}
    assert len(st.history) >= 2 and all(id(last) in in_ring for last, _ in st.history)
    assert [r[R._STATE] for r in rec_._resolved()] == ["completed"] * 8 and rec_._progress == 200
