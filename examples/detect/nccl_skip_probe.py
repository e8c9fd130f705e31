"""Which skipped broadcasts does NCCL silently "complete"? Many small 2-rank trials in one run.

Each trial is a fresh 2-process job. Every step issues two collectives of N floats; at step
``--skip-step`` (3) rank 1 skips the FIRST broadcast of the step, so from then on every call of
rank 1 is paired with the call rank 0 issued one earlier. Patterns:

    A  all_reduce(x) ; broadcast(p, src=0)
    B  broadcast(a, src=0) ; broadcast(b, src=0)      (syncing two parameters of one shape)
    C  broadcast(p, src=0) ; all_reduce(x)            (A with the order swapped)

After each step a rank checks its tensors against what a correct run holds (one host sync) and
appends ``step K <time> ok|bad`` to its progress file. Outcome of a trial:

    silent         both ranks finished every step: the backend completed the shifted calls
                   (the job trains on with wrong data; ``corrupt_from`` says from which step)
    hang-at-skip   the job never got past the skip step (some rank stuck in it)
    hang-later     the job got past the skip step and stuck at step ``hang_step``
    error-*        a rank raised (not a timeout) instead of hanging: at-skip / later / before-skip
    no-start       a rank never completed step 0 (init failed or too slow: see stderr_tail)

With ``--tail balance`` (default) rank 1 issues the skipped broadcast once more after its last
step, so both ranks issue the same number of calls and "silent" means the job would run to its
end; ``--tail none`` leaves rank 0 one call ahead, so a silent pairing hangs at the last step.

A hang is called once no rank has written progress for ``--stall`` seconds (after step 0, which
holds NCCL's lazy connection set-up); ``--timeout`` bounds each trial's wall time, init included;
the process group timeout (``--pg-timeout``) is shorter still, so nothing waits on NCCL's default
10 minutes. Every rank runs in a session of its own and the driver kills both sessions when a trial
ends, on a timeout, and on Ctrl-C. Ranks meet through a FileStore (no ports to race for between
parallel trials); rank r uses cuda:r, so several trials share the 2 GPUs (``--parallel``).

    # 2 GPUs, the default matrix (32 trials), JSON to $OUT/probe.json or ./probe.json:
    python examples/detect/nccl_skip_probe.py
    # the full cross product of what you name:
    python examples/detect/nccl_skip_probe.py --patterns A --sizes 256,65536 --protos LL,Simple --algos Ring
    # the plumbing on CPU:
    python examples/detect/nccl_skip_probe.py --backend gloo --patterns A,B --sizes 256 --timeout 15

The JSON is rewritten (atomically) after every trial and the table printed as trials end, so a run
cut off half way still says what it found.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from hangdoc.atomic import write_atomic  # noqa: E402

PATTERNS = {
    "A": ("all_reduce:x", "broadcast:p"),
    "B": ("broadcast:a", "broadcast:b"),
    "C": ("broadcast:p", "all_reduce:x"),
}
SIZES = (256, 4096, 65536, 1048576)
PROTOS = ("default", "Simple", "LL", "LL128")
ALGOS = ("default", "Ring", "Tree")
# House rule on the GPU hosts (NVLink multicast off), plus fail-fast error handling.
FIXED_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "OMP_NUM_THREADS": "1",
}
RAISED_EXIT = 3  # a rank's collective raised (its message is in the progress file)


# ----------------------------------------------------------------------------------------- worker

def expected(name: str, step: int, rank: int, world: int) -> float:
    """What tensor ``name`` holds after its collective at ``step`` in a correct run: distinct per
    tensor and step, so a call paired with another step's (or tensor's) call shows as a wrong value."""
    if name == "x":  # all_reduce of (rank + 1 + 10*step)
        return float(sum(r + 1 + 10 * step for r in range(world)))
    return float({"p": 1000, "a": 2000, "b": 3000}[name] + step)


def initial(name: str, step: int, rank: int) -> float:
    """What ``rank`` puts into tensor ``name`` before its collective (a receiver's -1 never survives)."""
    if name == "x":
        return float(rank + 1 + 10 * step)
    return float({"p": 1000, "a": 2000, "b": 3000}[name] + step) if rank == 0 else -1.0


def worker(spec: dict) -> int:
    import datetime

    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), 2
    log = open(os.path.join(spec["dir"], f"progress-r{rank}.txt"), "a", buffering=1)

    def say(*words) -> None:
        log.write(" ".join(str(w) for w in words) + "\n")
        log.flush()

    if spec["backend"] == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(spec["backend"], init_method="file://" + os.path.join(spec["dir"], "store"),
                            rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=spec["pg_timeout"]))
    meta = {"torch": torch.__version__, "python": platform.python_version()}
    if spec["backend"] == "nccl":
        try:
            meta["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
        except Exception:
            pass
        meta["cuda"] = torch.version.cuda
        meta["device"] = torch.cuda.get_device_name(device)
    say("start", time.time(), json.dumps(meta))
    n, skip = spec["n"], spec["skip_step"]
    calls = PATTERNS[spec["pattern"]]
    first_bcast = next(i for i, c in enumerate(calls) if c.startswith("broadcast"))
    step = -1
    try:
        for step in range(spec["steps"]):
            tensors = {}
            ok = torch.ones((), dtype=torch.bool, device=device)
            for i, call in enumerate(calls):
                op, name = call.split(":")
                t = torch.full((n,), initial(name, step, rank), device=device)
                tensors[name] = t
                if step == skip and rank == 1 and i == first_bcast:
                    continue  # the bug: rank 1 skips this broadcast
                if op == "all_reduce":
                    dist.all_reduce(t)
                else:
                    dist.broadcast(t, src=0)
                ok &= (t == expected(name, step, rank, world)).all()
            good = bool(ok.item())  # the host sync: where a hang shows
            say("step", step, time.time(), "ok" if good else "bad")
        if spec["tail"] == "balance" and rank == 1 and spec["steps"] > skip:
            dist.broadcast(torch.zeros(n, device=device), src=0)  # the call skipped, owed to rank 0
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            say("tail", time.time())
        say("finished", time.time())
    except Exception as e:  # a pg timeout or an error from the backend: the driver classifies it
        say("raised", step + 1, time.time(), json.dumps(f"{type(e).__name__}: {e}"[:500]))
        code = RAISED_EXIT
    else:
        code = 0
    # No interpreter teardown: destroying a process group with calls a mismatched peer never
    # matched can wait or abort; the driver has what it needs.
    log.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ----------------------------------------------------------------------------------------- driver

def default_matrix(backend: str) -> List[dict]:
    """The ~32 trials worth one short GPU run (see --help); on gloo proto/algo mean nothing."""
    m = [dict(pattern=p, n=n, proto="default", algo="default") for p in "ABC" for n in SIZES]
    if backend != "nccl":
        return m
    m += [dict(pattern="A", n=n, proto=pr, algo="default") for pr in ("Simple", "LL", "LL128") for n in SIZES]
    m += [dict(pattern="A", n=n, proto="default", algo=al) for al in ("Ring", "Tree") for n in (256, 65536)]
    m += [dict(pattern="C", n=n, proto=pr, algo="default") for pr in ("Simple", "LL") for n in (256, 65536)]
    return m


class Trial:
    def __init__(self, tid: int, cfg: dict, args, base: str) -> None:
        self.id, self.cfg, self.args = tid, cfg, args
        self.dir = os.path.join(base, f"t{tid:03d}")
        os.makedirs(self.dir)
        self.procs: List[subprocess.Popen] = []
        self.started = self.first_step_all = None
        self.last_change = 0.0
        self.sizes = [-1, -1]
        self.ended: Optional[str] = None

    def env(self) -> Dict[str, str]:
        env = dict(os.environ)
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name, None)
        env.update(FIXED_ENV)
        env.setdefault("NCCL_DEBUG", "WARN")
        for key, value in (("NCCL_PROTO", self.cfg["proto"]), ("NCCL_ALGO", self.cfg["algo"])):
            env.pop(key, None)
            if value != "default":
                env[key] = value
        env.update(self.args.extra_env)
        return env

    def start(self) -> None:
        spec = dict(self.cfg, dir=self.dir, backend=self.args.backend, steps=self.args.steps,
                    skip_step=self.args.skip_step, pg_timeout=self.args.pg_timeout, tail=self.args.tail)
        env = self.env()
        self.started = self.last_change = time.monotonic()
        for rank in range(2):
            env["RANK"] = str(rank)
            with open(os.path.join(self.dir, f"out-r{rank}.txt"), "wb") as out, \
                    open(os.path.join(self.dir, f"err-r{rank}.txt"), "wb") as err:
                # a session per rank: killpg reaches the rank and anything it started
                self.procs.append(subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)],
                    env=dict(env), stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                    start_new_session=True))

    def progress(self) -> List[List[List[str]]]:
        lines = []
        for rank in range(2):
            try:
                with open(os.path.join(self.dir, f"progress-r{rank}.txt")) as f:
                    # "start T {json}" and "raised STEP T {json}": the JSON holds spaces
                    lines.append([ln.split(" ", 2 if ln.startswith("start ") else 3)
                                  for ln in f.read().splitlines() if ln])
            except OSError:
                lines.append([])
        return lines

    def poll(self) -> bool:
        """True once the trial is over (and its processes killed)."""
        now = time.monotonic()
        sizes = []
        for rank in range(2):
            try:
                sizes.append(os.path.getsize(os.path.join(self.dir, f"progress-r{rank}.txt")))
            except OSError:
                sizes.append(-1)
        if sizes != self.sizes:
            self.sizes, self.last_change = sizes, now
        prog = self.progress()
        done = [any(w[0] in ("finished", "raised") for w in p) for p in prog]
        past_step0 = [d or any(w[0] == "step" for w in p) for d, p in zip(done, prog)]
        exited = [p.poll() is not None for p in self.procs]
        if all(done) or all(exited):
            self.ended = "exited" if all(exited) else "finished"
        elif now - self.started > self.args.timeout:
            self.ended = "timeout"
        elif all(past_step0) and now - self.last_change > self.args.stall:
            self.ended = "stall"
        elif any(e and not d for e, d in zip(exited, done)) and now - self.last_change > 2.0:
            self.ended = "rank-died"  # one rank gone without a word: its stderr says why
        if self.ended is None:
            return False
        if self.ended == "finished":
            deadline = now + 3.0  # let them exit on their own (os._exit right after "finished")
            while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
                time.sleep(0.05)
        self.kill()
        return True

    def kill(self) -> None:
        for p in self.procs:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.killpg(p.pid, sig)
                except OSError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def result(self) -> dict:
        steps, skip = self.args.steps, self.args.skip_step
        prog = self.progress()
        done_steps, finished, corrupt, bad, raised, meta = [], [], [], [], [], {}
        for p in prog:
            oks = [(int(w[1]), w[3]) for w in p if w[0] == "step" and len(w) >= 4]
            done_steps.append(max((s for s, _ in oks), default=-1) + 1)
            finished.append(any(w[0] == "finished" for w in p))
            corrupt.append(next((s for s, v in oks if v != "ok"), None))
            bad.append(sum(v != "ok" for _, v in oks))
            r = next((w for w in p if w[0] == "raised"), None)
            raised.append(json.loads(r[3]) if r and len(r) >= 4 else None)
            for w in p:
                if w[0] == "start" and len(w) >= 3 and not meta:
                    try:
                        meta = json.loads(w[2])
                    except ValueError:
                        pass
        stop = min(done_steps)  # the first step the job as a whole did not complete
        if all(finished) and stop >= steps:
            outcome = "silent"
        elif stop <= 0 and not any(raised):
            outcome = "no-start"
        else:
            where = "at-skip" if stop == skip else "later" if stop > skip else "before-skip"
            timed_out = any(r and "timeout" in r.lower() or r and "timed out" in r.lower() for r in raised)
            outcome = ("error-" if any(raised) and not timed_out else "hang-") + where
        res = dict(id=self.id, **self.cfg, outcome=outcome, hang_step=None if outcome == "silent" else stop,
                   steps_done=done_steps, finished=finished, corrupt_from=corrupt, bad_steps=bad,
                   raised=raised, ended=self.ended, wall_s=round(time.monotonic() - self.started, 2),
                   returncodes=[p.returncode for p in self.procs], pids=[p.pid for p in self.procs],
                   env={k: v for k, v in self.env().items() if k in ("NCCL_PROTO", "NCCL_ALGO")},
                   meta=meta)
        if outcome != "silent":
            res["stderr_tail"] = {f"r{r}": tail(os.path.join(self.dir, f"err-r{r}.txt")) for r in range(2)}
        return res


