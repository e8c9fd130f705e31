"""Time from the last progress of a hung job to the verdict in its log (the watchdog's promise:
at most hang_timeout + 5 s), against the manual way on the same hung job (``hangdoc dump`` of every
process, then ``hangdoc aggregate``, started the moment the timeout expires).

    python benchmarks/bench_watchdog.py [--runs 5] [--nproc 4] [--timeout 3] [--scenario skip_broadcast]

Each run starts a real torchrun job (gloo, CPU) under ``python -m hangdoc --hang-timeout T`` on a
bundled scenario. "Last progress" is the latest ``PROGRESS ... t=`` line a rank printed after its
last completed step; "verdict" is when the reporting rank's ``hangdoc: full report:`` line reached
this process. Prints every run and the medians.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from hangdoc import examples  # noqa: E402
from hangdoc.cli.demo import free_port, stop_job  # noqa: E402


def env() -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = ROOT + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    e.setdefault("OMP_NUM_THREADS", "1")
    e["PYTHONUNBUFFERED"] = "1"
    return e


def one_run(scenario: str, nproc: int, timeout: float) -> dict:
    work = tempfile.mkdtemp(prefix="bench-watchdog-")
    out = os.path.join(work, "out")
    script = examples.copy_to(scenario, os.path.join(work, "job"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--monitor-interval", "0.5",
           "-m", "hangdoc", "--hang-timeout", str(timeout), "--out", out, script]
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    progress: list = []
    verdict: dict = {}
    done = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            m = re.search(r"PROGRESS rank=\d+ step=\d+ t=([\d.]+)", line)
            if m:
                progress.append(float(m.group(1)))
            m = re.search(r"hangdoc: HANG: no progress for ([\d.]+)s", line)
            if m and "internal" not in verdict:
                verdict["internal"] = float(m.group(1))
            if "hangdoc: full report:" in line and "at" not in verdict:
                verdict["at"] = time.time()
                done.set()

    threading.Thread(target=read, daemon=True).start()
    result = {}
    try:
        done.wait(timeout + 90)
        if "at" in verdict and progress:
            result["verdict"] = verdict["at"] - max(progress)
            result["internal"] = verdict.get("internal")
            # the manual way, on the same job, still hung: dump every process, aggregate
            t0 = time.monotonic()
            trace = os.path.join(work, "trace.out")
            d = subprocess.run([sys.executable, "-m", "hangdoc", "dump", "--pid", str(proc.pid), "-o", trace],
                               env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=120)
            a = subprocess.run([sys.executable, "-m", "hangdoc", "aggregate", trace, os.path.join(out, "collectives-*.jsonl"),
                                "-o", os.path.join(work, "manual.txt")],
                               env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=120)
            if d.returncode != 0 or a.returncode != 0:
                raise SystemExit(f"dump/aggregate by hand failed: {d.stderr} {a.stderr}")
            result["manual"] = timeout + (time.monotonic() - t0)
    finally:
        stop_job(proc)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=3.0)
    ap.add_argument("--scenario", default="skip_broadcast", choices=sorted(examples.SCENARIOS))
    args = ap.parse_args()
    rows = []
    for i in range(args.runs):
        r = one_run(args.scenario, args.nproc, args.timeout)
        if "verdict" not in r:
            print(f"run {i + 1}: no verdict")
            continue
        rows.append(r)
        print(f"run {i + 1}: last progress -> verdict in log {r['verdict']:.2f}s "
              f"(rank-internal {r['internal']}s); timeout + dump + aggregate from outside {r['manual']:.2f}s", flush=True)
    if not rows:
        print("no run produced a verdict")
        return 1
    med = statistics.median(r["verdict"] for r in rows)
    manual = statistics.median(r["manual"] for r in rows)
    budget = args.timeout + 5
    print(f"\n{args.scenario}, {args.nproc} ranks, hang_timeout {args.timeout:g}s, {len(rows)} runs")
    print(f"median last progress -> verdict: {med:.2f}s = timeout + {med - args.timeout:.2f}s "
          f"(budget timeout + 5s = {budget:g}s: {'met' if med <= budget else 'MISSED'})")
    print(f"ratio verdict / hang_timeout: {med / args.timeout:.2f}")
    print(f"median timeout + `hangdoc dump` + `hangdoc aggregate` from outside (no one has to notice the hang first): "
          f"{manual:.2f}s; ratio in-job / outside: {med / manual:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
