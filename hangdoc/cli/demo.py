"""``hangdoc demo [SCENARIO]``: watch hangdoc diagnose a real hang, on CPU, in about 20 seconds.

Launches a bundled hanging program (``hangdoc.examples``) under torchrun with gloo and hangdoc's
watchdog (``python -m hangdoc --hang-timeout 5``), shows the job's log until the lowest stalled
rank prints the verdict, then stops the job (every process of it) and exits: 0 when the verdict
was produced, 1 when it was not.

    hangdoc demo                      # 4 ranks, the last one skips a broadcast
    hangdoc demo pipeline --nproc 3   # a point-to-point cycle
    hangdoc demo --list
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import List

from hangdoc.cli import UsageError
from hangdoc.proctree import alive, descendants, free_port, kill_tree

#: the line the reporting rank prints last (hangdoc.runtime.exchange.verdict)
_DONE = "hangdoc: full report:"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", nargs="?", default="skip_broadcast", help="which bundled hang (default: skip_broadcast; --list shows all)")
    parser.add_argument("--nproc", type=int, default=None, metavar="N", help="ranks to start (default: the scenario's own)")
    parser.add_argument("--timeout", type=float, default=5.0, metavar="S", help="the watchdog's hang timeout in seconds (default 5)")
    parser.add_argument("--out", metavar="DIR", help="output directory (default: a new temporary directory, kept)")
    parser.add_argument("--wait", type=float, default=None, metavar="S",
                        help="give up when no verdict came this many seconds after the start (default: timeout + 40)")
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    parser.add_argument("--quiet", action="store_true", help="show only the verdict, not the job's log")


def command(script: str, nproc: int, timeout: float, out: str, port: int) -> List[str]:
    """The torchrun command line that runs ``script`` under hangdoc's watchdog."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(port),
        "--monitor-interval", "0.5",
        "-m", "hangdoc", "--hang-timeout", f"{timeout:g}", "--out", out,
        script,
    ]


def run(args: argparse.Namespace) -> int:
    from hangdoc import examples

    if args.list:
        for s in examples.SCENARIOS.values():
            print(f"{s.name:16} {s.nproc} ranks  {s.summary}")
        return 0
    if args.scenario not in examples.SCENARIOS:
        raise UsageError(f"unknown scenario {args.scenario!r}; one of {', '.join(sorted(examples.SCENARIOS))}")
    scenario = examples.SCENARIOS[args.scenario]
    nproc = args.nproc or scenario.nproc
    if nproc < 2:
        raise UsageError("--nproc must be at least 2")
    if args.timeout <= 0:
        raise UsageError("--timeout must be > 0")
    if importlib.util.find_spec("torch") is None:  # not imported: that alone takes seconds
        raise UsageError("the demo needs torch (pip install torch)")

    out = os.path.abspath(args.out) if args.out else tempfile.mkdtemp(prefix="hangdoc-demo-")
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ)
    # run the same hangdoc in the ranks, installed or not
    root = os.path.dirname(os.path.dirname(os.path.abspath(examples.__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    # a job left behind by accident ends by itself
    env["HANGDOC_DEMO_GLOO_TIMEOUT"] = str(int(args.timeout + 120))
    # outside the output directory, so that `hangdoc aggregate OUT` reads only hangdoc's files
    scenario_dir = tempfile.mkdtemp(prefix="hangdoc-demo-scenario-")
    script = examples.copy_to(scenario.name, scenario_dir)
    cmd = command(script, nproc, args.timeout, out, free_port())
    say = _Printer(quiet=args.quiet)
    say.info(f"hangdoc demo: {scenario.name}: {scenario.summary}")
    say.info(f"hangdoc demo: {nproc} ranks on gloo, watchdog timeout {args.timeout:g}s, output in {out}")

    started = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    verdict = threading.Event()
    reader = threading.Thread(target=_forward, args=(proc, say, verdict), daemon=True)
    reader.start()
    deadline = started + (args.wait if args.wait is not None else args.timeout + 40)
    exited = None
    try:
        while not verdict.is_set() and time.monotonic() < deadline:
            exited = proc.poll()
            if exited is not None:
                break
            verdict.wait(0.2)
        # the reporting rank writes report.txt before it prints; a moment for the last lines
        if verdict.is_set():
            time.sleep(0.2)
    except KeyboardInterrupt:
        say.info("hangdoc demo: interrupted")
    finally:
        say.stop()
        stop_job(proc)
        shutil.rmtree(scenario_dir, ignore_errors=True)
    elapsed = time.monotonic() - started
    report = os.path.join(out, "report.txt")
    if verdict.is_set() and os.path.exists(report):
        print(f"hangdoc demo: verdict {elapsed:.1f}s after the start; job stopped. Full report: {report}", file=sys.stderr)
        print(f"hangdoc demo: see also `hangdoc aggregate {out} --format html -o report.html`", file=sys.stderr)
        return 0
    why = f"the job exited with status {exited} first" if exited is not None else f"none {time.monotonic() - started:.0f}s after the start"
    print(f"hangdoc demo: no verdict ({why}); the job's files are in {out}", file=sys.stderr)
    return 1


class _Printer:
    """Job lines to stderr until stopped (after that, torchrun's shutdown noise is not shown)."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self._lock = threading.Lock()
        self._on = True

    def info(self, line: str) -> None:
        with self._lock:
            if self._on:
                sys.stderr.write(line + "\n")
                sys.stderr.flush()

    def job(self, line: str) -> None:
        if self.quiet and "hangdoc:" not in line:
            return
        if line.startswith(("[W", "W1", "I1")) and "hangdoc" not in line:
            return  # c10d/elastic warnings from the launcher
        self.info(line)

    def stop(self) -> None:
        with self._lock:
            self._on = False


def _forward(proc: subprocess.Popen, say: _Printer, verdict: threading.Event) -> None:
    assert proc.stdout is not None
    for raw in proc.stdout:
        line = raw.decode("utf-8", "replace").rstrip("\n")
        say.job(line)
        if _DONE in line:
            verdict.set()


def stop_job(proc: subprocess.Popen, grace: float = 3.0) -> List[int]:
    """Stop torchrun and every process under it (the ranks run in sessions of their own, so
    killing torchrun's process group is not enough); returns the pids it found under it."""
    pids = descendants(proc.pid)
    if proc.poll() is not None and not pids:
        return []
    for target in [proc.pid] + pids:
        _signal(target, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    kill_tree(proc.pid)
    for target in pids:  # ranks already re-parented when torchrun went first
        kill_tree(target)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    _reap(pids, grace)
    return pids


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except OSError:
        pass


def _reap(pids: List[int], timeout: float) -> None:
    # the ranks are torchrun's children; once torchrun is gone they are re-parented and reaped
    # by init, so wait until /proc no longer lists them
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
