"""Run a record example until it hangs, collect what every rank wrote, kill everything.

    python examples/records/capture.py skip_broadcast --nproc 4 --out /tmp/skip
    python examples/records/capture.py --all --fixtures tests/fixtures/records   # refresh fixtures

Each example dumps its own records after a few seconds without progress (see _common.py); this
launcher waits for one records file per rank (or for every rank to exit), then kills the whole
process group, whatever happened. ``--launcher direct`` starts the ranks itself (what the tests do:
no torchrun agent, faster start); the default is torchrun.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # run from a checkout without installing

from hangdoc.proctree import free_port  # noqa: E402

#: scenario -> (script, ranks, extra args)
SCENARIOS = {
    "skip_broadcast": ("skip_broadcast.py", 4, []),
    "uneven_inputs": ("uneven_inputs.py", 3, []),
    "recv_cycle": ("recv_cycle.py", 2, []),
    "shape_mismatch": ("shape_mismatch.py", 2, []),
}


def launch(scenario: str, out: str, launcher: str = "direct", timeout: float = 40.0,
           fr: bool = True, idle: float = 2.0) -> List[str]:
    """Run ``scenario`` into ``out``; returns the records files written (one per rank when it hung)."""
    script, nproc, extra = SCENARIOS[scenario]
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, HANGDOC_OUT=out, HANGDOC_EXAMPLE_IDLE=str(idle), OMP_NUM_THREADS="1",
               HANGDOC_HOST="node1", PYTHONUNBUFFERED="1")
    if fr:
        env["TORCH_FR_BUFFER_SIZE"] = "2000"
    port = free_port()
    path = os.path.join(HERE, script)
    procs: List[subprocess.Popen] = []
    log = open(os.path.join(out, "launcher.log"), "wb")
    try:
        if launcher == "torchrun":
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                   "--master-port", str(port), path, *extra]
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        else:
            for rank in range(nproc):
                e = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                         MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
                procs.append(subprocess.Popen([sys.executable, path, *extra], env=e, stdout=log,
                                              stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            files = glob.glob(os.path.join(out, "collectives-*.jsonl"))
            if len(files) >= nproc:
                time.sleep(0.3)  # let the FR / stack dumps that precede the records land
                break
            if launcher == "direct" and all(p.poll() is not None for p in procs):
                break
            time.sleep(0.1)
    finally:
        # Freeze every rank first: a rank killed while a peer still runs would make that peer's
        # pending call fail (connection closed) and its exit handler rewrite its records.
        # torchrun puts each worker in a session of its own: find them through their parents.
        pids = [q for p in procs for q in _descendants(p.pid)]
        for p in procs:
            _signal(p, signal.SIGSTOP)
        for q in pids:
            _kill_pid(q, signal.SIGSTOP)
        for q in pids:
            _kill_pid(q, signal.SIGKILL)
        for p in procs:
            _signal(p, signal.SIGKILL)
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        log.close()
    return sorted(glob.glob(os.path.join(out, "collectives-*.jsonl")))


def _descendants(pid: int) -> List[int]:
    children: dict = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), ()):
            out.append(c)
            todo.append(c)
    return out


def _kill_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenario", nargs="?", choices=sorted(SCENARIOS))
    ap.add_argument("--all", action="store_true", help="every scenario")
    ap.add_argument("--out", default="hangdoc-out", help="output directory (one scenario)")
    ap.add_argument("--fixtures", help="with --all: write each scenario into FIXTURES/<scenario>/ (replacing it)")
    ap.add_argument("--launcher", choices=("torchrun", "direct"), default="torchrun")
    ap.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args(argv)
    names = sorted(SCENARIOS) if args.all else [args.scenario]
    if not names or names == [None]:
        ap.error("name a scenario or pass --all")
    for name in names:
        out = os.path.join(args.fixtures, name) if args.fixtures else (args.out if not args.all else os.path.join(args.out, name))
        if args.fixtures and os.path.isdir(out):
            shutil.rmtree(out)
        files = launch(name, out, launcher=args.launcher, timeout=args.timeout)
        print(f"{name}: {len(files)} records files in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
