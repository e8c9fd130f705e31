"""Recorder overhead: small gloo all_reduce in a loop, recorder off vs on, side by side in one run.

    python benchmarks/bench_recorder.py [--calls 4000] [--rounds 15] [--world 1] [--cpu N]

Prints µs per call off and on, the added µs per call and the ratio (target: ≤ 2 µs added), for the
fastest and the median round of each. Rounds alternate off/on so that machine load hits both
alike; each round starts after a full garbage collection (so neither inherits the other's
garbage) and with the same tensor and loop. With --world 2 a second rank runs the same loop.

--cpu N pins the process (gloo's worker threads included) to CPU N before the process group
exists. On a small shared VM the unpinned gloo call time is bimodal (about 11 µs when the kernel
keeps gloo's worker next to the caller, 28-45 µs when a wake-up crosses CPUs), and which mode a
round lands in swamps a 1-2 µs difference; pinned, both settings run in the same mode.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _loop(dist, t, n: int) -> float:
    ar = dist.all_reduce  # looked up once per round, like a training loop's hot path would not
    t0 = time.perf_counter()
    for _ in range(n):
        ar(t)
    return (time.perf_counter() - t0) / n * 1e6


def _loop_module(dist, t, n: int) -> float:
    import torch

    sync = torch.cuda.synchronize if t.is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(t)
    sync()
    return (time.perf_counter() - t0) / n * 1e6


def run(rank: int, world: int, port: int, calls: int, rounds: int, cuda: bool = False,
        cpu: int | None = None, variants: bool = False, size: int = 4) -> None:
    if cpu is not None:  # before any thread exists: gloo's threads inherit it
        os.sched_setaffinity(0, {cpu})
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist

    from hangdoc.runtime import recorder

    if cuda:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
        t = torch.ones(size, device="cuda")
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        t = torch.ones(size)
    _loop_module(dist, t, 2000)  # warm-up
    if variants:
        _variants(recorder, dist, t, calls, rounds, rank)
        dist.destroy_process_group()
        return
    off, on = [], []
    n_rec = 0
    rec = None
    for r in range(rounds):
        for setting in (("off", "on") if r % 2 == 0 else ("on", "off")):  # neither always first
            gc.collect()
            if setting == "off":
                off.append(_loop_module(dist, t, calls))
                continue
            rec = recorder.enable(capacity=100_000)
            gc.collect()  # enable()'s own garbage (signature discovery) is not a per-call cost
            on.append(_loop_module(dist, t, calls))
            n_rec = len(rec._buf)
            recorder.disable()
            rec = None
    # All ranks ran the same number of calls; only rank 0 reports.
    if rank == 0:
        print(f"world size {world}, all_reduce([{t.numel()}] float32) on {'nccl' if cuda else 'gloo'}, "
              f"{rounds} alternating rounds of {calls} calls, "
              + (f"pinned to CPU {cpu}" if cpu is not None else f"unpinned ({os.cpu_count()} CPUs)"))
        for label, f in (("min", min), ("median", statistics.median)):
            a, b = f(off), f(on)
            print(f"{label:>6}: recorder off {a:7.2f} µs/call   on {b:7.2f} µs/call   "
                  f"added {b - a:+6.2f} µs/call   ratio {b / a:.3f}")
        d = sorted(b - a for a, b in zip(off, on))
        q = statistics.quantiles(d, n=4) if len(d) > 1 else [d[0]] * 3
        print(f"paired (on - off, same round): median {q[1]:+6.2f} µs/call, quartiles {q[0]:+.2f} .. {q[2]:+.2f}, "
              f"{rounds} rounds")
        print(f"records kept in the ring buffer: {n_rec} (capacity 100000)")
        _wrapper_only(recorder, t, calls * 5)
        if cuda:
            _cuda_parts(t, calls * 5)
    dist.destroy_process_group()


def _wrapper_only(recorder, t, n: int) -> None:
    """The recorder's own cost, without gloo's noise: the same wrapping around a no-op with
    all_reduce's signature (called with the default group, like dist.all_reduce(t))."""
    def all_reduce(tensor, op=None, group=None, async_op=False):
        return None

    spec = recorder._Spec("all_reduce", ["tensor", "op", "group", "async_op"])
    wrapped = recorder._wrap(all_reduce, spec)
    rounds = []
    for _ in range(5):
        gc.collect()
        t0 = time.perf_counter()
        for _ in range(n):
            all_reduce(t)
        base = time.perf_counter() - t0
        recorder.enable(capacity=100_000)
        gc.collect()
        t0 = time.perf_counter()
        for _ in range(n):
            wrapped(t)
        rounds.append(((time.perf_counter() - t0) - base) / n * 1e6)
        recorder.disable()
    print(f"wrapper alone (no-op function, {n} calls x 5): added {min(rounds):.2f} µs/call min, "
          f"{statistics.median(rounds):.2f} median")


