"""Run real processes (and torchrun jobs) in tests with a hard timeout, and kill all of them after.

Every process is started in a new session (its own process group); on a timeout, a failed
assertion or a Ctrl-C the whole tree (torchrun, its agent, every rank, their workers) is killed:
the group, and every descendant found in /proc with its own group (torchrun starts each rank in a
session of its own, so ``os.killpg`` of the launcher alone would leave the ranks running). Reuse it from any test::

    from tests.procs import run, torchrun_cmd

    def test_two_ranks(tmp_path):
        script = tmp_path / "job.py"
        script.write_text("import torch.distributed as dist\\ndist.init_process_group('gloo')\\n")
        res = run(torchrun_cmd(2, str(script)), timeout=60)
        assert res.returncode == 0, res.stderr

``run`` returns a ``subprocess.CompletedProcess`` (text stdout/stderr) with ``timed_out`` set;
on a timeout it kills the group and returns what was captured, it does not raise. ``spawn`` gives
a ``Popen`` for tests that interact with a running job; pair it with ``kill_group`` in a
``finally`` (or use the ``procs`` fixture of ``tests/conftest.py``, which does it for you).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Dict, List, Mapping, Optional, Sequence

from hangdoc.proctree import descendants, kill_tree  # noqa: F401  (descendants re-exported for tests)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def env_for(extra: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """os.environ plus: the repo root on PYTHONPATH, one OpenMP thread, no stray launcher rank."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun warns without it; 2 cores are shared anyway
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "HANGDOC_OUT"):
        env.pop(name, None)  # a test run inside a job must not leak the job's identity
    if extra:
        env.update(extra)
    return env


def torchrun_cmd(nproc: int, *args: str, module: bool = False) -> List[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node N [args]``.

    ``--standalone`` picks a free port, so parallel tests never collide on MASTER_PORT.
    With ``module=True`` the first arg is a module name (torchrun's ``-m``), e.g. ``hangdoc``.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "--monitor-interval=0.1"]
    if module:
        cmd.append("-m")
    return cmd + list(args)


def spawn(cmd: Sequence[str], env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None, **kw) -> subprocess.Popen:
    """Start ``cmd`` in its own process group; stdout/stderr are pipes (text) unless given."""
    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stderr", subprocess.PIPE)
    kw.setdefault("text", True)
    return subprocess.Popen(list(cmd), env=env_for(env), cwd=cwd, start_new_session=True, **kw)


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Kill ``proc``, its process group and every descendant (also those in sessions of their own,
    as torchrun's ranks are), then reap ``proc``. No error for what is gone already."""
    kill_tree(proc.pid, sig)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def run(cmd: Sequence[str], timeout: float = 60, env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None,
        input: Optional[str] = None, **kw) -> subprocess.CompletedProcess:
    """Run ``cmd`` to completion in its own process group with a hard ``timeout`` (seconds).

    The group is killed afterwards in any case, so ranks or workers left behind by a crashed
    launcher do not outlive the test.
    """
    if input is not None:
        kw.setdefault("stdin", subprocess.PIPE)
    proc = spawn(cmd, env=env, cwd=cwd, **kw)
    timed_out = False
    t0 = time.monotonic()
    try:
        out, err = proc.communicate(input=input, timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_group(proc)
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # a process we could not see still holds the pipes
            out, err = "", ""
    finally:
        kill_group(proc)
    res = subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)
    res.timed_out = timed_out  # type: ignore[attr-defined]
    res.elapsed = time.monotonic() - t0  # type: ignore[attr-defined]
    return res


def module_from_source(directory, name: str, source: str):
    """Write ``source`` to ``directory/name.py`` and import it as a module of that name: code whose
    frames point at a real, readable file (the detector reads the source of live frames)."""
    import importlib.util

    path = os.path.join(str(directory), f"{name}.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
