"""DDP step time with DDP's own all_reduce path vs hangdoc's recorded comm hook, side by side.

    python benchmarks/bench_ddp_hook.py [--steps 200] [--rounds 6] [--layers 8] [--hidden 256]
                                        [--bucket-mb 0.25] [--cpu N] [--cuda] [--show] [--time-hook]
                                        [--settings off,on,hook,torch_hook]

Two ranks (gloo on CPU; NCCL with one GPU per rank with --cuda) train a small MLP. Rounds
alternate between settings: "off" (recorder disabled, ddp hook uninstalled: DDP's C++ all_reduce),
"on" (recorder.enable() + ddp.install(): every bucket's all_reduce goes through the Python hook and
the recorder), and for a breakdown "hook" (hangdoc's hook, recorder off) and "torch_hook" (torch's
own Python ``allreduce_hook``: what any Python comm hook costs). Each round builds a fresh DDP (a reducer cannot drop a hook), runs warm-up steps past
DDP's bucket rebuild, then times ``--steps`` steps. Rank 0 prints µs/step of each setting (median
and fastest round), the ratio to the first setting and the added µs per bucket.

--cpu N pins rank r to CPU N + r before the process group exists (see bench_recorder.py: unpinned
gloo timings on a small shared machine are bimodal).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _round(torch, dist, device, args, rank: int, torch_hook: bool = False) -> tuple:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers).to(device)
    kw = {"device_ids": [device.index]} if device.type == "cuda" else {}
    d = DDP(model, bucket_cap_mb=args.bucket_mb, **kw)
    if torch_hook:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        d.register_comm_hook(d.process_group, _timed(allreduce_hook) if args.time_hook else allreduce_hook)
    opt = torch.optim.SGD(d.parameters(), lr=1e-3)
    torch.manual_seed(rank)
    x = torch.randn(args.batch, args.hidden, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step() -> None:
        opt.zero_grad(set_to_none=False)
        d(x).sum().backward()
        opt.step()

    for _ in range(5):  # past the first step's single bucket and the rebuild
        step()
    buckets = len(d.reducer._get_zeros_like_grad_buckets())
    dist.barrier()
    gc.collect()
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync()
    return (time.perf_counter() - t0) / args.steps * 1e6, buckets


#: --time-hook: [seconds, calls] spent inside the comm hook itself, for the current round
_hook_time = [0.0, 0]


def _timed(hook):
    def timed(state, bucket):
        t0 = time.perf_counter()
        try:
            return hook(state, bucket)
        finally:
            _hook_time[0] += time.perf_counter() - t0
            _hook_time[1] += 1
    return timed


def _show(rec) -> None:
    """What the recorder saw of DDP's all_reduces in the last round (--show)."""
    time.sleep(0.5)  # completions are observed by non-blocking queries
    recs = [r for r in rec.records() if r.op == "all_reduce"]
    kinds = sorted({(r.phase, r.async_op, r.stream, r.call_site) for r in recs}, key=str)
    states = {s: sum(r.state == s for r in recs) for s in ("issued", "completed", "failed")}
    print(f"records of the last 'on' round: {len(recs)} all_reduce, {states}")
    for k in kinds:
        print(f"  phase={k[0]} async={k[1]} stream={k[2]} call_site={k[3]}")


def run(rank: int, args) -> None:
    if args.cpu is not None:  # before any thread exists: gloo's threads inherit it
        os.sched_setaffinity(0, {(args.cpu + rank) % os.cpu_count()})
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK=str(rank), WORLD_SIZE="2")
    os.environ.setdefault("HANGDOC_RECORD_DDP", "1")  # on GPUs the hook is opt-in: this measures it
    import torch
    import torch.distributed as dist

    from hangdoc.runtime import ddp, recorder

    torch.set_num_threads(1)  # two ranks on a small machine: no intra-op oversubscription
    if args.cuda:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if args.cuda else "gloo")
    settings = args.settings.split(",")
    times = {k: [] for k in settings}
    in_hook = {k: [] for k in settings}
    if args.time_hook:
        ddp._hook = _timed(ddp._hook)
    buckets = 0
    for i in range(args.rounds * len(settings)):
        setting = settings[i % len(settings)]
        if setting == "on":
            recorder.enable(capacity=100_000)
        if setting in ("on", "hook"):
            assert ddp.install(), "ddp.install() refused (HANGDOC_RECORD_DDP=0?)"
        _hook_time[:] = [0.0, 0]
        t, buckets = _round(torch, dist, device, args, rank, torch_hook=setting == "torch_hook")
        if setting == "on" and args.show and rank == 0 and i >= (args.rounds - 1) * len(settings):
            _show(recorder.get())
        ddp.uninstall()
        recorder.disable()
        times[setting].append(t)
        if _hook_time[1]:
            in_hook[setting].append(_hook_time[0] / _hook_time[1] * 1e6)
    if rank == 0:
        where = f"NCCL on {torch.cuda.get_device_name(device)}" if args.cuda else "gloo on CPU"
        print(f"{where}, 2 ranks, {args.layers}x Linear({args.hidden}) batch {args.batch}, {buckets} buckets/step, "
              f"{args.steps} steps x {args.rounds} rounds per setting")
        base = settings[0]
        for label, f in (("median", statistics.median), ("fastest", min)):
            v = {k: f(x) for k, x in times.items()}
            print(f"  {label}: " + "   ".join(
                f"{k} {v[k]:.1f} µs/step" + ("" if k == base else
                f" (x{v[k] / v[base]:.3f}, {(v[k] - v[base]) / max(1, buckets):+.1f} µs/bucket)") for k in settings))
        if args.time_hook:
            print("  inside the hook (median of rounds, warm-up included): " + "   ".join(
                f"{k} {statistics.median(x):.1f} µs/call" for k, x in in_hook.items() if x))
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--bucket-mb", type=float, default=0.25)
    ap.add_argument("--cuda", action="store_true", help="NCCL, one GPU per rank")
    ap.add_argument("--cpu", type=int, default=None, help="pin rank r to CPU N + r")
    ap.add_argument("--settings", default="off,on",
                    help="comma-separated, first is the baseline: off (DDP's C++ all_reduce), on (recorder + "
                         "hangdoc's hook), hook (hangdoc's hook, recorder off), torch_hook (torch's "
                         "allreduce_hook, recorder off)")
    ap.add_argument("--time-hook", action="store_true", help="also time the comm hook's own call (µs per bucket)")
    ap.add_argument("--show", action="store_true", help="print what the records hold (call sites, states)")
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank == 0 and args.port == 0:
        from hangdoc.proctree import free_port

        args.port = free_port()
        argv = sys.argv[1:]
        other = subprocess.Popen([sys.executable, __file__, *argv, "--rank", "1", "--port", str(args.port)],
                                 start_new_session=True)
        try:
            run(0, args)
        except BaseException:
            os.killpg(other.pid, 9)
            raise
        finally:
            try:
                other.wait(timeout=300)
            except subprocess.TimeoutExpired:
                os.killpg(other.pid, 9)
        return 0
    run(args.rank, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