def tail(path: str, lines: int = 12) -> List[str]:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 16384))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    return [ln[:300] for ln in text.splitlines()[-lines:]]


def write_json(path: str, doc: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_atomic(path, json.dumps(doc, indent=1) + "\n")


def row(r: dict) -> str:
    what = r["outcome"] if r["hang_step"] is None else f"{r['outcome']} (step {r['hang_step']})"
    corrupt = ",".join("-" if c is None else str(c) for c in r["corrupt_from"])
    return (f"{r['id']:>3} {r['pattern']:>3} {r['n']:>8} {r['proto']:>8} {r['algo']:>8}  {what:<24} "
            f"{'/'.join(map(str, r['steps_done'])):>6} {corrupt:>6} {r['ended']:>9} {r['wall_s']:>6.1f}")


HEADER = (f"{'id':>3} {'pat':>3} {'N':>8} {'proto':>8} {'algo':>8}  {'outcome':<24} "
          f"{'steps':>6} {'bad@':>6} {'ended':>9} {'wall':>6}")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="nccl", choices=("nccl", "gloo"))
    ap.add_argument("--patterns", help="A,B,C (naming any of patterns/sizes/protos/algos runs their "
                    "cross product, the rest at their full lists; none named: the default subset)")
    ap.add_argument("--sizes", help=f"element counts, default {','.join(map(str, SIZES))}")
    ap.add_argument("--protos", help=f"NCCL_PROTO values, default {','.join(PROTOS)}")
    ap.add_argument("--algos", help=f"NCCL_ALGO values, default {','.join(ALGOS)}")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--skip-step", type=int, default=3)
    ap.add_argument("--tail", default="balance", choices=("balance", "none"))
    ap.add_argument("--timeout", type=float, default=20.0, help="wall seconds per trial, init included")
    ap.add_argument("--stall", type=float, default=5.0, help="seconds without progress after step 0: a hang")
    ap.add_argument("--pg-timeout", type=float, default=None, help="process group timeout (default min(15, 0.75*timeout))")
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--env", dest="extra_env", action="append", default=[], metavar="KEY=VALUE",
                    help="set for every trial (repeatable)")
    ap.add_argument("--out", help="JSON path (default $OUT/probe.json, else ./probe.json)")
    ap.add_argument("--keep", metavar="DIR", help="keep every trial's files (progress, stderr) under DIR")
    ap.add_argument("--list", action="store_true", help="print the trials and exit")
    args = ap.parse_args(argv)
    try:
        args.extra_env = dict(kv.split("=", 1) for kv in args.extra_env)
    except ValueError:
        ap.error("--env takes KEY=VALUE")
    if args.pg_timeout is None:
        args.pg_timeout = min(15.0, 0.75 * args.timeout)
    if args.out is None:
        args.out = os.path.join(os.environ.get("OUT") or ".", "probe.json")
    named = [args.patterns, args.sizes, args.protos, args.algos]
    if any(v is not None for v in named):
        gloo = args.backend != "nccl"
        pats = (args.patterns or "A,B,C").split(",")
        sizes = [int(s) for s in (args.sizes or ",".join(map(str, SIZES))).split(",")]
        protos = (args.protos or ("default" if gloo else ",".join(PROTOS))).split(",")
        algos = (args.algos or ("default" if gloo else ",".join(ALGOS))).split(",")
        if any(p not in PATTERNS for p in pats):
            ap.error(f"--patterns: choose from {','.join(PATTERNS)}")
        args.matrix = [dict(pattern=p, n=n, proto=pr, algo=al)
                       for p, n, pr, al in itertools.product(pats, sizes, protos, algos)]
    else:
        args.matrix = default_matrix(args.backend)
    return args


