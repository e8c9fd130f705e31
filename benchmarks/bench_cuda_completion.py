"""The recorder's CUDA completion bookkeeping on a CPU machine: this checkout vs a baseline revision.

The recorder's hot path for a synchronous call on a CUDA tensor, and the completion of those calls
later (an idle stream, a completed event), measured with stand-ins for the CUDA parts: a tensor that
says it is on CUDA, a stream whose ``query()`` says idle when the test says the GPU caught up, events
that complete when the GPU got past them. Time is virtual for the recorder (each call 30 µs after
the previous one, a pause of 2 ms between bursts, so events fall as in a real loop of small NCCL
calls) and real for the measurement. The wrapped function is a no-op with all_reduce's signature,
so what is timed is the recorder alone.

The baseline is an earlier ``hangdoc/runtime/recorder.py`` loaded as a second module in the same
process (``--baseline-rev REV``: taken with ``git show``; ``--baseline-file F``: a copy of one).
Rounds alternate which runs first; the paired medians (same round) are what to compare.

    python benchmarks/bench_cuda_completion.py --baseline-rev 4649312 [--rounds 15] [--bursts 40] [--burst 200]

Then the latency of the one call that completes a burst (200 and 10,000 calls) after a drained
pause: the job's thread pays it once per burst.

Patterns:
  drain   bursts end in a host sync: the first call after the pause finds the stream idle and
          completes the burst (the common training loop: a loss.item() per step)
  events  the GPU keeps up but is never idle when asked: completion comes from the recorder's
          events, one per ms (found completed by the sweeps at new events)
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


class _GPU:
    launched = 0
    ran = 0
    idle_when_asked = True


class _Event:
    def __init__(self):
        self.after = 0

    def query(self):
        return _GPU.ran >= self.after


class _Stream:
    def query(self):
        return _GPU.idle_when_asked and _GPU.ran >= _GPU.launched


def _record_event(ev, stream):
    ev.after = _GPU.launched


class _Clock:
    now = 1000.0

    def __call__(self):
        return self.now


def _prepare(mod, clock):
    """Stand-ins for CUDA in one recorder module (they are module globals it reads at call time)."""
    mod._CUR_STREAM[0] = lambda device: (3, 0, 1)
    mod._STREAMS[(3, 0, 1)] = ("stream3", _Stream())
    mod._Event[0] = _Event
    mod._new_event = _Event
    mod._record_event = _record_event
    mod._time = clock
    mod._cuda_built = lambda: True  # a CUDA torch: the wrappers ask an exact torch.Tensor is_cuda


def _wrapped(mod):
    def all_reduce(tensor, op=None, group=None, async_op=False):
        _GPU.launched += 1

    return mod._wrap(all_reduce, mod._Spec("all_reduce", ["tensor", "op", "group", "async_op"]))


def _loop(mod, t, pattern: str, bursts: int, burst: int, clock) -> float:
    """µs per call (real time) over ``bursts`` bursts of ``burst`` calls, completion included."""
    rec = mod.enable(capacity=100_000)
    mod._Tensor[0] = type(t)  # the exact-type fast path, as for a real CUDA torch.Tensor
    fn = _wrapped(mod)
    gc.collect()
    _GPU.launched = _GPU.ran = 0
    _GPU.idle_when_asked = pattern == "drain"
    t0 = time.perf_counter()
    for _ in range(bursts):
        for _ in range(burst):
            clock.now += 30e-6
            fn(t)
            if pattern == "events":
                _GPU.ran = _GPU.launched  # the GPU keeps up, never idle when asked
        clock.now += 2e-3
        if pattern == "drain":
            _GPU.ran = _GPU.launched  # the host sync
    rec._sweep()  # the watchdog's poll sees the rest
    dt = time.perf_counter() - t0
    states = {}
    for r in rec.records():
        states[r.state] = states.get(r.state, 0) + 1
    if not getattr(rec, "_streams", None) and not getattr(rec, "_events", None):  # this checkout / older ones
        raise SystemExit(f"{mod.__name__}: the calls did not take the CUDA path")
    mod.disable()
    n = bursts * burst
    if pattern == "drain" and states.get("completed") != n:
        raise SystemExit(f"{mod.__name__}: {states} after a drained stream, expected {n} completed")
    return dt / n * 1e6


def _burst_end(mod, t, burst: int, clock, bursts: int = 15) -> float:
    """µs of the one call after a drained pause that completes a whole burst before its launch
    (it asks the stream, finds it idle and completes what the burst queued): the job's thread
    pays this once per burst. Median over ``bursts`` bursts of one recorder."""
    rec = mod.enable(capacity=100_000)
    mod._Tensor[0] = type(t)
    fn = _wrapped(mod)
    _GPU.launched = _GPU.ran = 0
    _GPU.idle_when_asked = True
    times = []
    for _ in range(bursts):
        for _ in range(burst):
            clock.now += 30e-6
            fn(t)
        clock.now += 2e-3
        _GPU.ran = _GPU.launched  # the host sync
        t0 = time.perf_counter()
        fn(t)
        times.append(time.perf_counter() - t0)
    pending = len(rec.pending())
    mod.disable()
    if pending != 1:
        raise SystemExit(f"{mod.__name__}: {pending} pending after the last burst's end, expected 1")
    return statistics.median(times) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--baseline-rev", help="git revision whose hangdoc/runtime/recorder.py is the baseline")
    g.add_argument("--baseline-file", help="a recorder.py to compare with")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--bursts", type=int, default=40)
    ap.add_argument("--burst", type=int, default=200, help="calls per burst")
    args = ap.parse_args()

    if args.baseline_rev:
        src = subprocess.run(["git", "show", f"{args.baseline_rev}:hangdoc/runtime/recorder.py"], cwd=ROOT,
                             check=True, capture_output=True, text=True).stdout
        fd, base_path = tempfile.mkstemp(suffix="_recorder.py")
        with os.fdopen(fd, "w") as f:
            f.write(src)
        label = args.baseline_rev
    else:
        base_path, label = args.baseline_file, os.path.basename(args.baseline_file)

    from hangdoc.proctree import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    import torch
    import torch.distributed as dist

    from hangdoc.runtime import recorder as current

    baseline = _load(base_path, "hangdoc.runtime._baseline_recorder")
    dist.init_process_group("gloo")

    class OnCuda(torch.Tensor):  # the recorder's view only
        is_cuda = property(lambda s: True)
        __torch_function__ = torch._C._disabled_torch_function_impl

        def get_device(self):
            return 0

    t = torch.ones(1024).as_subclass(OnCuda)
    clock = _Clock()
    mods = {"current": current, f"baseline {label}": baseline}
    for mod in mods.values():
        _prepare(mod, clock)
    print(f"CUDA completion bookkeeping, stand-in stream and events, {args.rounds} rounds x {args.bursts} bursts "
          f"x {args.burst} calls (virtual 30 µs apart, 2 ms pause between bursts); python {sys.version.split()[0]}, "
          f"torch {torch.__version__}")
    for pattern in ("drain", "events"):
        times = {name: [] for name in mods}
        names = list(mods)
        for r in range(args.rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                times[name].append(_loop(mods[name], t, pattern, args.bursts, args.burst, clock))
        cur, base = times["current"], times[names[1]]
        d = sorted(a - b for a, b in zip(cur, base))
        q = statistics.quantiles(d, n=4)
        ratio = statistics.median(a / b for a, b in zip(cur, base))
        print(f"  {pattern:6s}: current {statistics.median(cur):6.3f} µs/call, {names[1]} {statistics.median(base):6.3f} "
              f"µs/call; paired difference median {q[1]:+.3f} µs/call (quartiles {q[0]:+.3f} .. {q[2]:+.3f}), "
              f"ratio {ratio:.3f}")
    for burst in (200, 10_000):
        cur = _burst_end(current, t, burst, clock)
        base = _burst_end(baseline, t, burst, clock)
        print(f"  the call that completes a burst of {burst:>6}: current {cur:8.1f} µs, {names[1]} {base:8.1f} µs "
              f"(median of 15 bursts)")
    dist.destroy_process_group()
    if args.baseline_rev:
        os.unlink(base_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
