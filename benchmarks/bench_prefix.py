"""Output prefixing: what the drainer process costs against the old drainer thread, side by side.

    python benchmarks/bench_prefix.py [--runs 5] [--lines 200000] [--updates 20000] [--pairs 2000]

Designs, each in fresh processes writing to a file (stdout and stderr into one file, as a console):

- ``none``: no prefixing (the floor);
- ``old``: the thread design as it was at ``BASELINE`` (two reader threads in the job, the partial
  line re-joined at every read), loaded from git history;
- ``thread``: today's code in its fallback mode (one drainer thread in the job);
- ``prev``: the drainer process as it was at ``--prev`` (default ``PREV``: one node-wide lock held
  through blocking writes, two pipes for stdout and stderr), loaded from git history;
- ``process``: today's default, the drainer process.

Workloads: ``start`` (``prefix_output()`` then ``restore()``, nothing written; the drainer process
loads ``prefix.py`` from its bytecode cache, written here first, as an installed package has it;
without one, e.g. under ``PYTHONDONTWRITEBYTECODE`` in a checkout, compiling it adds ~5 ms),
``lines`` (N ``print`` calls of 80 characters; stdout and stderr one file, so one pipe today),
``lines_sep`` (the same with stderr to a file of its own: two pipes, two destinations), ``cr`` (N ``\\r`` progress-bar updates: write +
flush), ``cr_yield`` (the same with ``os.sched_yield()`` after each update: the reader wakes for
every update, the old design's quadratic case), ``order`` (lines alternately to stdout and stderr
with ~50 us of Python work between; how many lines came out of order, i.e. lines minus the longest
in-order subsequence). Times run from the first write until ``restore()`` returns, i.e. until
everything is written out. Medians of ``--runs``; ratios against ``old``, ``prev`` and ``none``.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import py_compile
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASELINE = "05aaa05"  # the last commit with the thread design
PREV = "3dd85a8"  # the last commit before per-destination locks, non-blocking writes and the shared pipe

CHILD = r'''
import json, os, resource, sys, time
mode, work, n, result = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
import hangdoc.runtime.identity, hangdoc.runtime.printflock  # the old module imported them at its import
if mode == "old":
    import importlib.util
    spec = importlib.util.spec_from_file_location("old_prefix", os.environ["BENCH_OLD_PREFIX"])
    old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
    start = lambda: old.prefix_output()
elif mode == "prev":
    import importlib.util
    spec = importlib.util.spec_from_file_location("prev_prefix", os.environ["BENCH_PREV_PREFIX"])
    prev = importlib.util.module_from_spec(spec); spec.loader.exec_module(prev)
    start = lambda: prev.prefix_output(mode="process")
elif mode in ("thread", "process"):
    from hangdoc.runtime.prefix import prefix_output
    start = lambda: prefix_output(mode=mode)
else:
    start = lambda: (lambda: None)

def drainer_hwm():
    # the drainer process is in this process group (not a child: it forks once more)
    for pid in os.listdir("/proc"):
        try:
            if not pid.isdigit() or os.getpgid(int(pid)) != os.getpgrp() or int(pid) == os.getpid():
                continue
            if b"hangdoc_prefix_drainer" in open(f"/proc/{pid}/cmdline", "rb").read():
                for line in open(f"/proc/{pid}/status"):
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1])
        except OSError:
            pass
    return 0

out = {}
t0 = time.perf_counter()
restore = start()
t1 = time.perf_counter()
out["start"] = t1 - t0
if work in ("lines", "lines_sep"):
    line = "x" * 79
    t1 = time.perf_counter()
    for i in range(n):
        print(line)
elif work in ("cr", "cr_yield"):
    t1 = time.perf_counter()
    for i in range(n):
        sys.stdout.write("\r%3d%%|%-40s| %d/%d" % (i * 100 // n, "#" * (i * 40 // n), i, n))
        sys.stdout.flush()
        if work == "cr_yield":
            os.sched_yield()  # a loop that lets other threads and processes run at every update
    sys.stdout.write("\n")
elif work == "order":
    t1 = time.perf_counter()
    for i in range(n):
        os.write(1 + i % 2, b"%d\n" % i)
        end = time.perf_counter() + 50e-6
        while time.perf_counter() < end:
            pass
out["drainer_kb"] = drainer_hwm()
sys.stdout.flush()
t2 = time.perf_counter()
restore()
t3 = time.perf_counter()
out["restore"] = t3 - t2
out["work"] = t3 - t1
out["job_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with open(result, "w") as f:
    json.dump(out, f)
'''

MODES = ("none", "old", "thread", "prev", "process")


def run_one(mode: str, work: str, n: int, tmp: str, env: dict) -> dict:
    result = os.path.join(tmp, "result.json")
    log = os.path.join(tmp, "out.txt")
    with open(log, "wb") as f, open(log + ".err", "wb") as err:
        subprocess.run([sys.executable, "-c", CHILD, mode, work, str(n), result], stdout=f,
                       stderr=err if work == "lines_sep" else subprocess.STDOUT,
                       env=env, timeout=600, check=True, start_new_session=True)
    with open(result) as f:
        res = json.load(f)
    with open(log, "rb") as f:
        text = f.read()
    if work == "order":
        seq = [int(x.rsplit(b"] ", 1)[-1]) for x in text.splitlines() if x.rsplit(b"] ", 1)[-1].isdigit()]
        assert sorted(seq) == list(range(n)), (mode, len(seq))
        res["misplaced"] = len(seq) - _lis(seq)
    elif work in ("lines", "lines_sep"):
        assert text.count(b"\n") == n, (mode, text.count(b"\n"))
    return res


def _lis(seq: list) -> int:
    tails: list = []
    for x in seq:
        i = bisect.bisect_left(tails, x)
        tails[i:i + 1] = [x]
    return len(tails)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--lines", type=int, default=200_000)
    ap.add_argument("--updates", type=int, default=20_000)
    ap.add_argument("--pairs", type=int, default=2000, help="lines of the order workload")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--prev", default=PREV, help="the commit whose drainer process is 'prev'")
    args = ap.parse_args()
    modes = args.modes.split(",")
    tmp = tempfile.mkdtemp(prefix="bench-prefix-")
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop(MODE_ENV, None)
    old = os.path.join(tmp, "old_prefix.py")
    with open(old, "wb") as f:
        f.write(subprocess.run(["git", "-C", ROOT, "show", f"{BASELINE}:hangdoc/runtime/prefix.py"],
                               capture_output=True, check=True).stdout)
    env["BENCH_OLD_PREFIX"] = old
    prev = os.path.join(tmp, "prev_prefix.py")
    with open(prev, "wb") as f:
        f.write(subprocess.run(["git", "-C", ROOT, "show", f"{args.prev}:hangdoc/runtime/prefix.py"],
                               capture_output=True, check=True).stdout)
    py_compile.compile(prev, doraise=True)
    env["BENCH_PREV_PREFIX"] = prev
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cpus, median of {args.runs} runs; "
          f"baseline 'old' = {BASELINE}, 'prev' = {args.prev}")
    py_compile.compile(os.path.join(ROOT, "hangdoc", "runtime", "prefix.py"), doraise=True)
    works = [("start", "start", 0), ("lines", "lines", args.lines), ("lines_sep", "lines_sep", args.lines),
             ("cr", "cr", args.updates), ("cr_yield", "cr_yield", args.updates), ("order", "order", args.pairs)]
    table: dict = {}
    for name, work, n in works:
        for mode in modes:
            runs = [run_one(mode, work, n, tmp, env) for _ in range(args.runs)]
            table[name, mode] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(f"\n{'workload':<10}{'design':<9}{'time':>10}{'/old':>8}{'/prev':>8}{'/none':>8}   notes")
    for name, work, n in works:
        for mode in modes:
            r = table[name, mode]
            t = r["start"] + r["restore"] if name.startswith("start") else r["work"]
            base_old = table.get((name, "old"))
            base_none = table.get((name, "none"))
            base_prev = table.get((name, "prev"))
            pick = (lambda b: b["start"] + b["restore"]) if name.startswith("start") else (lambda b: b["work"])
            # (no ratio against nothing: ``none`` starts in ~0 ms)
            ro = f"{t / pick(base_old):.2f}" if base_old and pick(base_old) > 1e-4 else "-"
            rn = f"{t / pick(base_none):.2f}" if base_none and pick(base_none) > 1e-4 else "-"
            rp = f"{t / pick(base_prev):.2f}" if base_prev and pick(base_prev) > 1e-4 else "-"
            notes = []
            if name.startswith("start"):
                notes.append(f"start {r['start'] * 1e3:.1f} ms, restore {r['restore'] * 1e3:.1f} ms")
            if name in ("lines", "lines_sep") and r["work"] > 0:
                notes.append(f"{n / r['work'] / 1e3:.0f}k lines/s")
            if name in ("cr", "cr_yield", "lines", "lines_sep"):
                notes.append(f"job maxrss {r['job_kb'] / 1024:.0f} MB")
                if r["drainer_kb"]:
                    notes.append(f"drainer maxrss {r['drainer_kb'] / 1024:.0f} MB")
            if name == "order":
                notes.append(f"{r['misplaced']:.0f} of {n} lines out of order")
            print(f"{name:<10}{mode:<9}{t * 1e3:>8.1f}ms{ro:>8}{rp:>8}{rn:>8}   {', '.join(notes)}")


MODE_ENV = "HANGDOC_PREFIX_MODE"

if __name__ == "__main__":
    main()