def _variants(recorder, dist, t, calls: int, rounds: int, rank: int) -> None:
    """Where the in-loop cost comes from: the recorder on in several reduced forms, each round
    running every setting once (rotating order) and compared with that round's "off"."""
    import gc

    def plain():
        return lambda: None

    def gc_off():
        gc.disable()
        return gc.enable

    def on(gap_ms=None, **patches):
        def setup():
            saved = {k: getattr(recorder, k) for k in patches}
            saved_gap = os.environ.get("HANGDOC_CUDA_EVENT_GAP_MS")
            if gap_ms is not None:  # enable() reads it
                os.environ["HANGDOC_CUDA_EVENT_GAP_MS"] = str(gap_ms)
            for k, v in patches.items():
                setattr(recorder, k, v)
            recorder.enable(capacity=100_000)
            if "_group_info" in patches:
                recorder._groups.clear()

            def undo():
                recorder.disable()
                for k, v in saved.items():
                    setattr(recorder, k, v)
                if saved_gap is None:
                    os.environ.pop("HANGDOC_CUDA_EVENT_GAP_MS", None)
                else:
                    os.environ["HANGDOC_CUDA_EVENT_GAP_MS"] = saved_gap
            return undo
        return setup

    def small_ring():  # the same recording into a ring of 64 records: a footprint that stays in cache
        recorder.enable(capacity=64)
        return recorder.disable

    def on_gc_off():
        undo_gc, undo_on = gc_off(), on()()
        return lambda: (undo_on(), undo_gc())

    settings = {
        "off": plain,
        "on (default: events >= 1 ms apart)": on(),
        "on, an event after every call": on(gap_ms=0),
        "on, events >= 0.25 ms apart": on(gap_ms=0.25),
        "on, no events (first call only)": on(gap_ms=10 ** 12),
        "on, idle queries after 1 ms only": on(_IDLE_AFTER=1.0),
        "on, no events, no idle queries": on(gap_ms=10 ** 12, _IDLE_AFTER=10.0 ** 12),
        "on, CPU path (no CUDA queue)": on(_cuda_built=lambda: False),
        "on, a ring of 64 records": small_ring,
        "wrapper layer only (no record)": on(_group_info=lambda group: None),
        "off, gc disabled": gc_off,
        "on, gc disabled": on_gc_off,
    }
    # HANGDOC_BENCH_BASELINE=path/to/recorder.py: an earlier revision's recorder, loaded as a second
    # module, as one more setting (e.g. git show 4649312:hangdoc/runtime/recorder.py > base.py)
    base_file = os.environ.get("HANGDOC_BENCH_BASELINE")
    if base_file:
        import importlib.util

        spec = importlib.util.spec_from_file_location("hangdoc.runtime._baseline_recorder", base_file)
        base = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = base
        spec.loader.exec_module(base)

        def baseline():
            base.enable(capacity=100_000)
            return base.disable

        settings[f"baseline ({os.path.basename(base_file)})"] = baseline
    # HANGDOC_BENCH_ONLY="on (default|baseline": the settings whose names start so ("off" always runs)
    only = [p.strip() for p in os.environ.get("HANGDOC_BENCH_ONLY", "").split("|") if p.strip()]
    if only:
        settings = {k: v for k, v in settings.items() if k == "off" or any(k.startswith(p) for p in only)}
    names = list(settings)
    times = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            gc.collect()
            undo = settings[name]()
            try:
                times[name].append(_loop_module(dist, t, calls))
            finally:
                undo()
    if rank == 0:
        print(f"variants: all_reduce([{t.numel()}] float32), {rounds} rounds x {calls} calls, each setting once "
              "per round (rotating order)")
        for name in names:
            d = [a - b for a, b in zip(times[name], times["off"])]
            print(f"  {name:34s} median {statistics.median(times[name]):7.2f} µs/call   "
                  f"vs off in the same round: median {statistics.median(d):+6.2f}, min {min(d):+6.2f}")
    if t.is_cuda:
        _count_cuda_calls(recorder, dist, t, calls, rank)


