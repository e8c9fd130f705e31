"""Run every bug scenario (``examples/bugs/``) through hangdoc and its peers; print one table.

    nice python benchmarks/bug_matrix.py                       # all scenarios, all columns
    python benchmarks/bug_matrix.py --only skip_broadcast,lock_twice --columns injob,aggregate

Five runs of each scenario under ``torchrun`` (gloo, CPU), each with hard time limits and the
whole process tree killed at its end (``hangdoc.cli.demo.stop_job``):

* **hangdoc**: ``torchrun -m hangdoc --record --hang-timeout 8 --out OUT script``. Columns ``injob``
  (the watchdog's ``OUT/report.json``; for a job that only is slow, as it stands when the job has
  ended) and ``aggregate`` (``hangdoc aggregate OUT --format json`` after the job is stopped).
* **detect**: ``torchrun -m hangdoc --detect --out OUT script``; column ``detect`` is
  ``OUT/divergence.json`` (the detector's deviants), waited for up to 8 s after the hang point (one
  written while the job was being stopped is kept as ``divergence-at-teardown.json``, not graded);
  for a job that only is slow, as it stands when the job has ended (a stall the detector reported
  and withdrew when the rank went on carries ``resumed_after``: no verdict).
* **plain**: the script alone; once every rank printed ``HANG-POINT`` (or the job died) and 3 s
  passed, ``py-spy dump --subprocesses --pid RANK`` of every rank, then ``hangdoc aggregate
  --rank-map`` of those dumps (the pid -> rank map read from each rank's ``RANK`` variable).
  Column ``pyspy``.
* **DETAIL**: ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` with the gloo timeout set to 8 s (the same
  threshold as hangdoc's watchdog): the job's own output, parsed for the errors that name ranks.
  Column ``detail``.
* **Flight Recorder**: ``TORCH_FR_BUFFER_SIZE=20000`` and ``benchmarks/fr_dump_wrapper.py`` (a
  dump on demand: gloo has no dump on timeout); dumped when hung as in the plain run, then
  ``python -m torch.distributed.flight_recorder.fr_trace DIR -p fr_trace_rank_``. Column ``fr``; column ``frhd`` is ``hangdoc aggregate`` of the same dumps.
* **torch's debug server**: ``benchmarks/dbgsrv_wrapper.py`` starts
  ``torch.distributed.debug.start_debug_server`` in every rank (``TORCH_FR_BUFFER_SIZE=20000``);
  once hung (as in the plain run), the frontend's pages a user opens (``/``, ``/stacks``,
  ``/fr_trace``, ``/fr_trace_json``, ``/pyspy_dump``, ...) are fetched with urllib into
  ``dbgsrv/`` (column ``dbgsrv``: what those pages say, ``matrix_judge.from_debug_server``),
  then ``hangdoc dump --debug-server`` fetches from the same frontend and ``hangdoc aggregate``
  reads that (column ``dbgsrvhd``). Needs the frontend's ``jinja2``, ``tabulate`` and
  ``requests`` (or ``aiohttp``).
* **nvidia-resiliency-ext**: its ``ft_launcher`` (``--nvrx-python PY`` or ``$NVRX_PYTHON``: an
  interpreter with ``nvidia_resiliency_ext`` installed; default this one) runs the scenario
  under ``benchmarks/nvrx_wrapper.py`` (heartbeats at ``init()`` and every ``progress()``), with
  the heartbeat timeout 8 s (``HANG_TIMEOUT``) and the initial one 120 s; its output is parsed for
  the ranks its rank monitors time out (``matrix_judge.from_nvrx_log``). Column ``nvrx``.
  Column ``nvrxip``: its in-process restart, ``inprocess.Wrapper`` around the scenario
  (``benchmarks/nvrx_inprocess_wrapper.py``: progress timeout 8 s, automatic progress stamps, one
  restart at most) under torchrun with the same interpreter; the first ``Interruption.X on
  ranks={...}`` it reports (``matrix_judge.from_nvrx_inprocess_log``).

The last two are optional: when their packages are missing they are left out of the default
columns, and asked for with ``--columns`` they are skipped with a message saying why.

With ``--backend nccl`` (one GPU a rank: ``BUG_BACKEND=nccl``, see ``examples/bugs/_common.py``) the
plain run is also NCCL's own evidence, with no separate Flight Recorder run: it runs under
``fr_dump_wrapper.py``, which dumps NCCL's Flight Recorder right after the py-spy dumps (column
``fr``: ``fr_trace`` on those dumps; NCCL's dump on timeout never comes where every rank has gone
on to ``destroy_process_group``), and its NCCL timeout is ``NCCL_TIMEOUT`` s, so the console log
gets the watchdog's lines where the watchdog fires (column ``log``: ``hangdoc aggregate`` of that
log alone). A scenario of more
ranks than GPUs (``--gpus``) is not run.

Each cell is judged by ``benchmarks/matrix_judge.py`` against the scenario's ``TRUTH`` (headline
finding only). Everything, with every cell's raw verdict, is written under ``--out`` (default
``benchmarks/results/<date>-bug-matrix``): ``matrix.json``, ``table.md`` and one directory per
scenario with the logs, dumps and reports.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from hangdoc.cli.demo import stop_job  # noqa: E402
from hangdoc.proctree import free_port, parent_map  # noqa: E402

import matrix_judge  # noqa: E402

BUGS = os.path.join(ROOT, "examples", "bugs")
COLUMNS = ("injob", "aggregate", "detect", "pyspy", "log", "detail", "fr", "frhd")
#: peers that need packages torch does not bring: in the default columns only where importable
OPTIONAL_COLUMNS = ("dbgsrv", "dbgsrvhd", "nvrx", "nvrxip")
#: which run feeds which columns
COLUMNS_OF_RUN = {"hangdoc": ("injob", "aggregate"), "detect": ("detect",), "plain": ("pyspy",),
        "detail": ("detail",), "fr": ("fr", "frhd"), "dbgsrv": ("dbgsrv", "dbgsrvhd"), "nvrx": ("nvrx",), "nvrxip": ("nvrxip",)}
#: on NCCL the plain run's own timeout makes the Flight Recorder dumps (no wrapper run)
COLUMNS_OF_RUN_NCCL = {"hangdoc": ("injob", "aggregate"), "detect": ("detect",), "plain": ("pyspy", "log", "fr", "frhd"),
        "detail": ("detail",), "dbgsrv": ("dbgsrv", "dbgsrvhd"), "nvrx": ("nvrx",), "nvrxip": ("nvrxip",)}
HANG_TIMEOUT = 8
#: the NCCL timeout of the plain run on NCCL: after the py-spy dumps, long enough for none to be early
NCCL_TIMEOUT = 20
#: gloo or nccl (``--backend``); every job gets ``BUG_BACKEND``
BACKEND = "gloo"
#: never NVLink multicast on a shared GPU host (it can take the host's GPUs out of service)
NCCL_SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
#: seconds for a job to reach its hang point (torch import and rendezvous on 2 shared cores)
START_LIMIT = 120.0
#: seconds after the hang point before dumps are taken (the last ranks get into their waits)
SETTLE = 3.0
TOOL_LIMIT = 180.0
#: the interpreter whose ``nvidia_resiliency_ext`` runs column nvrx (``--nvrx-python``, ``$NVRX_PYTHON``)
NVRX_PYTHON = os.environ.get("NVRX_PYTHON") or sys.executable
#: nvrx's initial heartbeat timeout: torch's import and the rendezvous on 2 shared cores come first
NVRX_INITIAL_TIMEOUT = 120
#: seconds for one debug-server page (its frontend waits DBGSRV_FETCH_TIMEOUT for a silent worker)
DBGSRV_PAGE_LIMIT = 40.0
DBGSRV_FETCH_TIMEOUT = 10
PYSPY = shutil.which("py-spy", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")) or "py-spy"

_live: List[subprocess.Popen] = []
_live_lock = threading.Lock()
#: set on SIGTERM/SIGINT: no new job starts and every wait ends
_stopping = threading.Event()


# --- scenarios --------------------------------------------------------------------------------------

def scenarios(only: Optional[List[str]] = None) -> List[Dict[str, Any]]:
    """Every ``examples/bugs/*.py`` (not ``_*``) with its docstring, ``TRUTH`` and ``RUNS``, read
    with ``ast`` (no torch import)."""
    found = []
    for path in sorted(glob.glob(os.path.join(BUGS, "*.py"))):
        name = os.path.basename(path)[:-3]
        if name.startswith("_") or (only and name not in only):
            continue
        found.append(read_scenario(path))
    if only:
        missing = set(only) - set(s["name"] for s in found)
        if missing:
            raise SystemExit(f"bug_matrix: no scenario {', '.join(sorted(missing))} in {BUGS}")
    return found


def read_scenario(path: str) -> Dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    values: Dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("TRUTH", "RUNS"):
                values[node.targets[0].id] = ast.literal_eval(node.value)
    return {"name": os.path.basename(path)[:-3], "path": path, "doc": ast.get_docstring(tree),
            "truth": values.get("TRUTH"), "runs": values.get("RUNS") or [{}]}


# --- jobs -----------------------------------------------------------------------------------------

class Job:
    """One torchrun job, its output in ``log``; stopped whole by :meth:`stop`."""

    def __init__(self, args: List[str], nproc: int, env: Dict[str, str], log: str,
                 launcher: Optional[List[str]] = None) -> None:
        """``launcher``: another torchrun-like launcher (nvidia-resiliency-ext's ``ft_launcher``),
        given its rendezvous endpoint explicitly (c10d) instead of torchrun's master address."""
        if _stopping.is_set():
            raise RuntimeError("stopping: no new job")
        self.log, self.started = log, time.monotonic()
        if launcher:
            cmd = launcher + ["--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
                              "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--monitor-interval", "0.5"] + args
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                   "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--monitor-interval", "0.5"] + args
        #: every process of this job carries it, forked ones too (DataLoader workers, the debug
        #: server's frontend): what a rank left behind when it was killed is found by it at stop()
        self.marker = f"{os.getpid()}-{id(self)}-{time.monotonic_ns()}"
        full_env = dict(os.environ, BUG_BACKEND=BACKEND, BUG_MATRIX_JOB=self.marker, **env)
        if BACKEND == "nccl":
            full_env.update(NCCL_SAFE_ENV)
        full_env["PYTHONPATH"] = ROOT + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
        full_env.setdefault("OMP_NUM_THREADS", "1")
        full_env["PYTHONUNBUFFERED"] = "1"
        with open(log, "ab") as out:
            out.write(("$ " + " ".join(cmd) + "\n").encode())
            #: where this job's output starts in a log that earlier jobs of the scenario wrote to (two_jobs)
            self.offset = out.tell()
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=full_env, cwd=ROOT, start_new_session=True)
        with _live_lock:
            _live.append(self.proc)
        if _stopping.is_set():  # stopped while it started: main's cleanup may have missed it
            self.stop()
            raise RuntimeError("stopping: job stopped at its start")

    def text(self) -> str:
        """This job's output so far (not the earlier jobs' in the same log)."""
        with open(self.log, "rb") as f:
            f.seek(self.offset)
            return f.read().decode("utf-8", "replace")

    def exited(self) -> bool:
        return self.proc.poll() is not None

    def wait_for(self, done: Callable[[], bool], limit: float) -> bool:
        """Until ``done()`` (True), the job's exit or ``limit`` seconds from now (False)."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline and not _stopping.is_set():
            if done():
                return True
            if self.exited():
                return done()
            time.sleep(0.25)
        return done()

    def wait_hung(self, world: int) -> str:
        """Until every rank printed HANG-POINT (then SETTLE s more) or the job ended."""
        hung = self.wait_for(lambda: self.text().count("HANG-POINT rank=") >= world, START_LIMIT)
        if hung:
            self.wait_for(lambda: False, SETTLE)
        return "hung" if hung and not self.exited() else ("exited" if self.exited() else "no hang point")

    def ranks(self) -> Dict[int, int]:
        """{pid: rank} of the launcher's children."""
        found = {}
        for pid in sorted(parent_map().get(self.proc.pid, [])):
            rank = _environ(pid).get("RANK")
            if rank is not None and rank.isdigit():
                found[pid] = int(rank)
        return found

    def stop(self) -> None:
        stop_job(self.proc)
        # orphans: a rank killed mid-job (nvidia-resiliency-ext's rank monitor, gloo's abort) leaves
        # its forked children re-parented to init, out of stop_job's reach
        for pid in _marked(self.marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        with _live_lock:
            if self.proc in _live:
                _live.remove(self.proc)


def _marked(marker: str) -> List[int]:
    """Pids whose environment has ``BUG_MATRIX_JOB=marker``."""
    needle = b"\0BUG_MATRIX_JOB=" + marker.encode() + b"\0"
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                raw = b"\0" + f.read(1 << 20) + b"\0"
        except OSError:
            continue
        if needle in raw:
            found.append(int(name))
    return found


def _environ(pid: int) -> Dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read(1 << 20)
    except OSError:
        return {}
    return dict(item.decode("utf-8", "replace").split("=", 1) for item in raw.split(b"\0") if b"=" in item)


def tool(cmd: List[str], limit: float = TOOL_LIMIT, env: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """Run an offline tool with a time limit: {"rc", "stdout", "stderr", "seconds"}."""
    t0 = time.monotonic()
    full_env = dict(os.environ, PYTHONPATH=ROOT, **(env or {}))
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                           timeout=limit, env=full_env, cwd=ROOT, start_new_session=True)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = 124, e.stdout or b"", (e.stderr or b"") + f"\n(timed out after {limit:.0f}s)".encode()
    return {"rc": rc, "stdout": out.decode("utf-8", "replace"), "stderr": err.decode("utf-8", "replace"),
            "seconds": round(time.monotonic() - t0, 2)}


def hangdoc_report(cmd: List[str], save: str) -> None:
    """``hangdoc aggregate ... --format json`` into ``save`` (stderr and exit status beside it)."""
    r = tool([sys.executable, "-m", "hangdoc", "aggregate", "--format", "json"] + cmd)
    with open(save, "w") as f:
        f.write(r["stdout"])
    with open(save + ".stderr", "w") as f:
        f.write("$ hangdoc aggregate --format json " + " ".join(cmd) + "\n" + r["stderr"])
    with open(save + ".rc", "w") as f:
        f.write(f"{r['rc']}\n")


def report_verdict(save: str) -> Optional[Dict[str, Any]]:
    """The headline of a saved ``hangdoc aggregate`` run; a traceback is a crash, a clean error
    (``nothing readable in ...``) is no verdict."""
    if not os.path.exists(save):
        return None
    with open(save, encoding="utf-8", errors="replace") as f:
        out = f.read()
    with open(save + ".stderr", encoding="utf-8", errors="replace") as f:
        err = f.read()
    last = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("$ ")]
    if "Traceback (most recent call last)" in err:
        return {"crash": (last[-1] if last else "traceback")[:300]}
    if not out.strip():
        return {"kind": None, "error": (last[-1] if last else "no output")[:300]}
    try:
        return matrix_judge.from_report(json.loads(out)) or {"kind": None, "error": "no findings"}
    except ValueError as e:
        return {"crash": f"not JSON: {e}"}


# --- the five runs --------------------------------------------------------------------------------

def run_hangdoc(s: Dict[str, Any], d: str, columns: List[str]) -> Dict[str, Any]:
    out = os.path.join(d, "hangdoc-out")
    log = os.path.join(d, "hangdoc.log")
    world = s["truth"]["world"]
    slow = s["truth"]["kind"] == "slow-not-hung"
    for env in s["runs"]:
        job = Job(["-m", "hangdoc", "--record", "--hang-timeout", str(HANG_TIMEOUT), "--out", out, s["path"]],
                  world, env, log)
        report = os.path.join(out, "report.json")
        try:
            if os.path.exists(report):  # the previous run's (two_jobs): this run's is a new file
                os.replace(report, os.path.join(out, f"report-before-{int(time.time())}.json"))
            state = job.wait_hung(world)
            job.wait_for(lambda: os.path.exists(report), HANG_TIMEOUT + 40)
            if slow:  # a retraction comes when the job resumes: wait for its end
                job.wait_for(lambda: False, 90)
            else:
                job.wait_for(lambda: False, 2)
        finally:
            job.stop()
    if "aggregate" in columns:
        hangdoc_report([out], os.path.join(d, "aggregate.json"))
    return {"state": state}


def run_detect(s: Dict[str, Any], d: str, columns: List[str]) -> Dict[str, Any]:
    out = os.path.join(d, "detect-out")
    world = s["truth"]["world"]
    found = os.path.join(out, "divergence.json")
    for env in s["runs"]:
        job = Job(["-m", "hangdoc", "--detect", "--out", out, s["path"]], world, env, os.path.join(d, "detect.log"))
        before_stop = False
        try:
            if os.path.exists(found):  # the previous run's (two_jobs)
                os.replace(found, os.path.join(out, f"divergence-before-{int(time.time())}.json"))
            state = job.wait_hung(world)
            # the detector publishes at once when a rank goes quiet and compares within a second or two
            job.wait_for(lambda: os.path.exists(found), HANG_TIMEOUT)
            if s["truth"]["kind"] == "slow-not-hung":  # a stall it reported is withdrawn when the job
                job.wait_for(job.exited, START_LIMIT)  # resumes: judged as it stands at the job's end
            before_stop = os.path.exists(found)
        finally:
            job.stop()
        if not before_stop and os.path.exists(found):
            # written while the job was being stopped (what the teardown broke): kept, not graded
            os.replace(found, os.path.join(out, "divergence-at-teardown.json"))
    return {"state": state}


def _json_verdict(path: str, parse: Callable[[Dict[str, Any]], Optional[Dict[str, Any]]]) -> Optional[Dict[str, Any]]:
    try:
        with open(path, encoding="utf-8") as f:
            return parse(json.load(f))
    except FileNotFoundError:
        return None
    except ValueError as e:
        return {"crash": f"{os.path.basename(path)}: not JSON: {e}"}


def _nccl_fr_env(fr: str) -> Dict[str, str]:
    """NCCL's own timeout, with Flight Recorder dumping on it into ``fr`` (the names of torch 2.1 to 2.13)."""
    prefix = os.path.join(fr, "nccl_trace_rank_")
    return {"HANG_TIMEOUT": str(NCCL_TIMEOUT), "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_FR_BUFFER_SIZE": "2000",
            "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_FR_DUMP_TEMP_FILE": prefix,
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix}


def run_fr_trace(d: str, fr: str, prefix: str, world: int) -> int:
    """``fr_trace`` on the dumps in ``fr`` into ``d/fr_trace.txt``, and hangdoc on the same dumps into
    ``d/fr-aggregate.json`` (column ``frhd``); the number of dumps."""
    found = len(glob.glob(os.path.join(fr, prefix + "*")))
    if not found:
        return 0
    hangdoc_report([fr], os.path.join(d, "fr-aggregate.json"))
    cmd = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", fr, "-p", prefix]
    if found < world:  # fr_trace refuses a directory without every rank's dump unless told
        cmd.append("--allow-incomplete-ranks")
    r = tool(cmd)
    with open(os.path.join(d, "fr_trace.txt"), "w") as f:
        f.write("$ " + " ".join(cmd) + "\n" + r["stdout"] + r["stderr"] + f"\n(exit status {r['rc']})\n")
    return found


def run_plain(s: Dict[str, Any], d: str, columns: List[str]) -> Dict[str, Any]:
    dumps = os.path.join(d, "pyspy")
    os.makedirs(dumps, exist_ok=True)
    rank_map = os.path.join(d, "pyspy-rank-map.txt")
    world = s["truth"]["world"]
    fr = os.path.join(d, "fr")
    nccl = BACKEND == "nccl"
    for i, env in enumerate(s["runs"]):
        args = [s["path"]]
        if nccl:
            shutil.rmtree(fr, ignore_errors=True)  # fr_trace reads a directory of one job's dumps
            os.makedirs(fr)
            trigger = os.path.join(d, f"fr-dump-now-{i}")
            env = dict(env, FR_DUMP_DIR=fr, FR_DUMP_TRIGGER=trigger, **_nccl_fr_env(fr))
            args = [os.path.join(HERE, "fr_dump_wrapper.py"), s["path"]]
        job = Job(args, world, env, os.path.join(d, "plain.log"))
        try:
            state = job.wait_hung(world)
            ranks = job.ranks()
            for pid, rank in sorted(ranks.items(), key=lambda x: x[1]):
                r = tool([PYSPY, "dump", "--subprocesses", "--pid", str(pid)], limit=30)
                with open(os.path.join(dumps, f"trace-run{i}-rank{rank}.out"), "w") as f:
                    f.write(r["stdout"] + r["stderr"])
                with open(rank_map, "a") as f:
                    f.write(f"{pid} {rank}\n")
            if nccl:  # Flight Recorder now, then NCCL's watchdog: its timeout lines where it fires
                open(trigger, "w").close()
                job.wait_for(lambda: len(glob.glob(os.path.join(fr, "fr_trace_rank_*"))) >= len(ranks), 20)
                job.wait_for(job.exited, NCCL_TIMEOUT + 10)
        finally:
            job.stop()
    if os.path.exists(rank_map):
        hangdoc_report(["--rank-map", rank_map, dumps], os.path.join(d, "pyspy-aggregate.json"))
    if "log" in columns:
        hangdoc_report([os.path.join(d, "plain.log")], os.path.join(d, "log-aggregate.json"))
    got: Dict[str, Any] = {"state": state}
    if nccl:
        got["fr_dumps"] = run_fr_trace(d, fr, "fr_trace_rank_", world)
    return got


def run_detail(s: Dict[str, Any], d: str, columns: List[str]) -> Dict[str, Any]:
    log = os.path.join(d, "detail.log")
    for env in s["runs"]:
        if os.path.exists(log):  # only the last job's output is judged
            os.replace(log, log + ".before")
        job = Job([s["path"]], s["truth"]["world"],
                  dict(env, TORCH_DISTRIBUTED_DEBUG="DETAIL", HANG_TIMEOUT=str(HANG_TIMEOUT)), log)
        try:
            # the ranks' timeouts end the job; torchrun's own shutdown takes a few seconds more
            ended = job.wait_for(job.exited, START_LIMIT + HANG_TIMEOUT * 4)
        finally:
            job.stop()
    return {"state": "exited" if ended else "still running (stopped)"}


def run_fr(s: Dict[str, Any], d: str, columns: List[str]) -> Dict[str, Any]:
    fr = os.path.join(d, "fr")
    world = s["truth"]["world"]
    for i, env in enumerate(s["runs"]):
        shutil.rmtree(fr, ignore_errors=True)  # fr_trace reads a directory of one job's dumps
        os.makedirs(fr)
        trigger = os.path.join(d, f"fr-dump-now-{i}")
        job = Job([os.path.join(HERE, "fr_dump_wrapper.py"), s["path"]], world,
                  dict(env, TORCH_FR_BUFFER_SIZE="20000", FR_DUMP_DIR=fr, FR_DUMP_TRIGGER=trigger),
                  os.path.join(d, "fr.log"))
        try:
            state = job.wait_hung(world)
            alive = len(job.ranks())
            open(trigger, "w").close()
            job.wait_for(lambda: len(glob.glob(os.path.join(fr, "fr_trace_rank_*"))) >= alive, 20)
        finally:
            job.stop()
    return {"state": state, "fr_dumps": run_fr_trace(d, fr, "fr_trace_rank_", world)}


def fetch_debug_server_pages(port: int, save: str) -> Dict[str, Dict[str, Any]]:
    """Every page of the frontend a user opens (``matrix_judge.DEBUG_SERVER_PAGES``, and the NCCL
    Flight Recorder analysis on NCCL), by plain urllib as a browser would; each saved under ``save``
    with ``pages.json`` ({path: status, file, error}) beside them."""
    os.makedirs(save, exist_ok=True)
    paths = list(matrix_judge.DEBUG_SERVER_PAGES) + (["/fr_trace_nccl", "/fr_trace_nccl_json"] if BACKEND == "nccl" else [])
    pages: Dict[str, Dict[str, Any]] = {}
    index: Dict[str, Dict[str, Any]] = {}
    silent = 0  # pages in a row the frontend did not answer: after two, the rest are not asked
    for path in paths:
        name = (path.strip("/") or "index") + ".html"
        status, text, error = 0, "", None
        t0 = time.monotonic()
        if silent >= 2:
            error = f"not asked: the frontend answered none of the last {silent} pages"
        else:
            status, text, error = _get_page(f"http://127.0.0.1:{port}{path}")
            silent = silent + 1 if error else 0
        with open(os.path.join(save, name), "w") as f:
            f.write(text)
        pages[path] = {"status": status, "text": text, "error": error}
        index[path] = {"status": status, "file": name, "error": error, "seconds": round(time.monotonic() - t0, 2)}
    with open(os.path.join(save, "pages.json"), "w") as f:
        json.dump(index, f, indent=1)
    return pages


def _get_page(url: str) -> Any:
    """(HTTP status, text, error) of one page; an HTTP error's page is its text (the frontend's
    500 page when a handler raised); status 0 and the error when there was no answer."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=DBGSRV_PAGE_LIMIT) as r:
            return r.status, r.read(64 << 20).decode("utf-8", "replace"), None
    except urllib.error.HTTPError as e:
        return e.code, e.read(1 << 20).decode("utf-8", "replace"), None
    except (OSError, ValueError) as e:
        return 0, "", f"{type(e).__name__}: {e}"


def run_dbgsrv(s: Dict[str, Any], d: str, columns: List[str]) -> Dict[str, Any]:
    """torch's debug server in every rank; once hung, its pages (``dbgsrv/``) and ``hangdoc dump
    --debug-server`` of the same frontend (``dbgsrv-fetched/``, read by ``hangdoc aggregate``)."""
    world = s["truth"]["world"]
    pages_dir, fetched = os.path.join(d, "dbgsrv"), os.path.join(d, "dbgsrv-fetched")
    got: Dict[str, Any] = {}
    for env in s["runs"]:
        for old in (pages_dir, fetched):  # only the last job's pages are judged (two_jobs)
            shutil.rmtree(old, ignore_errors=True)
        port = free_port()
        job = Job([os.path.join(HERE, "dbgsrv_wrapper.py"), s["path"]], world,
                  dict(env, DBGSRV_PORT=str(port), DBGSRV_FETCH_TIMEOUT=str(DBGSRV_FETCH_TIMEOUT),
                       TORCH_FR_BUFFER_SIZE="20000"), os.path.join(d, "dbgsrv.log"))
        try:
            state = job.wait_hung(world)
            got = {"state": state}
            if job.exited():  # the frontend (in rank 0) is gone with the job: nothing to open
                continue
            fetch_debug_server_pages(port, pages_dir)
            if "dbgsrvhd" in columns:
                r = tool([sys.executable, "-m", "hangdoc", "dump", "--debug-server", f"127.0.0.1:{port}",
                          "--timeout", str(int(DBGSRV_PAGE_LIMIT)), "-o", fetched], limit=DBGSRV_PAGE_LIMIT * 3)
                with open(os.path.join(d, "dbgsrv-dump.txt"), "w") as f:
                    f.write(r["stdout"] + r["stderr"] + f"\n(exit status {r['rc']})\n")
        finally:
            job.stop()
    if "dbgsrvhd" in columns and os.path.isdir(fetched):
        hangdoc_report([fetched], os.path.join(d, "dbgsrv-aggregate.json"))
    return got


def run_nvrx(s: Dict[str, Any], d: str, columns: List[str]) -> Dict[str, Any]:
    """nvidia-resiliency-ext's ``ft_launcher`` with heartbeats (``nvrx_wrapper.py``) and the
    heartbeat timeout HANG_TIMEOUT; its rank monitors end a hung job themselves (no restarts)."""
    log = os.path.join(d, "nvrx.log")
    world = s["truth"]["world"]
    slow = s["truth"]["kind"] == "slow-not-hung"
    launcher = [NVRX_PYTHON, "-m", "nvidia_resiliency_ext.fault_tolerance.launcher",
                "--ft-initial-rank-heartbeat-timeout", str(NVRX_INITIAL_TIMEOUT),
                "--ft-rank-heartbeat-timeout", str(HANG_TIMEOUT), "--max-restarts", "0"]
    for env in s["runs"]:
        if os.path.exists(log):  # only the last job's output is judged
            os.replace(log, log + ".before")
        job = Job([os.path.join(HERE, "nvrx_wrapper.py"), s["path"]], world, env, log, launcher=launcher)
        try:
            state = job.wait_hung(world)
            # a monitor checks every 5 s (its default workload_check_interval), then the launcher
            # stops the other ranks (up to its 30 s workers-stop timeout); a slow job ends by itself
            ended = job.wait_for(job.exited, HANG_TIMEOUT + 5 + 45 + (90 if slow else 0))
        finally:
            job.stop()
    return {"state": state, "ended": ended}


def run_nvrxip(s: Dict[str, Any], d: str, columns: List[str]) -> Dict[str, Any]:
    """nvidia-resiliency-ext's ``inprocess.Wrapper`` around the scenario, under torchrun of the
    nvrx interpreter; it interrupts every rank once a rank's progress stamp is HANG_TIMEOUT s old."""
    log = os.path.join(d, "nvrxip.log")
    world = s["truth"]["world"]
    slow = s["truth"]["kind"] == "slow-not-hung"
    launcher_python = [NVRX_PYTHON, "-m", "torch.distributed.run"]
    for env in s["runs"]:
        if os.path.exists(log):  # only the last job's output is judged
            os.replace(log, log + ".before")
        job = Job([os.path.join(HERE, "nvrx_inprocess_wrapper.py"), s["path"]], world,
                  dict(env, NVRX_SOFT_TIMEOUT=str(HANG_TIMEOUT), NVRX_STORE_PORT=str(free_port())), log,
                  launcher=launcher_python)
        try:
            state = job.wait_hung(world)
            # soft timeout, 1 s for other ranks' reports, the restart (refused: one iteration)
            # and the termination barrier (60 s) at most; a slow job ends by itself
            ended = job.wait_for(job.exited, HANG_TIMEOUT * 3 + 70 + (90 if slow else 0))
        finally:
            job.stop()
    return {"state": state, "ended": ended}


def nvrx_missing(python: str) -> Optional[str]:
    """Why ``python`` cannot run column nvrx (None when it can)."""
    r = tool([python, "-c", "import nvidia_resiliency_ext.fault_tolerance.launcher, importlib.metadata as m; "
              "print(m.version('nvidia-resiliency-ext'))"], limit=180)
    if r["rc"] != 0:
        last = [ln for ln in (r["stderr"] or r["stdout"]).splitlines() if ln.strip()]
        return f"{python} cannot import nvidia_resiliency_ext ({last[-1][:200] if last else 'exit status ' + str(r['rc'])})"
    return None


def dbgsrv_missing() -> Optional[str]:
    """Why torch's debug server frontend cannot run here (None when it can)."""
    missing = [m for m in ("torch.distributed.debug", "jinja2", "tabulate") if _find_spec(m) is None]
    if _find_spec("requests") is None and _find_spec("aiohttp") is None:
        missing.append("requests (or aiohttp)")
    return f"torch's debug server needs {', '.join(missing)}" if missing else None


def _find_spec(name: str) -> Any:
    import importlib.util

    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None


#: columns whose verdict is one saved log parsed by the judge: (file in the scenario's directory, parser)
_LOG_VERDICTS = {"nvrx": ("nvrx.log", matrix_judge.from_nvrx_log),
                 "nvrxip": ("nvrxip.log", matrix_judge.from_nvrx_inprocess_log),
                 "detail": ("detail.log", matrix_judge.from_detail_log)}


def _text(path: str) -> Optional[str]:
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return f.read().decode("utf-8", "replace")


def verdict(d: str, column: str) -> Optional[Dict[str, Any]]:
    """One column's verdict, from the files its run left in the scenario's directory ``d``."""
    if column == "injob":
        return _json_verdict(os.path.join(d, "hangdoc-out", "report.json"), matrix_judge.from_report)
    if column == "detect":
        return _json_verdict(os.path.join(d, "detect-out", "divergence.json"), matrix_judge.from_divergence)
    if column == "aggregate":
        return report_verdict(os.path.join(d, "aggregate.json"))
    if column == "pyspy":
        return report_verdict(os.path.join(d, "pyspy-aggregate.json"))
    if column == "log":
        return report_verdict(os.path.join(d, "log-aggregate.json"))
    if column == "frhd":
        return report_verdict(os.path.join(d, "fr-aggregate.json"))
    if column == "dbgsrvhd":
        return report_verdict(os.path.join(d, "dbgsrv-aggregate.json"))
    if column in _LOG_VERDICTS:
        name, parse = _LOG_VERDICTS[column]
        text = _text(os.path.join(d, name))
        return None if text is None else parse(text)
    if column == "dbgsrv":
        index = os.path.join(d, "dbgsrv", "pages.json")
        if not os.path.exists(index):
            return None  # the job ended before it hung: its frontend was gone
        with open(index, encoding="utf-8") as f:
            saved = json.load(f)
        pages = {}
        for path, meta in saved.items():
            with open(os.path.join(d, "dbgsrv", meta["file"]), "rb") as f:
                pages[path] = dict(meta, text=f.read().decode("utf-8", "replace"))
        return matrix_judge.from_debug_server(pages)
    if column == "fr":
        path = os.path.join(d, "fr_trace.txt")
        if not os.path.exists(path):
            return None
        with open(path, "rb") as f:
            text = f.read().decode("utf-8", "replace")
        m = re.search(r"\(exit status (-?\d{1,4})\)\s*$", text)
        return matrix_judge.from_fr_trace(text[:m.start()] if m else text, int(m.group(1)) if m else 0)
    raise ValueError(column)


RUNNERS = {"hangdoc": run_hangdoc, "detect": run_detect, "plain": run_plain, "detail": run_detail, "fr": run_fr,
           "dbgsrv": run_dbgsrv, "nvrx": run_nvrx, "nvrxip": run_nvrxip}


def run_scenario(s: Dict[str, Any], out: str, columns: List[str]) -> Dict[str, Any]:
    d = os.path.join(out, s["name"])
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    result: Dict[str, Any] = {"truth": s["truth"], "verdicts": {}, "cells": {}, "runs": {}}
    for run, cols in (COLUMNS_OF_RUN_NCCL if BACKEND == "nccl" else COLUMNS_OF_RUN).items():
        wanted = [c for c in cols if c in columns]
        if not wanted:
            continue
        t0 = time.monotonic()
        try:
            got = RUNNERS[run](s, d, wanted)
        except Exception as e:  # the harness failed, not the tool: say so in every cell of the run
            got = {c: {"crash": f"harness: {type(e).__name__}: {e}"} for c in wanted}
        result["runs"][run] = dict(got, seconds=round(time.monotonic() - t0, 1))
        for c in wanted:
            v = got[c] if c in got else verdict(d, c)  # a harness failure, or what the run left
            result["verdicts"][c] = v
            result["cells"][c] = matrix_judge.judge(s["truth"], v)
    print(f"bug_matrix: {s['name']}: " + ", ".join(f"{c} {result['cells'][c]}" for c in columns if c in result["cells"])
          + f" ({sum(r['seconds'] for r in result['runs'].values()):.0f}s)", file=sys.stderr, flush=True)
    return result


# --- the table ------------------------------------------------------------------------------------

def table(results: Dict[str, Dict[str, Any]], columns: List[str]) -> str:
    lines = ["| scenario | truth | " + " | ".join(columns) + " |", "|---" * (len(columns) + 2) + "|"]
    for name, r in results.items():
        t = r["truth"]
        row = [name, f"{t['kind']} {t['culprits']}"]
        for c in columns:
            cell, v = r["cells"].get(c, "-"), r["verdicts"].get(c)
            if v and v.get("kind") == matrix_judge.UNATTRIBUTED:
                cell += ": timed out, nobody named"
            elif cell in ("PARTIAL", "WRONG") and v:
                cell += f": {v.get('kind')} {v.get('culprits')}"
            elif cell == "CRASH" and v:
                cell += f": {v.get('crash', '')[:60]}"
            row.append(cell.replace("|", "/"))
        lines.append("| " + " | ".join(row) + " |")
    totals = ["**RIGHT**", ""] + [str(sum(1 for r in results.values() if r["cells"].get(c) == "RIGHT")) + f"/{len(results)}"
                                   for c in columns]
    lines.append("| " + " | ".join(totals) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    global NVRX_PYTHON
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", help="comma-separated scenario names (default: all of examples/bugs)")
    p.add_argument("--columns", help=f"comma-separated subset of {','.join(COLUMNS + OPTIONAL_COLUMNS)} (default: "
                   "all, the optional peers dbgsrv, dbgsrvhd, nvrx only where their packages are importable)")
    p.add_argument("--nvrx-python", default=NVRX_PYTHON, help="interpreter with nvidia-resiliency-ext installed for "
                   "column nvrx (default $NVRX_PYTHON or this one)")
    p.add_argument("--jobs", type=int, default=1, help="scenarios run at once (default 1: 2 shared cores)")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                   help="gloo on CPU (default) or NCCL, one GPU a rank (scenarios of more ranks than --gpus are not run)")
    p.add_argument("--gpus", type=int, default=0, help="with --backend nccl: GPUs on this host (default: torch's count)")
    p.add_argument("--out", help="output directory (default benchmarks/results/<date>-bug-matrix)")
    p.add_argument("--rejudge", metavar="DIR", help="run nothing: judge again the files an earlier run left in DIR "
                   "(after a change to the judge or a TRUTH) and rewrite its table.md and matrix.json")
    args = p.parse_args(argv)
    if args.rejudge:
        return rejudge(os.path.abspath(args.rejudge))
    asked = args.columns is not None
    columns = [c for c in (args.columns or ",".join(COLUMNS + OPTIONAL_COLUMNS)).split(",") if c]
    bad = set(columns) - set(COLUMNS + OPTIONAL_COLUMNS)
    if bad:
        p.error(f"unknown column(s) {', '.join(sorted(bad))}")
    NVRX_PYTHON = args.nvrx_python
    unavailable = {}
    if "nvrx" in columns or "nvrxip" in columns:
        why = nvrx_missing(NVRX_PYTHON)
        if why:
            unavailable.update({c: why for c in ("nvrx", "nvrxip") if c in columns})
    if "dbgsrv" in columns or "dbgsrvhd" in columns:
        why = dbgsrv_missing()
        if why:
            unavailable.update({c: why for c in ("dbgsrv", "dbgsrvhd") if c in columns})
    for c, why in unavailable.items():
        if asked:
            print(f"bug_matrix: column {c} skipped: {why}", file=sys.stderr)
    columns = [c for c in columns if c not in unavailable]
    if not columns:
        p.error("no column left to run")
    chosen = scenarios(args.only.split(",") if args.only else None)
    global BACKEND
    BACKEND = args.backend
    skipped = {}
    if BACKEND == "nccl":
        gpus = args.gpus or _gpu_count()
        skipped = {s["name"]: f"needs {s['truth']['world']} GPUs, {gpus} here" for s in chosen if s["truth"]["world"] > gpus}
        chosen = [s for s in chosen if s["name"] not in skipped]
    out = os.path.abspath(args.out or os.path.join(HERE, "results", time.strftime("%Y-%m-%d") + "-bug-matrix"))
    os.makedirs(out, exist_ok=True)
    t0 = time.monotonic()
    results: Dict[str, Dict[str, Any]] = {}
    _stopping.clear()
    before = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally below stops every job
    pool = concurrent.futures.ThreadPoolExecutor(max(1, args.jobs))
    command = " ".join([os.path.relpath(sys.argv[0], ROOT)] + (argv if argv is not None else sys.argv[1:]))

    def save() -> str:  # after every scenario: a run cut short keeps what it measured
        done = {name: results[name] for name in sorted(results)}
        md = table(done, columns)
        with open(os.path.join(out, "table.md"), "w") as f:
            f.write(md)
        with open(os.path.join(out, "matrix.json"), "w") as f:
            json.dump({"command": command, "backend": BACKEND, "wall_seconds": round(time.monotonic() - t0, 1),
                       "hang_timeout": HANG_TIMEOUT, "columns": columns, "columns_skipped": unavailable, "not_run": skipped, "scenarios": done}, f, indent=1)
        return md

    try:
        futures = {pool.submit(run_scenario, s, out, columns): s["name"] for s in chosen}
        for fut in concurrent.futures.as_completed(futures):
            results[futures[fut]] = fut.result()
            save()
    finally:
        _stopping.set()
        pool.shutdown(wait=False, cancel_futures=True)
        with _live_lock:
            live = list(_live)
        for proc in live:
            stop_job(proc)
        signal.signal(signal.SIGTERM, before)
    wall = time.monotonic() - t0
    md = save()
    print(md)
    for name, why in skipped.items():
        print(f"bug_matrix: {name} not run: {why}", file=sys.stderr)
    print(f"bug_matrix: {len(results)} scenarios in {wall:.0f}s; everything in {out}", file=sys.stderr)
    return 0


def _gpu_count() -> int:
    r = tool([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"], limit=60)
    return int(r["stdout"].strip() or 0) if r["rc"] == 0 and r["stdout"].strip().isdigit() else 0


def rejudge(out: str) -> int:
    with open(os.path.join(out, "matrix.json"), encoding="utf-8") as f:
        matrix = json.load(f)
    truths = {s["name"]: s["truth"] for s in scenarios()}
    global BACKEND
    BACKEND = matrix.get("backend", "gloo")
    for name in sorted(truths):  # a scenario that ended as the run was cut short: its files are there
        if name not in matrix["scenarios"] and os.path.isdir(os.path.join(out, name)):
            matrix["scenarios"][name] = {"truth": truths[name], "verdicts": {}, "runs": {}, "recovered": True,
                                         "cells": {c: None for c in matrix["columns"]}}
    for name, r in matrix["scenarios"].items():
        r["truth"] = truths.get(name, r["truth"])
        for c in list(r["cells"]):
            crashed = (r["verdicts"].get(c) or {}).get("crash", "")
            if not str(crashed).startswith("harness:"):
                r["verdicts"][c] = verdict(os.path.join(out, name), c)
            r["cells"][c] = matrix_judge.judge(r["truth"], r["verdicts"][c])
    md = table(matrix["scenarios"], matrix["columns"])
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(md)
    with open(os.path.join(out, "matrix.json"), "w") as f:
        json.dump(matrix, f, indent=1)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
