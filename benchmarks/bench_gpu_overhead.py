"""Overhead of hangdoc's recorder next to PyTorch's Flight Recorder, on NCCL (needs 2 GPUs).

The four configurations of the issue: (a) nothing, (b) Flight Recorder on, (c) hangdoc's recorder
on, (d) both. Flight Recorder is switched by environment at process-group creation, so it takes a
job of its own: one 2-rank torchrun job with it off and one with it on, alternating over
``--repeats``. hangdoc's recorder can be switched in-process (``recorder.enable()/disable()``),
so inside each job the rounds alternate it off and on: (c) vs (a) and (d) vs (b) are paired
measurements in one process, free of the job-to-job drift (several µs per call on small calls),
which only the Flight Recorder comparison (b) vs (a) has to live with.

Workloads, timed per round with a CUDA sync around: a loop of small (4 KB) and of medium (64 MB)
all_reduce, and a small DDP training step (8 x Linear(1024), batch 64).

    python benchmarks/bench_gpu_overhead.py [--repeats 2] [--rounds 6]
    HANGDOC_BENCH_PATCH="_IDLE_AFTER=0.001" python benchmarks/bench_gpu_overhead.py   (a setting to compare)
    HANGDOC_BENCH_GC=1 python benchmarks/bench_gpu_overhead.py   (a full gc.collect() before each timed loop)
    (the driver starts itself under torchrun with --worker)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

_FR_OFF = {"TORCH_FR_BUFFER_SIZE": "0", "TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}
JOBS = {
    "none": dict(_FR_OFF),
    "flight-recorder": {"TORCH_FR_BUFFER_SIZE": "2000"},
}
WORKLOADS = ("all_reduce 4KB (us/call)", "all_reduce 64MB (us/call)", "DDP step (us/step)")


def worker(out: str, rounds: int) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from hangdoc.runtime import recorder

    # HANGDOC_BENCH_PATCH="_IDLE_AFTER=0.001,...": recorder module settings to try instead of the defaults
    for item in filter(None, os.environ.get("HANGDOC_BENCH_PATCH", "").split(",")):
        name, value = item.split("=")
        setattr(recorder, name, float(value))
    local = int(os.environ["LOCAL_RANK"])
    gloo = os.environ.get("HANGDOC_BENCH_GLOO") == "1"  # the plumbing on a CPU-only machine
    sync = (lambda: None) if gloo else torch.cuda.synchronize
    if gloo:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        dev = torch.device("cuda", local)
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=dev)
    small = torch.ones(1024, device=dev)  # 4 KB
    medium = torch.ones((16 if not gloo else 1) * 1024 * 1024, device=dev)  # 64 MB (4 MB on gloo)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).to(dev)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=None if gloo else [local], bucket_cap_mb=4)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    x = torch.randn(64, 1024, device=dev)

    def train_step():
        opt.zero_grad(set_to_none=True)
        ddp(x).square().mean().backward()
        opt.step()

    k = 10 if gloo else 1
    loops = ((WORKLOADS[0], 2000 // k, lambda: dist.all_reduce(small)),
             (WORKLOADS[1], 40 // k, lambda: dist.all_reduce(medium)),
             (WORKLOADS[2], 100 // k, train_step))

    collect = os.environ.get("HANGDOC_BENCH_GC") == "1"  # a full collection before each timed loop

    def timed(n, fn):
        if collect:
            import gc

            gc.collect()
        sync()
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        return (time.perf_counter() - t0) / n * 1e6

    for _, n, fn in loops:  # warm-up, recorder off and on
        timed(max(10, n // 10), fn)
    recorder.enable()
    for _, n, fn in loops:
        timed(max(10, n // 10), fn)
    recorder.disable()
    samples = {s: {w: [] for w in WORKLOADS} for s in ("off", "on")}
    records = 0
    for r in range(rounds):
        for setting in (("off", "on") if r % 2 == 0 else ("on", "off")):  # same position for both
            rec = recorder.enable() if setting == "on" else None
            for name, n, fn in loops:
                samples[setting][name].append(timed(n, fn))
            if rec is not None:
                records = len(rec.records())
                pending = len(rec.pending())
                recorder.disable()
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"samples": samples, "records_per_round": records, "pending_after_round": pending}, f)
    dist.destroy_process_group()


def driver(repeats: int, rounds: int) -> None:
    import tempfile

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from hangdoc.proctree import free_port

    runs = {j: [] for j in JOBS}
    for rep in range(repeats):
        for job, extra in JOBS.items():
            out = tempfile.mktemp(suffix=".json")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                   "--master-port", str(free_port()), os.path.abspath(__file__), "--worker", out,
                   "--rounds", str(rounds)]
            subprocess.run(cmd, env=dict(os.environ, **extra), check=True, timeout=300, stdout=subprocess.DEVNULL)
            with open(out) as f:
                runs[job].append(json.load(f))
            d = runs[job][-1]
            print(f"rep {rep} {job}: records/round {d['records_per_round']}, pending after round "
                  f"{d['pending_after_round']}; " + "; ".join(
                      f"{w}: off {statistics.median(d['samples']['off'][w]):.1f} on {statistics.median(d['samples']['on'][w]):.1f}"
                      for w in WORKLOADS), flush=True)
    # (a) none/off, (b) FR/off, (c) none/on, (d) FR/on; paired deltas from rounds of one process
    print(f"\n{'workload':28s} {'(a) none':>10s} {'(b) FR':>10s} {'(c) hangdoc':>12s} {'(d) both':>10s}"
          f"   {'hangdoc paired added':>22s} {'with FR':>10s} {'FR vs none (jobs)':>18s}")
    summary = {}
    for w in WORKLOADS:
        med = {}
        paired = {}
        quart = {}
        for job in JOBS:
            offs = [x for d in runs[job] for x in d["samples"]["off"][w]]
            ons = [x for d in runs[job] for x in d["samples"]["on"][w]]
            med[job] = (statistics.median(offs), statistics.median(ons))
            diffs = [b - a for d in runs[job] for a, b in zip(d["samples"]["off"][w], d["samples"]["on"][w])]
            paired[job] = statistics.median(diffs)
            quart[job] = statistics.quantiles(diffs, n=4) if len(diffs) > 1 else [diffs[0]] * 3
        a, c = med["none"]
        b, d_ = med["flight-recorder"]
        print(f"{w:28s} {a:10.2f} {b:10.2f} {c:12.2f} {d_:10.2f}   {paired['none']:+10.2f} ({paired['none'] / a * 100:+.2f}%)"
              f" {paired['flight-recorder']:+10.2f} {b - a:+12.2f} ({(b - a) / a * 100:+.2f}%)")
        print(f"{'':28s} paired quartiles: FR off {quart['none'][0]:+.2f} .. {quart['none'][2]:+.2f}, "
              f"FR on {quart['flight-recorder'][0]:+.2f} .. {quart['flight-recorder'][2]:+.2f}")
        summary[w] = dict(none=a, flight_recorder=b, hangdoc=c, both=d_, hangdoc_paired_added=paired["none"],
                          hangdoc_paired_quartiles=quart["none"], hangdoc_paired_quartiles_with_fr=quart["flight-recorder"],
                          hangdoc_paired_added_with_fr=paired["flight-recorder"], fr_added_across_jobs=b - a)
    print(json.dumps({"summary": summary, "repeats": repeats, "rounds": rounds}))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", metavar="OUT")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=6)
    a = ap.parse_args()
    if a.worker:
        worker(a.worker, a.rounds)
    else:
        driver(a.repeats, a.rounds)
