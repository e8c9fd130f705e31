"""Cost of recording a functional collective (DTensor's path), recorder off vs on, side by side.

    python benchmarks/bench_funcol.py [--calls 2000] [--rounds 8] [--numel 16] [--op all_reduce]

One process, a one-rank gloo group (the collective itself is as cheap as it gets, so the figure is
the recorder's added cost, not the network's). Rounds alternate "off" (``recorder.disable()``: the
functional collectives are torch's own) and "on" (``recorder.enable()``: wrapped, one record per
call, completed by ``wait_tensor``). Each round times ``--calls`` calls of
``funcol.<op>(x, ...).wait()``, ``wait()`` included, as DTensor's ``full_tensor()`` waits. Prints
µs/call of each setting (median and fastest round), the ratio on/off and the µs added per call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--numel", type=int, default=16)
    ap.add_argument("--op", choices=("all_reduce", "all_gather_single"), default="all_reduce")
    args = ap.parse_args(argv)

    import torch
    import torch.distributed as dist

    from hangdoc.runtime import recorder

    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    recorder.enable(capacity=10_000)  # before the import: the import hook patches the module
    import torch.distributed._functional_collectives as funcol

    recorder.disable()
    pg = dist.group.WORLD
    x = torch.ones(args.numel)

    def call():
        if args.op == "all_reduce":
            return funcol.all_reduce(x, "sum", pg).wait()
        return funcol.all_gather_single(x, 0, pg).wait()

    times = {"off": [], "on": []}
    for i in range(args.rounds * 2):
        setting = ("off", "on")[i % 2]
        if setting == "on":
            recorder.enable(capacity=10_000)
        for _ in range(50):  # warm-up
            call()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            call()
        times[setting].append((time.perf_counter() - t0) / args.calls * 1e6)
        if setting == "on":
            n = len(recorder.get().records())
            recorder.disable()
            assert n >= min(10_000, args.calls), n  # the calls were recorded
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    print(f"funcol.{args.op}([{args.numel}]).wait(), 1-rank gloo, {args.rounds} rounds x {args.calls} calls")
    for name, ts in times.items():
        print(f"  {name:3s}: median {statistics.median(ts):7.2f} us/call, fastest {min(ts):7.2f}")
    print(f"  on/off: {on / off:.3f}x, +{on - off:.2f} us per call")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
