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
    HANGDOC_BENCH_GLOO=1 python benchmarks/nccl_loop_cpu.py --rounds 3   (the plumbing, on CPU)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def worker(calls: int, rounds: int, size: int, interleave: bool = False) -> None:
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

    res = {"off": [], "on": []}
    for r in range(rounds):
        for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
            if mode == "on":
                recorder.enable(capacity=100_000)
            # --interleave: the unwrapped call, then a no-op (off) or the recorder around a no-op (on)
            extra = noop
            if interleave and mode == "on":
                extra = recorder._wrap(noop, recorder._Spec("all_reduce", ["tensor", "op", "group", "async_op"]))
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
        print(("interleaved: the unwrapped all_reduce, then the recorder around a no-op (on) or a no-op (off); "
               if interleave else "") +
              f"all_reduce([{size}] float32), {rounds} rounds x {calls} calls, rank 0, µs per call "
              f"(median; on - off paired in the same round):")
        names = ("wall", "calling thread CPU", "other threads CPU") + (("CPU in the 2nd call",) if interleave else ())
        for i, name in enumerate(names):
            off = statistics.median(x[i] for x in res["off"])
            on = statistics.median(x[i] for x in res["on"])
            d = sorted(b[i] - a[i] for a, b in zip(res["off"], res["on"]))
            q = statistics.quantiles(d, n=4)
            print(f"  {name:20s} off {off:8.2f}  on {on:8.2f}  added {q[1]:+7.2f} (quartiles {q[0]:+.2f} .. {q[2]:+.2f})")
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--size", type=int, default=1024, help="float32 elements (1024: 4 KB)")
    ap.add_argument("--interleave", action="store_true",
                    help="unwrapped all_reduce, then the recorder around a no-op: which side slows down")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.calls, args.rounds, args.size, args.interleave)
        return 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(29700 + os.getpid() % 200), os.path.abspath(__file__), "--worker", "--calls", str(args.calls),
           "--rounds", str(args.rounds), "--size", str(args.size)] + (["--interleave"] if args.interleave else [])
    return subprocess.run(cmd, timeout=600).returncode


if __name__ == "__main__":
    sys.exit(main())