def _count_cuda_calls(recorder, dist, t, calls: int, rank: int) -> None:
    """How often the CUDA bookkeeping's slow paths run in one loop of this benchmark (pauses of
    100 µs or more, idle queries and their answers, events): every rank runs the loop, rank 0
    prints. On 2 x H200 (4 KB all_reduce, 3000 calls) they were 2-3 pauses and ~76 events, so
    neither can account for µs per call (docs/gpu.md)."""
    R = recorder.Recorder
    counts = {"pauses >= 100 us": 0, "idle queries": 0, "found idle": 0, "events": 0}
    saved = (R._close_burst, R._sweep_idle, R._mark)

    def close_burst(self, st, t0, _f=saved[0]):
        counts["pauses >= 100 us"] += 1
        return _f(self, st, t0)

    def sweep_idle(self, st, _f=saved[1]):
        counts["idle queries"] += 1
        idle = _f(self, st)
        counts["found idle"] += bool(idle)
        return idle

    def mark(self, st, t0, _f=saved[2]):
        counts["events"] += 1
        return _f(self, st, t0)

    R._close_burst, R._sweep_idle, R._mark = close_burst, sweep_idle, mark
    recorder.enable(capacity=100_000)
    try:
        us = _loop_module(dist, t, calls)
    finally:
        recorder.disable()
        R._close_burst, R._sweep_idle, R._mark = saved
    if rank == 0:
        print(f"  slow paths in {calls} calls ({us:.2f} µs/call): " + ", ".join(f"{k} {v}" for k, v in counts.items()))


def _cuda_parts(t, n: int) -> None:
    """What each torch call on the CUDA path costs on this host (µs per call, best of 5)."""
    import torch

    stream = torch.cuda.current_stream()
    ev = torch.cuda.Event()
    record = torch._C._CudaEventBase.record
    cur = torch._C._cuda_getCurrentStream
    parts = {
        "loop overhead": lambda: None,
        "tensor.get_device()": t.get_device,
        "_cuda_getCurrentStream(dev)": lambda: cur(0),
        "tensor.shape + dtype": lambda: (t.shape, t.dtype),
        "_current_graph_task_id()": torch._C._current_graph_task_id,
        "event.record(stream)": lambda: record(ev, stream),
        "event.query()": ev.query,
        "stream.query()": stream.query,
    }
    for name, fn in parts.items():
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n // 10):
                fn()
            best = min(best, (time.perf_counter() - t0) / (n // 10) * 1e6)
        print(f"  {name:32s} {best:6.3f} µs/call")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--cuda", action="store_true", help="NCCL on CUDA tensors (one GPU per rank)")
    ap.add_argument("--cpu", type=int, default=None, help="pin each rank to this CPU (rank r: CPU N + r)")
    ap.add_argument("--variants", action="store_true",
                    help="where the cost comes from: the recorder on in reduced forms, round by round")
    ap.add_argument("--size", type=int, default=4, help="float32 elements per all_reduce (16777216: 64 MB)")
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank == 0 and args.port == 0:
        from hangdoc.proctree import free_port

        args.port = free_port()
        import subprocess

        others = [subprocess.Popen([sys.executable, __file__, "--calls", str(args.calls), "--rounds", str(args.rounds),
                                    "--world", str(args.world), "--rank", str(r), "--port", str(args.port),
                                    "--size", str(args.size)]
                                   + (["--cuda"] if args.cuda else [])
                                   + (["--variants"] if args.variants else [])
                                   + (["--cpu", str((args.cpu + r) % os.cpu_count())] if args.cpu is not None else []),
                                   start_new_session=True) for r in range(1, args.world)]
        try:
            run(0, args.world, args.port, args.calls, args.rounds, args.cuda, args.cpu, args.variants, args.size)
        finally:
            for p in others:
                try:
                    p.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, 9)
        return 0
    run(args.rank, args.world, args.port, args.calls, args.rounds, args.cuda, args.cpu, args.variants, args.size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
