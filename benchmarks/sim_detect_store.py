"""The detector's store protocol at scale: 1,024 simulated ranks against one real TCPStore (loopback).

    python benchmarks/sim_detect_store.py [--ranks 1024] [--procs 4] [--rate 20] [--seconds 30]

The main process hosts a ``torch.distributed.TCPStore``; ``--procs`` worker processes run
``--ranks / --procs`` simulated ranks each, one thread and one store client per rank. Every rank
issues collectives at ``--rate`` per second in lock step (collective i at start + i / rate, as
ranks of a synchronous job would), feeds them through the real hot-path hook
(:class:`hangdoc.runtime.detect.Digests`) and runs the real protocol (:class:`~hangdoc.runtime.detect.Node`)
every 0.25 s. Once the ranks have run a while, one rank issues a different collective; the run ends
when every rank knows the verdict or at ``--seconds``. Printed: store operations per second (total
and per rank), publications and reads per rank per second, detection latency (divergent call ->
verdict found, and -> every rank knows it), and the verdict. Everything stops by itself: workers
have a hard deadline and are killed if they outlive it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SIGS = [("all_reduce", ((1024,),), ("float32",), None), ("broadcast", ((256,),), ("float32",), 0),
        ("all_gather", ((64,),), ("bfloat16",), None)]
BAD = ("all_reduce", ((256,),), ("float32",), None)


class SharedClient:
    """One store connection used by several simulated ranks (one operation at a time)."""

    def __init__(self, store, lock) -> None:
        self.s, self.lock = store, lock

    def __getattr__(self, name):
        fn = getattr(self.s, name)

        def call(*args):
            with self.lock:
                return fn(*args)

        return call


class CountingOps:
    """Store operations of one simulated rank, counted (a key absent is None, as detect expects)."""

    def __init__(self, store) -> None:
        self.store = store
        self.ops = 0

    def set(self, key, value):
        self.ops += 1
        self.store.set(key, value)

    def get(self, key):
        self.ops += 1
        if not self.store.check([key]):
            return None
        self.ops += 1
        return self.store.get(key)

    def add(self, key, n):
        self.ops += 1
        return self.store.add(key, n)

    def compare_set(self, key, expected, desired):
        self.ops += 1
        return self.store.compare_set(key, expected, desired)


def worker(port: int, first: int, count: int, world: int, rate: float, start: float, bad_rank: int, bad_index: int,
           deadline: float, clients_per_proc: int) -> None:
    import datetime

    import torch.distributed as dist

    from hangdoc.runtime import detect

    ranks = tuple(range(world))
    results = []
    lock = threading.Lock()

    clients = []
    for _ in range(max(1, min(count, clients_per_proc))):
        # connected one after the other: a burst of connects is refused and retried with backoff
        clients.append((dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10),
                                      wait_for_workers=False), threading.Lock()))

    # connected: the main process picks the common start once every worker is
    print("READY", flush=True)
    start = float(sys.stdin.readline())
    deadline = start + deadline

    def one(rank: int) -> None:
        store = SharedClient(*clients[rank % len(clients)])
        ops = CountingOps(store)
        dg = detect.Digests()
        node = detect.Node(rank, ops, lambda name: ranks)
        describe = lambda rec: (f"{rec[1]}({rec[3]})", f"train.py:{rec[8]}")  # noqa: E731
        make = lambda quiet, focus=None: detect.snapshot(dg, rank, describe, quiet, focus)  # noqa: E731
        issued = 0
        found_at = None
        time.sleep(max(0.0, start - time.time()) + (rank % 25) * 0.01)  # ticks spread like real ranks
        t_first = time.monotonic()
        connected_late = time.time() - start
        while time.time() < deadline:
            due = int((time.time() - start) * rate)
            while issued < due:
                i = issued
                op, shapes, dtypes, root = BAD if (rank == bad_rank and i == bad_index) else SIGS[i % 3]
                site = 99 if (rank == bad_rank and i == bad_index) else 30 + i % 3
                dg.hook("default_pg", op, shapes, dtypes, root, (i, op, ("default_pg", ranks), shapes, dtypes, root, None, False, site))
                issued += 1
            v = node.tick(time.monotonic(), dg.total(), make)
            if v is not None and found_at is None:
                found_at = time.time()
                break
            time.sleep(detect.TICK)
        elapsed = time.monotonic() - t_first
        with lock:
            results.append({"rank": rank, "ops": ops.ops, "writes": node.writes, "reads": node.reads, "elapsed": elapsed,
                            "found_at": found_at, "claimed": node.claimed, "late": connected_late,
                            "verdict": node.verdict.to_json() if node.verdict is not None else None})

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in range(first, first + count)]
    for t in threads:
        t.start()
        time.sleep(0.002)
    end = deadline + 5
    for t in threads:
        t.join(max(0.0, end - time.time()))
    with lock:
        stuck = len(threads) - len(results)
        out = results + [{"rank": -1, "failed": "still running at the deadline"}] * stuck
        print(json.dumps(out), flush=True)
    os._exit(0)  # threads still inside a store call must not keep the process


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--rate", type=float, default=20.0, help="collectives per second per rank")
    ap.add_argument("--seconds", type=float, default=30.0, help="hard limit of the simulation")
    ap.add_argument("--diverge-after", type=float, default=12.0, help="seconds before the divergent call")
    ap.add_argument("--clients", type=int, default=16, help="store connections per process, shared by its ranks")
    ap.add_argument("--worker", nargs=8, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        w = args.worker
        worker(int(w[0]), int(w[1]), int(w[2]), int(w[3]), float(w[4]), float(w[5]), int(w[6]), int(w[7]),
               float(args.seconds), args.clients)
        return 0

    import datetime

    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    start = 0.0  # told to the workers once they are connected
    bad_rank = args.ranks * 2 // 3 + 1
    bad_index = int(args.diverge_after * args.rate)
    per = (args.ranks + args.procs - 1) // args.procs
    procs = []
    for p in range(args.procs):
        first = p * per
        count = min(per, args.ranks - first)
        cmd = [sys.executable, __file__, "--seconds", str(args.seconds), "--clients", str(args.clients), "--worker", str(server.port), str(first), str(count),
               str(args.ranks), str(args.rate), str(start), str(bad_rank), str(bad_index)]
        # the store client logs every refused connection attempt (retried): keep that out of the report
        procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                      text=True, start_new_session=True))
    results = []
    try:
        t_connect = time.time()
        for p in procs:  # bounded: the workers' own connection timeout
            p.stdout.readline()
        connect_s = time.time() - t_connect
        start = time.time() + 1.0
        deadline = start + args.seconds
        bad_time = start + bad_index / args.rate
        for p in procs:
            p.stdin.write(f"{start}\n")
            p.stdin.flush()
        print(f"{args.procs * args.clients} store connections made in {connect_s:.1f}s")
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.time()) + 20)
            for line in out.splitlines():
                if line.startswith("["):
                    results.extend(json.loads(line))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    failed = [r for r in results if "failed" in r]
    results = [r for r in results if "failed" not in r]
    if failed:
        print(f"{len(failed)} simulated ranks failed: {sorted(set(r['failed'] for r in failed))}")
    if results:
        print(f"connected: latest {max(r['late'] for r in results):.1f}s after the common start")
    found = [r for r in results if r["found_at"]]
    claimers = [r for r in results if r["claimed"]]
    total_ops = sum(r["ops"] for r in results)
    span = statistics.median(r["elapsed"] for r in results) if results else 1.0
    print(f"{len(results)} simulated ranks in {args.procs} processes, one TCPStore, {args.rate:g} collectives/s per rank, "
          f"rank {bad_rank} diverges at collective #{bad_index} ({args.diverge_after:g}s in)")
    print(f"store ops: {total_ops} in ~{span:.1f}s: {total_ops / span:.0f} ops/s total, "
          f"{total_ops / span / max(1, len(results)):.2f} per rank per s "
          f"(publications {sum(r['writes'] for r in results) / sum(r['elapsed'] for r in results):.2f}/s, "
          f"key reads {sum(r['reads'] for r in results) / sum(r['elapsed'] for r in results):.2f}/s per rank)")
    if claimers:
        v = claimers[0]["verdict"]
        first = min(r["found_at"] for r in claimers)
        print(f"detection: found {first - bad_time:.2f}s after the divergent call by rank {claimers[0]['rank']}; "
              f"known to {len(found)}/{len(results)} ranks after {max(r['found_at'] for r in found) - bad_time:.2f}s")
        print(f"verdict: {v['summary']}")
        ok = v["deviants"] == [bad_rank] and v["index"] == bad_index and v["exact"]
        print("verdict correct" if ok else "VERDICT WRONG")
        return 0 if ok else 1
    print("no verdict within the time limit")
    return 1


if __name__ == "__main__":
    sys.exit(main())
