"""NicerTrace vs the stdlib trace.Trace vs untraced, on the same workload, side by side.

The workload (``benchmarks/workload``) is shaped like a training loop: the user's own package
(``userpkg``, not installed, always traced) spends most of its time inside a library
(``minitorch``, pure Python, in ``workload/libs``, treated as installed and excluded). Each
configuration runs in its own fresh interpreter, ``--repeat`` times; the best time is kept.

* untraced
* stdlib  ``trace.Trace(count=0, trace=1, ignoredirs=[libs, sys.prefix, ...])``, output to a file
* nicer   ``NicerTrace(packages_to_include="uninstalled", installed_dirs=[libs])``, to a file

    python benchmarks/bench_nicertrace.py
    /root/.pyenv/versions/3.12.1/bin/python benchmarks/bench_nicertrace.py --steps 3000

Prints seconds and the slowdown of each traced run against the untraced one.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKLOAD = os.path.join(HERE, "workload")
LIBS = os.path.join(WORKLOAD, "libs")
CONFIGS = ("untraced", "stdlib", "nicer")


def child(config: str, steps: int, out: str) -> None:
    from userpkg.train import train

    if config == "untraced":
        t0 = time.perf_counter()
        train(steps)
        dt = time.perf_counter() - t0
    elif config == "stdlib":
        import trace

        ignoredirs = [LIBS, sys.prefix, sys.exec_prefix, sys.base_prefix, ROOT + os.sep + "hangdoc"]
        tracer = trace.Trace(count=0, trace=1, ignoredirs=ignoredirs)
        real_stdout = sys.stdout
        with open(out, "w") as f:
            sys.stdout = f  # trace.Trace prints each line
            try:
                t0 = time.perf_counter()
                tracer.runfunc(train, steps)
                dt = time.perf_counter() - t0
            finally:
                sys.stdout = real_stdout
    elif config == "nicer":
        from hangdoc.runtime.nicertrace import NicerTrace

        tracer = NicerTrace(packages_to_include="uninstalled", installed_dirs=[LIBS], path=out)
        t0 = time.perf_counter()
        tracer.runfunc(train, steps)
        dt = time.perf_counter() - t0
    else:
        raise SystemExit(f"unknown config {config}")
    lines = sum(1 for _ in open(out)) if os.path.exists(out) else 0
    print(f"{dt:.6f} {lines}")


def measure(config: str, steps: int, repeat: int) -> "tuple[float, int]":
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, WORKLOAD, LIBS]))
    best, lines = float("inf"), 0
    with tempfile.TemporaryDirectory() as d:
        for i in range(repeat):
            out = os.path.join(d, f"{config}-{i}.txt")
            res = subprocess.run(
                [sys.executable, __file__, "--child", config, "--steps", str(steps), "--out", out],
                env=env, capture_output=True, text=True, timeout=600,
            )
            if res.returncode != 0:
                raise SystemExit(f"{config} failed:\n{res.stderr}")
            dt, n = res.stdout.split()
            best, lines = min(best, float(dt)), int(n)
    return best, lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.child, args.steps, args.out)
        return 0
    print(f"Python {sys.version.split()[0]}, {args.steps} steps, best of {args.repeat}")
    # Interleave the configurations so that load from other processes hits them alike.
    results = {c: (float("inf"), 0) for c in CONFIGS}
    for _ in range(args.repeat):
        for c in CONFIGS:
            dt, n = measure(c, args.steps, 1)
            results[c] = (min(results[c][0], dt), n)
    base = results["untraced"][0]
    print(f"{'config':10s} {'seconds':>9s} {'vs untraced':>12s} {'trace lines':>12s}")
    for c in CONFIGS:
        dt, n = results[c]
        print(f"{c:10s} {dt:9.3f} {dt / base:11.2f}x {n:12d}")
    print(f"nicer vs stdlib: {results['nicer'][0] / results['stdlib'][0]:.2f}x the time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
