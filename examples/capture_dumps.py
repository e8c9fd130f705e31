"""Run one of the example hangs under torchrun, wait until it hangs, dump every process, kill it.

    python examples/capture_dumps.py skip_broadcast --nproc 4 --nodes 2 \\
        --out tests/fixtures/dumps/skip_broadcast

The job runs on this machine, but its ranks are split into ``--nodes`` pretend nodes (ranks
``0..k-1`` → ``node1``, the next ``k`` → ``node2``, ...) and each dump kind is written one file per
node, processes back to back, the way

    srun --output=trace-%N.out sh -c 'pgrep -P $(pgrep -o python) | xargs -I {} py-spy dump --pid {}'

leaves them on a cluster: the dumper's stdout and stderr together, no host name inside the file.
What it writes under ``--out`` (see the README.md it writes there):

* ``plain/trace-nodeN.out``: ``py-spy dump --pid RANK`` for each rank (children of the launcher,
  in pid order, exactly the srun line above);
* ``full/trace-nodeN.out``: the same with ``--full-filenames`` (site-packages paths left in);
* ``native/``, ``locals/``, ``json/``: the same with ``--native``, ``--locals``, ``--json``;
* ``with-workers/trace-nodeN.out``: ``py-spy dump --subprocesses --pid RANK`` (each rank followed
  by its DataLoader workers);
* ``launcher/trace-nodeN.out``: ``py-spy dump --pid LAUNCHER`` (torchrun itself, on node1 only);
* ``pystack/trace-nodeN.out``: ``pystack remote --native RANK``;
* ``gdb/trace-nodeN.out``: ``gdb -p RANK -batch -ex "thread apply all bt"``;
* ``faulthandler/stderr-rankR.log``: the rank's stderr after ``SIGUSR1`` was sent to the rank and
  its workers (the scenarios register ``faulthandler`` on SIGUSR1);
* ``console.log``: the launcher's console (``--tee 3``, lines prefixed ``[default0]:``);
* ``traceback/console.log`` (with ``--traceback``): a second run with a short gloo timeout, whose
  ranks die with a Python traceback, lines prefixed ``[rank1]:``
  (``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE='[rank${rank}]:'``);
* ``truth.json``: what really was where: ``{"host:pid": {"rank", "role", "ppid"}}`` — the answer key
  for the readers' tests (also usable as a rank map).

Every process it starts is in its own session and is killed with ``os.killpg`` in ``finally``,
whatever happens. Each dumper call has a time limit; a dumper that times out or fails leaves its
own output (an ``Error: ...`` from py-spy, say) in the file, as it would on a cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # run from a checkout without installing

from hangdoc.proctree import descendants, free_port, kill_tree, parent_map  # noqa: E402


def children(pid: int) -> List[int]:
    """Direct children of ``pid``, in pid order (what ``pgrep -P`` prints)."""
    return sorted(parent_map().get(pid, []))


def environ_of(pid: int) -> Dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    env = {}
    for item in raw.split(b"\0"):
        if b"=" in item:
            k, v = item.split(b"=", 1)
            env[k.decode(errors="replace")] = v.decode(errors="replace")
    return env


def run_dumper(cmd: List[str], timeout: float = 30.0) -> str:
    """stdout and stderr of one dumper call together, as ``srun --output`` keeps them."""
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout,
                           start_new_session=True)
        return p.stdout.decode(errors="replace")
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace")
        return out + f"{cmd[0]}: timed out after {timeout:.0f}s\n"


def wait_for_hang(log_path: str, expected: int, proc: subprocess.Popen, limit: float) -> bool:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        with open(log_path, errors="replace") as f:
            if f.read().count("HANG-POINT rank=") >= expected:
                return True
        if proc.poll() is not None:
            return False
        time.sleep(0.3)
    return False


def start_job(script: str, nproc: int, log_path: str, env_extra: Dict[str, str], log_dir: Optional[str]):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(free_port()), "--tee", "3"]
    if log_dir:
        cmd += ["--log-dir", log_dir]
    cmd.append(script)
    env = dict(os.environ, **env_extra)
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                            cwd=os.path.dirname(HERE))
    return proc, log, cmd


def kill_job(proc: subprocess.Popen) -> None:
    # torchrun puts each rank in a session of its own: kill_tree finds and kills every descendant
    kill_tree(proc.pid)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def capture(args: argparse.Namespace) -> int:
    script = os.path.join(HERE, "hangs", args.scenario + ".py")
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="hangdoc-capture-")
    console = os.path.join(out, "console.log")
    job_env = dict(kv.split("=", 1) for kv in args.env)
    proc, log, cmd = start_job(script, args.nproc, console, job_env, os.path.join(tmp, "logs"))
    commands: List[str] = ["job: " + " ".join(args.env + [""]) + " ".join(os.path.relpath(c) if c == script else c for c in cmd)]
    try:
        if not wait_for_hang(console, args.nproc, proc, args.start_timeout):
            print(f"{args.scenario}: never reached its hang point; see {console}", file=sys.stderr)
            return 1
        time.sleep(args.settle)
        launcher = proc.pid
        ranks = children(launcher)
        info: Dict[int, dict] = {}
        for pid in ranks:
            env = environ_of(pid)
            info[pid] = {"rank": int(env.get("RANK", -1)), "role": "rank", "ppid": launcher}
        per_node = max(1, -(-len(ranks) // args.nodes))
        node_of: Dict[int, str] = {}
        for pid in ranks:
            node_of[pid] = f"node{info[pid]['rank'] // per_node + 1}"
        workers: Dict[int, List[int]] = {pid: children(pid) for pid in ranks}
        for pid, kids in workers.items():
            for k in kids:
                info[k] = {"rank": None, "role": "dataloader-worker", "ppid": pid, "parent_rank": info[pid]["rank"]}
                node_of[k] = node_of[pid]
        nodes = sorted(set(node_of[p] for p in ranks))

        def write(kind: str, node: str, text: str) -> None:
            d = os.path.join(out, kind)
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, f"trace-{node}.out"), "a") as f:
                f.write(text)

        dumpers = {
            "plain": ["py-spy", "dump", "--pid"],
            "full": ["py-spy", "dump", "--full-filenames", "--pid"],
            "native": ["py-spy", "dump", "--native", "--pid"],
            "locals": ["py-spy", "dump", "--locals", "--pid"],
            "json": ["py-spy", "dump", "--json", "--pid"],
            "with-workers": ["py-spy", "dump", "--subprocesses", "--pid"],
            "pystack": ["pystack", "remote", "--native", "--no-color"],
            "gdb": None,
        }
        for kind, base in dumpers.items():
            if kind in args.skip:
                continue
            for node in nodes:
                for pid in ranks:
                    if node_of[pid] != node:
                        continue
                    if base is None:
                        c = ["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt"]
                    else:
                        c = base + [str(pid)]
                    write(kind, node, run_dumper(c, args.dump_timeout))
            commands.append(f"{kind}: " + " ".join(c[:-1] if base is not None else ["gdb", "-p", "PID", "-batch", "-ex", "'thread apply all bt'"]) + (" PID" if base is not None else ""))
        if "launcher" not in args.skip:
            write("launcher", nodes[0], run_dumper(["py-spy", "dump", "--pid", str(launcher)], args.dump_timeout))
            commands.append("launcher: py-spy dump --pid LAUNCHER")
        # faulthandler last: the signal handler writes while the job keeps hanging
        if "faulthandler" not in args.skip:
            for pid in sorted(info):
                try:
                    os.kill(pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
            time.sleep(2)
            fdir = os.path.join(out, "faulthandler")
            os.makedirs(fdir, exist_ok=True)
            for root, _dirs, files in os.walk(os.path.join(tmp, "logs")):
                if "stderr.log" in files:
                    local_rank = int(os.path.basename(root))
                    # one node here, so the local rank is the global rank
                    shutil.copyfile(os.path.join(root, "stderr.log"), os.path.join(fdir, f"stderr-rank{local_rank}.log"))
            commands.append("faulthandler: kill -USR1 PID (rank and workers); the rank's stderr.log of torchrun --log-dir")
        truth = {f"{node_of[p]}:{p}": info[p] for p in sorted(info)}
        truth[f"{nodes[0]}:{launcher}"] = {"rank": None, "role": "launcher", "ppid": None}
        with open(os.path.join(out, "truth.json"), "w") as f:
            json.dump(truth, f, indent=1, sort_keys=True)
            f.write("\n")
    finally:
        kill_job(proc)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)

    if args.traceback:
        tdir = os.path.join(out, "traceback")
        os.makedirs(tdir, exist_ok=True)
        tlog = os.path.join(tdir, "console.log")
        env = {**job_env, "HANG_TIMEOUT": str(args.traceback_timeout), "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[rank${rank}]:"}
        proc, log, cmd = start_job(script, args.nproc, tlog, env, None)
        seen: set = set()
        try:
            deadline = time.monotonic() + args.traceback_timeout + 90
            while proc.poll() is None and time.monotonic() < deadline:
                seen.update(descendants(proc.pid))
                time.sleep(0.5)
        finally:
            kill_job(proc)
            for pid in seen:  # ranks left behind by a launcher that already exited
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        mine = script.encode() in f.read()  # not a recycled pid of someone else
                    if mine:
                        os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            log.close()
        commands.append(f"traceback: HANG_TIMEOUT={args.traceback_timeout} "
                        "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE='[rank${rank}]:' python -m torch.distributed.run "
                        f"--nproc-per-node {args.nproc} --tee 3 examples/hangs/{args.scenario}.py")
    write_readme(out, args, commands)
    return 0


def observed(out: str) -> List[str]:
    """One line per process of ``plain/``: what its main thread was doing (a quick look, not the reader)."""
    try:
        with open(os.path.join(out, "truth.json")) as f:
            truth = json.load(f)
    except OSError:
        truth = {}
    rows = []
    d = os.path.join(out, "plain")
    for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
        node = name[len("trace-"):-len(".out")]
        pid, want = None, False
        with open(os.path.join(d, name), errors="replace") as f:
            for line in f:
                if line.startswith("Process "):
                    pid = line.split()[1].rstrip(":")
                elif line.startswith("Thread ") and '"MainThread"' in line:
                    want = True
                elif want and line.startswith("    "):
                    rank = (truth.get(f"{node}:{pid}") or {}).get("rank")
                    rows.append(f"- {node} pid {pid} (rank {rank}): `{line.strip()}`")
                    want = False
                elif line.startswith("Error:"):
                    rows.append(f"- {node} pid {pid}: py-spy failed: `{line.strip()}`")
    return rows


def write_readme(out: str, args: argparse.Namespace, commands: List[str]) -> None:
    with open(os.path.join(HERE, "hangs", args.scenario + ".py")) as f:
        src = f.read()
    docstring = src.split('"""')[1].strip() if src.startswith('"""') else ""
    lines = [
        f"# {args.scenario}: captured dumps",
        "",
        f"Captured by `python examples/capture_dumps.py {args.scenario} --nproc {args.nproc} --nodes {args.nodes}"
        + "".join(f" --env {kv}" for kv in args.env) + f" --out {os.path.relpath(out, os.path.dirname(HERE))}"
        + (" --traceback" if args.traceback else "") + "` on one machine (CPU, gloo); "
        f"the ranks are split into {args.nodes} pretend node(s), one file per node and dump kind, "
        "processes back to back, stdout+stderr of the dumper together, as "
        "`srun --output=trace-%N.out sh -c 'pgrep -P $(pgrep -o python) | xargs -I {} py-spy dump --pid {}'` writes them.",
        "Nothing was edited by hand. `truth.json` says which pid was which rank/role on which node.",
        "",
        "## The program (`examples/hangs/%s.py`)" % args.scenario,
        "",
        docstring,
        "",
        "## Commands, per subdirectory",
        "",
    ]
    lines += [f"- `{c}`" for c in commands]
    lines += ["", "## What the dumps show (innermost frame of each MainThread in plain/, for orientation)", ""]
    lines += observed(out)
    lines.append("")
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write("\n".join(lines))


def capture_pythons(out: str, pythons: List[str], timeout: float = 30.0) -> int:
    """``lock_cycle.py`` (no torch) under each Python: ``py-spy dump --full-filenames`` and the
    faulthandler output of each, one file per Python (``trace-py3.12.out``: host ``py3.12``)."""
    script = os.path.join(HERE, "hangs", "lock_cycle.py")
    os.makedirs(out, exist_ok=True)
    made = []
    for py in pythons:
        version = subprocess.run([py, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                                 stdout=subprocess.PIPE, text=True, timeout=timeout).stdout.strip()
        err_path = os.path.join(out, f"faulthandler-py{version}.log")
        with open(err_path, "wb") as err:
            proc = subprocess.Popen([py, script], stdout=subprocess.PIPE, stderr=err, start_new_session=True)
            try:
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline:
                    line = proc.stdout.readline()
                    if not line or line.startswith(b"HANG-POINT"):
                        break
                time.sleep(0.5)
                text = run_dumper(["py-spy", "dump", "--full-filenames", "--pid", str(proc.pid)], timeout)
                with open(os.path.join(out, f"trace-py{version}.out"), "w") as f:
                    f.write(text)
                os.kill(proc.pid, signal.SIGUSR1)
                time.sleep(1)
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=10)
        made.append(f"{version}: {py}")
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write("# pythons: one hang under several Python versions\n\n"
                "Captured by `python examples/capture_dumps.py --pythons PYTHON...` (nothing edited by hand):\n"
                "`examples/hangs/lock_cycle.py` (a lock-order deadlock between two threads, no torch) run under\n"
                + "".join(f"- Python {m}\n" for m in made)
                + "\n`trace-pyX.Y.out`: `py-spy dump --full-filenames --pid PID`; `faulthandler-pyX.Y.log`: its\n"
                "stderr after `kill -USR1 PID` (faulthandler registered on SIGUSR1).\n")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "--pythons":
        out = os.path.join(os.path.dirname(HERE), "tests", "fixtures", "dumps", "pythons")
        if os.path.isdir(out):
            shutil.rmtree(out)
        return capture_pythons(out, argv[1:] or [sys.executable])
    p.add_argument("scenario", help="name of a script in examples/hangs/ (without .py)")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--nodes", type=int, default=2, help="pretend nodes to split the ranks into")
    p.add_argument("--out", default=None, help="default: tests/fixtures/dumps/SCENARIO")
    p.add_argument("--settle", type=float, default=3.0, help="seconds to wait after the hang point")
    p.add_argument("--start-timeout", type=float, default=120.0)
    p.add_argument("--dump-timeout", type=float, default=30.0)
    p.add_argument("--skip", nargs="*", default=[], help="dump kinds to leave out")
    p.add_argument("--traceback", action="store_true", help="also a run that dies of the gloo timeout")
    p.add_argument("--traceback-timeout", type=float, default=10.0)
    p.add_argument("--env", action="append", default=[], metavar="K=V", help="extra environment of the job")
    args = p.parse_args(argv)
    if args.out is None:
        args.out = os.path.join(os.path.dirname(HERE), "tests", "fixtures", "dumps", args.scenario)
    if os.path.isdir(args.out):
        shutil.rmtree(args.out)
    return capture(args)


if __name__ == "__main__":
    sys.exit(main())