def drive(args) -> dict:
    base = args.keep or tempfile.mkdtemp(prefix="nccl-skip-probe-")
    os.makedirs(base, exist_ok=True)
    doc = dict(version=1, backend=args.backend, host=platform.node(), started=time.time(),
               settings=dict(steps=args.steps, skip_step=args.skip_step, tail=args.tail, timeout=args.timeout,
                             stall=args.stall, pg_timeout=args.pg_timeout, parallel=args.parallel,
                             fixed_env=FIXED_ENV, extra_env=args.extra_env),
               planned=len(args.matrix), trials=[], summary={})
    queue = [Trial(i, cfg, args, base) for i, cfg in enumerate(args.matrix)]
    running: List[Trial] = []
    t0 = time.monotonic()

    def stop(signum, frame):  # SIGTERM from a runner's time limit: kill the trials, keep the JSON
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, stop)
    print(f"{len(queue)} trials, {args.parallel} at a time, backend {args.backend}; JSON: {args.out}", flush=True)
    print(HEADER, flush=True)
    try:
        while queue or running:
            while queue and len(running) < args.parallel:
                trial = queue.pop(0)
                trial.start()
                running.append(trial)
            time.sleep(0.1)
            for trial in list(running):
                if trial.poll():
                    running.remove(trial)
                    res = trial.result()
                    doc["trials"].append(res)
                    if res["meta"] and "meta" not in doc:
                        doc["meta"] = res["meta"]
                    doc["trials"].sort(key=lambda r: r["id"])
                    doc["summary"] = summarize(doc["trials"])
                    doc["wall_s"] = round(time.monotonic() - t0, 1)
                    write_json(args.out, doc)
                    print(row(res), flush=True)
    except KeyboardInterrupt:
        print("interrupted: killing the running trials", flush=True)
        doc["interrupted"] = True
    finally:
        for trial in running:
            trial.kill()
        signal.signal(signal.SIGTERM, old)
        doc["wall_s"] = round(time.monotonic() - t0, 1)
        write_json(args.out, doc)
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    counts = doc["summary"].get("outcomes", {})
    print(f"done in {doc['wall_s']} s: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())), flush=True)
    for r in doc["trials"]:
        if r["outcome"] not in ("silent",) and (r["raised"][0] or r["raised"][1] or r["outcome"] == "no-start"):
            print(f"  trial {r['id']} raised/stderr: {r['raised']} {r.get('stderr_tail', {}).get('r0', [])[-2:]}",
                  flush=True)
    return doc


def summarize(trials: List[dict]) -> dict:
    outcomes: Dict[str, int] = {}
    for r in trials:
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    silent = [dict(pattern=r["pattern"], n=r["n"], proto=r["proto"], algo=r["algo"]) for r in trials
              if r["outcome"] == "silent"]
    later = [dict(pattern=r["pattern"], n=r["n"], proto=r["proto"], algo=r["algo"], hang_step=r["hang_step"])
             for r in trials if r["outcome"] == "hang-later"]
    return dict(outcomes=outcomes, silent=silent, hang_later=later)


def pick(path: str) -> str:
    """The configuration for examples/detect/nccl_silent_skip.py from a probe's JSON, as
    ``ENV=VALUE ... -- --pattern P --size N``: the first pairing of a broadcast with an all_reduce
    (patterns A, C: the signatures differ, so the detector can tell) that NCCL completed silently,
    else one that ran on past the skip before hanging; empty when there is none."""
    try:
        with open(path) as f:
            trials = json.load(f)["trials"]
    except (OSError, ValueError, KeyError) as e:
        print(f"{path}: no probe results ({type(e).__name__}: {e})", file=sys.stderr)
        return ""
    for outcome in ("silent", "hang-later"):
        for r in trials:
            if r["outcome"] == outcome and r["pattern"] in ("A", "C"):
                env = " ".join(f"{name}={r[key]}" for name, key in (("NCCL_PROTO", "proto"), ("NCCL_ALGO", "algo"))
                               if r[key] != "default")
                return f"{env} -- --pattern {r['pattern']} --size {r['n']}".strip()
    return ""


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--worker"]:
        return worker(json.loads(argv[1]))
    if argv[:1] == ["--pick"]:
        print(pick(argv[1]))
        return 0
    args = parse_args(argv)
    if args.list:
        for i, cfg in enumerate(args.matrix):
            print(i, cfg)
        return 0
    drive(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
