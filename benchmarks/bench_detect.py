"""Detector overhead: recorder off, recorder on, recorder + detect digests, side by side in one run.

    python benchmarks/bench_detect.py [--calls 4000] [--rounds 15]

Five measurements, each in alternating rounds so that machine load hits all variants alike
(median and min of the rounds are printed):

1. gloo ``dist.all_reduce([4] float32)`` in a loop on one rank: off / recorder / recorder+detect.
2. The wrapper alone around a no-op with all_reduce's signature (no gloo noise): recorder vs
   recorder+detect; the difference is what the detector's hot-path hook adds per call
   (target: <= 1 us).
3. The daemon's periodic work: one snapshot (what a rank publishes) of a group with a full ring,
   and one comparison of two snapshots, in ms (paid at most a few times a second, off the main
   thread's path except for the GIL).
4. A running detector at calls of signatures it never saw (the first iteration's): published as
   issued (EARLY of them per process) against none left, per call.
5. ``os.fork`` with the detector's at-fork hook (the locks other threads hold, noted) against paused.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _loop(dist, t, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(t)
    return (time.perf_counter() - t0) / n * 1e6


def _stats(label: str, rounds: dict, base: str) -> None:
    for how, f in (("min", min), ("median", statistics.median)):
        parts = [f"{k} {f(v):7.2f}" for k, v in rounds.items()]
        b = f(rounds[base])
        added = "   ".join(f"{k}-{base} {f(v) - b:+6.2f}" for k, v in rounds.items() if k != base)
        print(f"{label} {how:>6}: " + "   ".join(parts) + f" µs/call   added: {added}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    import torch
    import torch.distributed as dist

    from hangdoc.runtime import detect, recorder

    dist.init_process_group("gloo", rank=0, world_size=1)
    t = torch.ones(4)
    _loop(dist, t, 2000)
    rounds = {"off": [], "recorder": [], "detect": []}
    for _ in range(args.rounds):
        rounds["off"].append(_loop(dist, t, args.calls))
        recorder.enable(capacity=100_000)
        rounds["recorder"].append(_loop(dist, t, args.calls))
        digests = detect.Digests()
        recorder._detect = digests.hook
        rounds["detect"].append(_loop(dist, t, args.calls))
        recorder._detect = None
        recorder.disable()
    print(f"gloo all_reduce([4] float32), world size 1, {args.rounds} alternating rounds of {args.calls} calls")
    _stats("gloo   ", rounds, "off")

    # 2. the wrapper alone
    def all_reduce(tensor, op=None, group=None, async_op=False):
        return None

    spec = recorder._Spec("all_reduce", ["tensor", "op", "group", "async_op"])
    wrapped = recorder._wrap(all_reduce, spec)
    n = args.calls * 5
    w = {"recorder": [], "detect": []}
    import gc

    # The garbage collector's full passes over a filling ring buffer make rounds bimodal (1.5 or
    # 6 µs, with or without the detector alike); with it paused the difference is the hook's own.
    gc.collect()
    gc.disable()
    for _ in range(args.rounds):
        recorder.enable(capacity=100_000)
        t0 = time.perf_counter()
        for _ in range(n):
            wrapped(t)
        w["recorder"].append((time.perf_counter() - t0) / n * 1e6)
        recorder._detect = detect.Digests().hook
        t0 = time.perf_counter()
        for _ in range(n):
            wrapped(t)
        w["detect"].append((time.perf_counter() - t0) / n * 1e6)
        recorder._detect = None
        recorder.disable()
    gc.enable()
    print(f"wrapper around a no-op (gc paused), {args.rounds} alternating rounds of {n} calls")
    _stats("wrapper", w, "recorder")
    hook = detect.Digests().hook
    rec = (0, "all_reduce", ("default_pg", (0,))) + (None,) * 11
    shapes, dtypes = ((4,),), (t.dtype,)
    hk = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            hook("default_pg", "all_reduce", shapes, dtypes, None, rec)
        hk.append((time.perf_counter() - t0) / n * 1e6)
    print(f"hook alone: {min(hk):.2f} µs/call min, {statistics.median(hk):.2f} median")

    # 3. the daemon's periodic work
    recorder.enable(capacity=100_000)
    digests = detect.Digests()
    recorder._detect = digests.hook
    for i in range(detect.RING * 2):
        dist.all_reduce(torch.ones(4 + i % 3))
    recorder._detect = None
    cache: dict = {}
    describe = lambda rec: detect._describe(rec, cache)  # noqa: E731
    detect.snapshot(digests, 0, describe)
    reps = 50
    t0 = time.perf_counter()
    for _ in range(reps):
        a = detect.snapshot(digests, 0, describe)
    snap_ms = (time.perf_counter() - t0) / reps * 1e3
    import json

    size = len(json.dumps(a, separators=(",", ":")))
    t0 = time.perf_counter()
    for _ in range(reps):
        detect.first_difference(a["g"]["default_pg"], a["g"]["default_pg"])
    cmp_ms = (time.perf_counter() - t0) / reps * 1e3
    print(f"daemon: snapshot {snap_ms:.2f} ms ({size} bytes published), comparison {cmp_ms:.2f} ms; "
          f"at most ~4 of each per second")
    recorder.disable()

    # 4. a running detector at calls of new signatures: each is published as it is issued (EARLY
    # of them), against the same detector with none left, side by side
    early = {"no early": [], "early": []}
    for _ in range(max(3, args.rounds // 3)):
        for how in early:
            det = detect.Detector(policy="warn")
            det.start()
            end = time.monotonic() + 10
            while det.node is None and time.monotonic() < end:  # the store connected
                time.sleep(0.01)
            if how == "no early":
                det._early_left = 0
            shapes = [torch.ones(5 + k) for k in range(detect.EARLY)]
            t0 = time.perf_counter()
            for x in shapes:
                dist.all_reduce(x)
            early[how].append((time.perf_counter() - t0) / len(shapes) * 1e6)
            det.stop()
            recorder.disable()
    print(f"{detect.EARLY} calls of new signatures under a running detector, published as issued or not")
    _stats("new sig", early, "no early")
    dist.destroy_process_group()
    _fork_hook(args.rounds)
    _p2p_hook(args.rounds)


def _fork_hook(rounds: int) -> None:
    """5. ``os.fork`` (the child exits at once) with the detector's at-fork hook active against
    paused, a thread of this process holding a lock in a ``with`` body of its own (the hook's
    worst case: that thread's frames are parsed and its lock noted at every fork)."""
    import tempfile
    import textwrap
    import threading

    from hangdoc.runtime import detect_fork

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "holder.py")
        with open(path, "w") as f:
            f.write(textwrap.dedent("""
                import threading
                LOCK = threading.Lock()
                def hold(stop):
                    with LOCK:
                        stop.wait(600)
            """))
        ns: dict = {}
        exec(compile(open(path).read(), path, "exec"), ns)
        stop = threading.Event()
        t = threading.Thread(target=ns["hold"], args=(stop,), daemon=True)
        t.start()
        while not ns["LOCK"].locked():
            time.sleep(0.01)

        def forks(n: int) -> float:
            t0 = time.perf_counter()
            for _ in range(n):
                pid = os.fork()
                if pid == 0:
                    os._exit(0)
                os.waitpid(pid, 0)
            return (time.perf_counter() - t0) / n * 1e6

        detect_fork.install()
        res = {"paused": [], "hook": []}
        for _ in range(rounds):
            detect_fork.uninstall()
            res["paused"].append(forks(20))
            detect_fork.install()
            res["hook"].append(forks(20))
        detect_fork.uninstall()
        stop.set()
        noted = detect_fork.hazards()
    print(f"os.fork + exit + waitpid, {rounds} alternating rounds of 20 (the hook noted: "
          f"{noted[-1]['held'] if noted else None})")
    _stats("fork   ", res, "paused")
    return 0


