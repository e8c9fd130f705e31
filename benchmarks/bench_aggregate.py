"""``hangdoc aggregate`` end to end on N-rank dump sets, side by side with the perl one-liner used today.

    python benchmarks/bench_aggregate.py                    # N = 384, 8192, 131072
    python benchmarks/bench_aggregate.py --sizes 384 --repeat 5

For each N it generates (once, cached under ``--root``) a dump set from the real captured dumps in
``tests/fixtures/dumps`` (see ``gen_dumps.py``: srun-style ``trace-nodeNNNN.out`` files, 8 processes
per file, a culprit, a few outliers, one unresponsive and one missing rank, and a rank map), then
times, on the same files and in the same run:

* ``hangdoc aggregate DIR --rank-map DIR/rank-map.json`` in a subprocess (text report to a pipe),
  wall time, CPU time and peak RSS (``os.wait4`` of that child), as it runs by default (a second
  reading process for inputs over 8 MB) and with ``--jobs 1`` (one core);
* the baseline: the one-liner that prints each MainThread's top frame and counts them,
  ``perl -ne '...' trace-*.out | sort | uniq -c | sort -rn``.

It prints the best of ``--repeat`` runs and the ratios; the targets (384 ranks ≤ 0.3 s, 131,072
ranks ≤ 5 s, peak RSS ≤ 500 MB) are checked and printed, never asserted.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from typing import List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, os.pardir))
sys.path.insert(0, HERE)

import gen_dumps  # noqa: E402

#: The top-frame extraction people run today: the line after each MainThread header, counted.
PERL = r"""perl -ne 'if ($m) { print; $m = 0 } $m = 1 if /^Thread .*"MainThread"/' trace-*.out | sort | uniq -c | sort -rn"""

TARGETS = {384: 0.3, 131072: 5.0}
RSS_TARGET_MB = 500


def run(cmd: List[str], cwd: str, env=None, shell: bool = False) -> Tuple[float, float, int, str, float]:
    """(wall s, peak RSS MB of the child and its waited-for descendants, exit status, stdout, CPU s)."""
    t = time.perf_counter()
    p = subprocess.Popen(cmd if not shell else cmd[0], cwd=cwd, env=env, shell=shell, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    # read before waiting so a large report cannot fill the pipe and stall the child
    out = p.stdout.read()  # type: ignore[union-attr]
    err = p.stderr.read()  # type: ignore[union-attr]
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        sys.stderr.write(err.decode("utf-8", "replace")[-2000:])
    return wall, usage.ru_maxrss / 1024.0, p.returncode, out.decode("utf-8", "replace"), usage.ru_utime + usage.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="384,8192,131072")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--root", default=os.environ.get("HANGDOC_BENCH_DIR", "/tmp/hangdoc-bench"))
    ap.add_argument("--format", default="text", choices=("text", "json", "markdown"))
    ap.add_argument("--show", action="store_true", help="print the start of each report")
    ap.add_argument("--stages", action="store_true", help="also time each stage in one process (read, group, rules, render)")
    args = ap.parse_args()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("HANGDOC_DEBUG", None)
    rows = []
    for n in [int(x) for x in args.sizes.split(",")]:
        d = gen_dumps.ensure(n, args.root)
        files = [f for f in os.listdir(d) if f.startswith("trace-")]
        mb = sum(os.path.getsize(os.path.join(d, f)) for f in files) / 1e6
        cmd = [sys.executable, "-m", "hangdoc", "aggregate", ".", "--rank-map", "rank-map.json", "--format", args.format]
        best_h = best_1 = best_p = None
        for _ in range(args.repeat):
            h = run(cmd, d, env)  # default: a second reading process for large inputs
            h1 = run(cmd + ["--jobs", "1"], d, env)  # one core
            p = run([PERL], d, shell=True)
            if h[2] != 0 or h1[2] != 0:
                print(f"N={n}: hangdoc exited {h[2]}/{h1[2]}", file=sys.stderr)
                return 1
            best_h = h if best_h is None or h[0] < best_h[0] else best_h
            best_1 = h1 if best_1 is None or h1[0] < best_1[0] else best_1
            best_p = p if best_p is None or p[0] < best_p[0] else best_p
        assert best_h is not None and best_1 is not None and best_p is not None
        if args.show:
            print("\n".join(best_h[3].splitlines()[:12]))
            print("\n".join(best_p[3].splitlines()[:4]))
        rows.append((n, len(files), mb, best_h, best_p, best_1))
        _print_row(rows[-1])
        if args.stages:
            print("         stages (in-process, seconds): " + stages(d, env), flush=True)
    print()
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cpus, load average {os.getloadavg()[0]:.1f}, best of {args.repeat}; baseline: {PERL}")
    print("wall: elapsed time of the command; cpu: user+sys of the command and its children (less sensitive to other load); -j1: one reading process")
    return 0


_header_done = False


def _print_row(row) -> None:
    global _header_done
    n, files, mb, h, p, h1 = row
    if not _header_done:
        print(f"{'ranks':>7} {'files':>6} {'MB':>6} | {'hangdoc wall':>12} {'cpu':>6} {'RSS MB':>7} | {'-j1 wall':>8} | {'perl wall':>9} {'cpu':>6} {'RSS MB':>7} | {'wall ratio':>10} | target")
        _header_done = True
    target = TARGETS.get(n)
    verdict = []
    if target is not None:
        verdict.append(f"≤{target} s {'ok' if h[0] <= target else 'MISSED'}")
    verdict.append(f"RSS≤{RSS_TARGET_MB} MB {'ok' if h[1] <= RSS_TARGET_MB else 'MISSED'}")
    print(f"{n:>7} {files:>6} {mb:>6.1f} | {h[0]:>12.3f} {h[4]:>6.2f} {h[1]:>7.1f} | {h1[0]:>8.3f} | {p[0]:>9.3f} {p[4]:>6.2f} {p[1]:>7.1f} | {h[0] / max(p[0], 1e-9):>9.1f}x | {', '.join(verdict)}", flush=True)


STAGES = r"""
import gc, json, sys, time
gc.disable()
t0 = time.perf_counter()
from hangdoc.readers import read_paths, load_rank_map
from hangdoc.analysis.grouping import build_report
from hangdoc.analysis.diagnose import diagnose
from hangdoc.renderers import RenderOptions, render
t1 = time.perf_counter(); job = read_paths(["."], rank_map=load_rank_map("rank-map.json"))
t2 = time.perf_counter(); report = build_report(job)
t3 = time.perf_counter(); report.findings = diagnose(report)
t4 = time.perf_counter(); render(report, "text", RenderOptions())
t5 = time.perf_counter(); render(report, "json", RenderOptions())
t6 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "read": t2 - t1, "group": t3 - t2, "rules": t4 - t3, "text": t5 - t4, "json": t6 - t5}))
"""


def stages(d: str, env) -> str:
    """Per-stage seconds in one process: where the time goes (readers, grouping, rules, renderers)."""
    r = subprocess.run([sys.executable, "-c", STAGES], cwd=d, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        return "failed: " + r.stderr.strip().splitlines()[-1]
    import json

    t = json.loads(r.stdout)
    return "  ".join(f"{k} {v:.2f}" for k, v in t.items())


if __name__ == "__main__":
    sys.exit(main())
