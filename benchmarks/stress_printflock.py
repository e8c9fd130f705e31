"""Stress printflock: N processes x M lines of ~200 chars into one shared pipe and one shared file.

Every line must arrive whole (no torn or interleaved line) and none may be lost. The writers are
separate Python processes that inherit the same stdout, as ranks started by torchrun with their
output redirected to one console or one ``> log.txt`` do.

    python benchmarks/stress_printflock.py                      # 32 x 10,000, pipe and file
    python benchmarks/stress_printflock.py --procs 32 --lines 2000 --target pipe
    python benchmarks/stress_printflock.py --mode print         # baseline: plain print, for contrast

Exit status 0 when every line of every target is whole and present, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINE_RE = re.compile(r"^P(\d{3}) L(\d{6}) ([0-9a-f]{8}) ([a-z]+)$")
PAYLOAD = 180  # + 25 chars of header ~ 205 chars per line


def line_for(proc: int, i: int) -> str:
    body = "abcdefghijklmnopqrstuvwxyz"[(proc + i) % 26] * PAYLOAD
    return f"P{proc:03d} L{i:06d} {zlib.crc32(body.encode()):08x} {body}"


def worker(proc: int, lines: int, mode: str) -> None:
    if mode == "printflock":
        from hangdoc.runtime.printflock import printflock as out
    else:
        out = print
    for i in range(lines):
        out(line_for(proc, i))
    sys.stdout.flush()


def check(data: bytes, procs: int, lines: int) -> dict:
    seen = set()
    bad = 0
    duplicates = 0
    for raw in data.split(b"\n")[:-1] if data.endswith(b"\n") else data.split(b"\n"):
        m = LINE_RE.match(raw.decode("utf-8", "replace"))
        if not m or zlib.crc32(m.group(4).encode()) != int(m.group(3), 16) or len(m.group(4)) != PAYLOAD:
            bad += 1
            continue
        key = (int(m.group(1)), int(m.group(2)))
        if key in seen:
            duplicates += 1
        seen.add(key)
    expected = procs * lines
    lost = expected - len(seen)
    return {"lines": len(seen), "torn": bad, "lost": lost, "duplicates": duplicates, "bytes": len(data),
            "ok": bad == 0 and lost == 0 and duplicates == 0}


def _spawn(procs: int, lines: int, mode: str, stdout) -> list:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, os.path.abspath(__file__), "--worker"]
    return [
        subprocess.Popen(cmd + [str(p), str(lines), mode], stdout=stdout, env=env, start_new_session=True)
        for p in range(procs)
    ]


def _reap(children: list, deadline: float) -> None:
    try:
        for c in children:
            c.wait(timeout=max(0.1, deadline - time.monotonic()))
    finally:
        for c in children:
            if c.poll() is None:
                os.killpg(c.pid, 9)
                c.wait()


def run_pipe(procs: int, lines: int, mode: str, timeout: float) -> dict:
    r, w = os.pipe()
    chunks = []
    reader = threading.Thread(target=lambda: [chunks.append(b) for b in iter(lambda: os.read(r, 1 << 16), b"")], daemon=True)
    reader.start()
    try:
        children = _spawn(procs, lines, mode, w)
    finally:
        os.close(w)  # the reader sees EOF once every child has exited
    _reap(children, time.monotonic() + timeout)
    reader.join(timeout)
    os.close(r)
    return check(b"".join(chunks), procs, lines)


def run_file(procs: int, lines: int, mode: str, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "shared.log")
        with open(path, "wb") as f:  # one open file description shared by all, like `> log.txt`
            children = _spawn(procs, lines, mode, f)
            _reap(children, time.monotonic() + timeout)
        with open(path, "rb") as f:
            return check(f.read(), procs, lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--procs", type=int, default=32)
    p.add_argument("--lines", type=int, default=10_000)
    p.add_argument("--target", choices=["pipe", "file", "both"], default="both")
    p.add_argument("--mode", choices=["printflock", "print"], default="printflock")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(int(args.worker[0]), int(args.worker[1]), args.worker[2])
        return 0
    ok = True
    for target in (["pipe", "file"] if args.target == "both" else [args.target]):
        t0 = time.perf_counter()
        res = (run_pipe if target == "pipe" else run_file)(args.procs, args.lines, args.mode, args.timeout)
        dt = time.perf_counter() - t0
        ok &= res["ok"]
        print(f"{args.mode:10s} {target:4s} {args.procs} procs x {args.lines} lines: {res['lines']} whole, "
              f"{res['torn']} torn, {res['lost']} lost, {res['duplicates']} duplicated, "
              f"{res['bytes'] / 1e6:.1f} MB in {dt:.1f} s -> {'OK' if res['ok'] else 'FAIL'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