def _p2p_hook(rounds: int) -> None:
    """6. the point-to-point hook, which numbers each message of a pair in a ring
    (hangdoc.runtime.detect_queue), against the same hook counting per peer only (as before it)."""
    import gc

    from hangdoc.runtime import detect_digest

    def counts_only(d: "detect_digest.Digests"):
        sent, received, count, last_p2p = d.sent, d.received, d.p2p_n, d.last_p2p

        def hook_p2p(op, peer, rec):
            if type(peer) is not int:
                return
            counts = received if op in detect_digest._RECEIVES else sent
            counts[peer] = counts.get(peer, 0) + 1
            count[0] += 1
            last_p2p[0] = rec

        return hook_p2p

    rec = (0, "send", None, (), (), None, 1, False, None, None, None, 0.0, None, "issued")
    n = 200_000
    res: dict = {"counts": [], "numbered": []}
    gc.disable()
    for _ in range(rounds):
        for how in res:
            d = detect_digest.Digests()
            hook = counts_only(d) if how == "counts" else d.hook_p2p
            t0 = time.perf_counter()
            for _ in range(n):
                hook("send", 1, rec)
            res[how].append((time.perf_counter() - t0) / n * 1e6)
    gc.enable()
    print(f"point-to-point hook, {rounds} alternating rounds of {n} calls")
    _stats("p2p hook", res, "counts")


if __name__ == "__main__":
    sys.exit(main())
