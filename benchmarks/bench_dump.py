"""The recorder's dumps: this checkout vs a baseline revision, side by side in one command.

Each round starts one process per side (the baseline's ``hangdoc`` package exported with
``git archive`` into a temporary directory), fills a ring of ``--records`` records with real gloo
all_reduces on a 1-rank group, then times the full ``dump()`` and the exit dump (what
``atexit`` runs: ``_dump_at_exit``), and reports their size. Rounds alternate which side runs
first; the medians are compared.

    python benchmarks/bench_dump.py --baseline-rev ab4b1f8 [--records 100000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, os, sys, time
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1")
import torch, torch.distributed as dist
from hangdoc.runtime import recorder
n = int(sys.argv[1])
out = sys.argv[3]
r = recorder.enable(capacity=n, out_dir=out)
dist.init_process_group("gloo")
t = torch.ones(4)
for _ in range(n):
    dist.all_reduce(t)
t0 = time.perf_counter(); full = r.dump(os.path.join(out, "full.jsonl")); t1 = time.perf_counter()
r.dumped_to = None  # as if nothing had been dumped before the exit
t2 = time.perf_counter(); recorder._dump_at_exit(); t3 = time.perf_counter()
print(json.dumps({"full_s": t1 - t0, "full_mb": os.path.getsize(full) / 2**20,
                  "exit_s": t3 - t2, "exit_mb": os.path.getsize(r.dumped_to) / 2**20}))
"""


def _export(rev: str, dest: str) -> None:
    data = subprocess.run(["git", "archive", rev, "hangdoc"], cwd=ROOT, check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        try:
            tar.extractall(dest, filter="data")
        except TypeError:  # Python without extraction filters
            tar.extractall(dest)


def _side(path: str, n: int, port: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
        env.pop("HANGDOC_EXIT_RECORDS", None)
        res = subprocess.run([sys.executable, "-c", CHILD, str(n), str(port), out], env=env, cwd=out,
                             capture_output=True, text=True, timeout=900)
        if res.returncode:
            raise SystemExit(res.stderr[-2000:])
        return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline-rev", required=True)
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    sys.path.insert(0, ROOT)
    from hangdoc.proctree import free_port

    with tempfile.TemporaryDirectory() as base:
        _export(args.baseline_rev, base)
        sides = {"current": ROOT, f"baseline {args.baseline_rev}": base}
        res = {k: [] for k in sides}
        for r in range(args.rounds):
            for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
                res[name].append(_side(sides[name], args.records, free_port()))
    print(f"recorder dumps, {args.records} records of all_reduce([4] float32), {args.rounds} rounds (medians):")
    med = {k: {f: statistics.median(x[f] for x in v) for f in v[0]} for k, v in res.items()}
    for k, m in med.items():
        print(f"  {k:22s} full dump {m['full_s']:6.3f} s {m['full_mb']:6.1f} MB   "
              f"exit dump {m['exit_s']:6.3f} s {m['exit_mb']:6.1f} MB")
    cur, base_ = med["current"], med[f"baseline {args.baseline_rev}"]
    print(f"  ratio current/baseline: full dump {cur['full_s'] / base_['full_s']:.3f}, "
          f"exit dump {cur['exit_s'] / base_['exit_s']:.3f} (size {cur['exit_mb'] / base_['exit_mb']:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
