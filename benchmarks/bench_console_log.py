"""Reading a huge console log: ``hangdoc aggregate`` against ``grep`` on the same file.

    python benchmarks/bench_console_log.py --size-mb 1024 --rounds 3

Builds one console log the way a long job leaves it: millions of training lines from every rank
(``[rankN]:`` prefixed step/loss/throughput lines, as torch prints them under torchrun), with the
real watchdog lines of a captured NCCL hang (``tests/fixtures/gpu/nccl_skip_broadcast/log.txt``:
its timeouts, watchdog states and Flight Recorder stacks, verbatim) near the end, where a hang
leaves them. The training lines are load, not evidence: they are generated.

Then, alternating in each round so that both see the same page cache:

- ``grep -c 'Watchdog caught'`` on the file (the floor: one pass at disk/cache speed);
- ``hangdoc aggregate FILE --format json`` (read, peel prefixes, find the events, diagnose);

and prints wall seconds, the ratio, hangdoc's peak RSS (``ru_maxrss`` of the child) and the
verdict. ``--dense`` puts a watchdog line in every 4 MB, so that no stretch can be skipped: the
worst case, every line peeled and matched.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
REAL = os.path.join(ROOT, "tests", "fixtures", "gpu", "nccl_skip_broadcast", "log.txt")


def build(path: str, size: int, dense: bool) -> int:
    with open(REAL, encoding="utf-8") as f:
        real = f.read()
    tail = real.encode()
    # one real watchdog line, for the dense variant
    probe = next(x for x in real.splitlines() if "Watchdog caught" in x).encode() + b"\n"
    lines = []
    for step in range(4096):
        for rank in range(8):
            lines.append(f"[rank{rank}]:step {step} | loss {2.5 - step * 1e-4:.4f} | lr 3.0e-04 | grad_norm "
                         f"{0.8 + (step % 7) * 0.01:.3f} | tokens/s {51234 + rank * 17} | mem 61.2GB\n".encode())
    block = b"".join(lines)
    written = 0
    with open(path, "wb") as f:
        while written + len(block) + len(tail) < size:
            f.write(block)
            written += len(block)
            if dense:
                f.write(probe)
                written += len(probe)
        f.write(tail)
        written += len(tail)
    return written


def timed(cmd) -> tuple:
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t = time.perf_counter()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=ROOT))
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return wall, p, max(before, after)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dense", action="store_true", help="a watchdog line in every 4 MB: nothing can be skipped")
    ap.add_argument("--keep", help="write the log here and keep it")
    args = ap.parse_args()
    d = tempfile.mkdtemp(prefix="hangdoc-bench-log-")
    path = args.keep or os.path.join(d, "slurm-1234.out")
    n = build(path, args.size_mb << 20, args.dense)
    print(f"log: {path}, {n / (1 << 20):.0f} MB, {'dense' if args.dense else 'watchdog lines at the end'}")
    rows = []
    rss = 0
    verdict = None
    for i in range(args.rounds):
        g, gp, _ = timed(["grep", "-c", "Watchdog caught", path])
        h, hp, rss_now = timed([sys.executable, "-m", "hangdoc", "aggregate", path, "--format", "json"])
        if hp.returncode != 0:
            print(hp.stderr.decode()[-2000:])
            return 1
        rss = max(rss, rss_now)
        doc = json.loads(hp.stdout)
        verdict = (doc["findings"][0]["kind"], [c["rank"] for c in doc["findings"][0]["culprits"]], len(doc["events"]))
        rows.append((g, h))
        print(f"round {i + 1}: grep {g:.2f} s ({gp.stdout.decode().strip()} lines), hangdoc {h:.2f} s, ratio {h / g:.1f}x")
    gm = sorted(r[0] for r in rows)[len(rows) // 2]
    hm = sorted(r[1] for r in rows)[len(rows) // 2]
    print(f"median: grep {gm:.2f} s, hangdoc {hm:.2f} s ({n / (1 << 20) / hm:.0f} MB/s), ratio {hm / gm:.1f}x; "
          f"peak RSS of the children {rss / 1024:.0f} MB; verdict {verdict}")
    if not args.keep:
        os.unlink(path)
        os.rmdir(d)
    return 0


if __name__ == "__main__":
    sys.exit(main())
