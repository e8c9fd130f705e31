"""Overhead of hangdoc's recorder next to PyTorch's Flight Recorder, on NCCL (needs 2 GPUs).

Four configurations, each a fresh 2-rank torchrun job, run one after the other in the same command
and repeated in alternation (so drift hits all of them alike):
(a) nothing, (b) Flight Recorder on (TORCH_FR_BUFFER_SIZE), (c) hangdoc recorder on (DDP's
gradient all_reduces included, through its comm hook), (d) both.
Each job times a loop of small (4 KB) and medium (64 MB) all_reduce and a small DDP training step.

    python benchmarks/bench_gpu_overhead.py            # driver: runs the jobs, prints the table
    (the driver starts itself under torchrun with --worker)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

# Flight Recorder off explicitly where it should be off (its default differs across torch versions).
_FR_OFF = {"TORCH_FR_BUFFER_SIZE": "0", "TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}
CONFIGS = {
    "none": dict(_FR_OFF),
    "flight-recorder": {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"},
    "hangdoc": {**_FR_OFF, "HANGDOC_BENCH_RECORD": "1"},
    "both": {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "HANGDOC_BENCH_RECORD": "1"},
}


def worker(out: str) -> None:
    import torch
    import torch.distributed as dist

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    if os.environ.get("HANGDOC_BENCH_RECORD"):
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from hangdoc.runtime import recorder

        recorder.enable()
    results = {}

    def timed_loop(name, n, fn):
        for _ in range(max(10, n // 10)):  # warm-up
            fn()
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        results[name] = (time.perf_counter() - t0) / n * 1e6

    small = torch.ones(1024, device="cuda")  # 4 KB
    medium = torch.ones(16 * 1024 * 1024, device="cuda")  # 64 MB
    timed_loop("all_reduce 4KB (us/call)", 5000, lambda: dist.all_reduce(small))
    timed_loop("all_reduce 64MB (us/call)", 100, lambda: dist.all_reduce(medium))

    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).cuda()
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local], bucket_cap_mb=4)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    x = torch.randn(64, 1024, device="cuda")

    def train_step():
        opt.zero_grad(set_to_none=True)
        ddp(x).square().mean().backward()
        opt.step()

    timed_loop("DDP step (us/step)", 300, train_step)
    if os.environ.get("HANGDOC_BENCH_RECORD"):
        time.sleep(0.1)
        rec = recorder.get()
        results["hangdoc records"] = len(rec.records())
        results["hangdoc pending after sync"] = len(rec.pending())
        results["hangdoc markers"] = sorted({type(m).__name__ for q in rec._events.values() for m in q if type(m) is not tuple})
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def driver(repeats: int) -> None:
    import tempfile

    samples = {c: [] for c in CONFIGS}
    for rep in range(repeats):
        for config, extra in CONFIGS.items():
            out = tempfile.mktemp(suffix=".json")
            env = dict(os.environ, **extra)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                   "--master-port", str(free_port()), os.path.abspath(__file__), "--worker", out]
            subprocess.run(cmd, env=env, check=True, timeout=300, stdout=subprocess.DEVNULL)
            with open(out) as f:
                samples[config].append(json.load(f))
            print(f"rep {rep} {config}: " + json.dumps(samples[config][-1]), flush=True)
    metrics = list(samples["none"][0])
    print(f"{'metric':28s}" + "".join(f"{c:>17s}" for c in CONFIGS))
    medians = {c: {m: statistics.median(s[m] for s in samples[c]) for m in metrics} for c in CONFIGS}
    for m in metrics:
        print(f"{m:28s}" + "".join(f"{medians[c][m]:17.2f}" for c in CONFIGS))
    for m in metrics:
        base = medians["none"][m]
        print(f"{m:28s} added vs none: " + ", ".join(
            f"{c} {medians[c][m] - base:+.2f} us ({medians[c][m] / base:.4f}x)" for c in CONFIGS if c != "none"))
    print(json.dumps({"medians": medians, "repeats": repeats}))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", metavar="OUT")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset, in this order")
    a = ap.parse_args()
    if a.worker:
        worker(a.worker)
    else:
        for name in list(CONFIGS):
            if name not in a.configs.split(","):
                del CONFIGS[name]
        driver(a.repeats)
