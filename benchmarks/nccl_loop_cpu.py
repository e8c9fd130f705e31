"""Where a small NCCL call's in-loop cost goes: wall time vs CPU time, recorder off vs on (2 GPUs).

A 2-rank job (this file starts itself under torchrun) runs rounds of ``--calls`` all_reduces,
recorder off and on alternating (which runs first alternates too). Per round, rank 0 measures the
wall time, the calling thread's CPU time (``time.thread_time``) and the whole process's CPU time
(``time.process_time``: every thread, NCCL's and torch's included). Paired medians per call say
whether what the recorder adds is CPU work on the calling thread (its own code, or NCCL's launch
path running slower next to it), work on other threads, or waiting (wall time beyond CPU time).

    python benchmarks/nccl_loop_cpu.py [--calls 3000] [--rounds 21] [--size 1024]
    python benchmarks/nccl_loop_cpu.py --interleave   (the unwrapped call, then the recorder around
        a no-op: if that costs what a recorded call does, the recorder's own code is what slows)
    python benchmarks/nccl_loop_cpu.py --floor   (the unwrapped call, then one of: a no-op, a
        pass-through Python wrapper around it, the least any Python-level recorder must do around it
        (caller's frame, shape, dtype, device, current stream, autograd task, clock, one tuple into a
        ring), the recorder around it: each priced inside the NCCL loop, where caches are cold)
    python benchmarks/nccl_loop_cpu.py --parts   (as --floor: the floor, the floor without each of
        its parts, the clock and the append alone: which part costs what inside the loop)
    HANGDOC_BENCH_GLOO=1 python benchmarks/nccl_loop_cpu.py --rounds 3   (the plumbing, on CPU)
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import subprocess
import sys
import time


def floor_hook(noop, without=()):  # type: ignore[no-untyped-def]
    """The least a recorder at the Python level must do per call, around ``noop``: no group
    lookup, no sequence number, no completion tracking, no error handling.

    ``without`` leaves parts out (``--parts`` prices each): ``frame`` (the caller's code and
    instruction), ``shape`` (shape and dtype), ``stream`` (is_cuda, device, current stream),
    ``task`` (the autograd graph task id); ``all`` keeps only the clock and the append."""
    import torch

    getframe, clock, ring = sys._getframe, time.time, collections.deque(maxlen=100_000)
    cur = getattr(torch._C, "_cuda_getCurrentStream", None)
    task = torch._C._current_graph_task_id
    if "all" in without:
        def hook(tensor, op=None, group=None, async_op=False):
            ring.append(clock())
            return noop(tensor, op, group, async_op)
        return hook
    # one closure per variant, so that what is left out costs nothing (no flag tests per call)
    frame = "frame" not in without
    shape = "shape" not in without
    stream = "stream" not in without
    graph = "task" not in without
    src = ["def hook(tensor, op=None, group=None, async_op=False):"]
    if frame:
        src.append("    f = getframe(1)")
    if stream:
        src.append("    s = cur(tensor.get_device()) if tensor.is_cuda else None")
    fields = (["f.f_code", "f.f_lasti"] if frame else []) + (["tensor.shape", "tensor.dtype"] if shape else []) \
        + (["s"] if stream else []) + (["task()"] if graph else []) + ["clock()"]
    src.append(f"    ring.append(({', '.join(fields)},))")
    src.append("    return noop(tensor, op, group, async_op)")
    env = dict(getframe=getframe, cur=cur, task=task, ring=ring, clock=clock, noop=noop)
    exec("\n".join(src), env)
    return env["hook"]


#: --parts: the floor, then the floor without one part each, then the clock and the append alone
PARTS = {"floor": (), "-frame": ("frame",), "-shape": ("shape",), "-stream": ("stream",), "-task": ("task",),
         "clock+append": ("all",)}


def pass_through(noop):  # type: ignore[no-untyped-def]
    def wrapper(tensor, op=None, group=None, async_op=False):
        return noop(tensor, op, group, async_op)

    return wrapper


def worker(calls: int, rounds: int, size: int, interleave: bool = False, floor: bool = False, parts: bool = False) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from hangdoc.runtime import recorder

    local = int(os.environ["LOCAL_RANK"])
    if os.environ.get("HANGDOC_BENCH_GLOO") == "1":  # the plumbing on a CPU-only machine
        dist.init_process_group("gloo")
        t = torch.ones(size)
        sync = lambda: None  # noqa: E731
    else:
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        t = torch.ones(size, device="cuda")
        sync = torch.cuda.synchronize
    for _ in range(1000):
        dist.all_reduce(t)
    sync()
    raw = dist.all_reduce

    def noop(tensor, op=None, group=None, async_op=False):
        return None

    modes = ("off",) + tuple(PARTS) if parts else ("off", "pass", "floor", "on") if floor else ("off", "on")
    interleave = interleave or floor or parts
    res = {m: [] for m in modes}
    for r in range(rounds):
        k = r % len(modes)  # rotate which runs first, and reverse every other round
        order = modes[k:] + modes[:k]
        for mode in order if r % 2 == 0 else order[::-1]:
            if mode == "on":
                recorder.enable(capacity=100_000)
            # --interleave: the unwrapped call, then a no-op (off) or the recorder around a no-op (on)
            extra = noop
            if interleave and mode == "on":
                extra = recorder._wrap(noop, recorder._Spec("all_reduce", ["tensor", "op", "group", "async_op"]))
            elif mode == "pass":
                extra = pass_through(noop)
            elif mode in PARTS:
                extra = floor_hook(noop, PARTS[mode])
            dist.barrier()
            sync()
            w0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
            inside = 0.0
            if interleave:  # also the calling thread's CPU inside the second call alone
                tt = time.thread_time
                for _ in range(calls):
                    raw(t)
                    a = tt()
                    extra(t)
                    inside += tt() - a
            else:
                for _ in range(calls):
                    dist.all_reduce(t)
            sync()
            w1, c1, p1 = time.perf_counter(), time.thread_time(), time.process_time()
            if mode == "on":
                recorder.disable()
            res[mode].append(((w1 - w0) / calls * 1e6, (c1 - c0) / calls * 1e6, (p1 - p0 - (c1 - c0)) / calls * 1e6,
                              inside / calls * 1e6))
    if local == 0:
        print(("interleaved: the unwrapped all_reduce, then a no-op (off), the floor around it, the floor without "
               "one part (-frame, -shape: shape and dtype, -stream: is_cuda, device and current stream, -task), "
               "the clock and the append alone; " if parts else
               "interleaved: the unwrapped all_reduce, then a no-op (off), a pass-through wrapper around it "
               "(pass), the least a Python-level recorder does around it (floor), the recorder around it (on); "
               if floor else
               "interleaved: the unwrapped all_reduce, then the recorder around a no-op (on) or a no-op (off); "
               if interleave else "") +
              f"all_reduce([{size}] float32), {rounds} rounds x {calls} calls, rank 0, µs per call "
              f"(median; on - off paired in the same round):")
        names = ("wall", "calling thread CPU", "other threads CPU") + (("CPU in the 2nd call",) if interleave else ())
        for mode in modes[1:]:
            if len(modes) > 2:
                print(f" {mode}:")
            for i, name in enumerate(names):
                off = statistics.median(x[i] for x in res["off"])
                on = statistics.median(x[i] for x in res[mode])
                d = sorted(b[i] - a[i] for a, b in zip(res["off"], res[mode]))
                q = statistics.quantiles(d, n=4)
                print(f"  {name:20s} off {off:8.2f}  {mode:5s} {on:8.2f}  added {q[1]:+7.2f} "
                      f"(quartiles {q[0]:+.2f} .. {q[2]:+.2f})")
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--size", type=int, default=1024, help="float32 elements (1024: 4 KB)")
    ap.add_argument("--interleave", action="store_true",
                    help="unwrapped all_reduce, then the recorder around a no-op: which side slows down")
    ap.add_argument("--floor", action="store_true",
                    help="as --interleave, also pricing a pass-through wrapper and the least a Python-level recorder does")
    ap.add_argument("--parts", action="store_true",
                    help="as --floor, pricing the floor without each of its parts, and the clock and append alone")
    ap.add_argument("--nproc", type=int, default=2, help="ranks (GPUs); 1 prices the Python side next to a one-rank NCCL launch")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.calls, args.rounds, args.size, args.interleave, args.floor, args.parts)
        return 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc), "--master-port",
           str(29700 + os.getpid() % 200), os.path.abspath(__file__), "--worker", "--calls", str(args.calls),
           "--rounds", str(args.rounds), "--size", str(args.size)] + (["--interleave"] if args.interleave else []) + (["--floor"] if args.floor else []) + (["--parts"] if args.parts else [])
    return subprocess.run(cmd, timeout=600).returncode


if __name__ == "__main__":
    sys.exit(main())
