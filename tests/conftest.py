"""Shared test set-up: the repo root is importable (also as ``tests.procs``), and a ``procs``
fixture that kills every process group a test started, even when the test fails.

    def test_job(procs, tmp_path):
        p = procs.spawn([sys.executable, "-c", "import time; time.sleep(60)"])
        ...                      # p is killed (whole group) when the test ends

For one-shot runs with a hard timeout use ``tests.procs.run`` / ``torchrun_cmd`` directly.
"""

from __future__ import annotations

import os
import signal
import sys

import pytest

# Bytecode caching on for this run and every process it starts. With PYTHONDONTWRITEBYTECODE set
# (container images often set it; this machine does), each of the suite's ~150 pytest processes
# (xdist workers, rank processes, pytester and docs runs) parsed and assert-rewrote hypothesis again
# (pytest rewrites the modules of every plugin it loads and caches the result only where bytecode
# may be written): 1.5-2.5 s of CPU each. A module edited since its bytecode was written is compiled
# again by every process that imports it, too.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# SIGINT back to Python's handler when the run was started with it ignored (a `cmd &` of a
# non-interactive shell, nohup): the processes the tests start inherit an ignored SIGINT across exec,
# and the tests of Ctrl-C (a KeyboardInterrupt in a rank, a SIGINT to a job's process group) would
# fail for that alone. A handled signal is reset to the default at exec, so the children get theirs.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests import procs as _procs  # noqa: E402


class _Procs:
    def __init__(self) -> None:
        self.started = []

    def spawn(self, cmd, **kw):
        p = _procs.spawn(cmd, **kw)
        self.started.append(p)
        return p

    def run(self, cmd, timeout=60, **kw):
        return _procs.run(cmd, timeout=timeout, **kw)


@pytest.fixture
def procs():
    """Start processes with ``procs.spawn(cmd)``; their process groups are killed at teardown."""
    tracker = _Procs()
    try:
        yield tracker
    finally:
        for p in tracker.started:
            _procs.kill_group(p)


# The suite loads torch, gloo process groups and in-process fake ranks into this pytest process;
# after the summary, tearing the interpreter down while torch's own threads are still alive has
# ended in "Fatal Python error: PyThreadState_Get ... runtime state: finalizing" (SIGABRT, exit
# 134) although every test had been reported. Once pytest is done with its own teardown, this
# process leaves with pytest's exit status, skipping the interpreter's finalization.
_outer: dict = {}


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    _outer.setdefault("config", config)


def pytest_sessionfinish(session, exitstatus):
    if session.config is _outer.get("config"):
        _outer["status"] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    if config is _outer.get("config") and "status" in _outer and not os.environ.get("PYTEST_XDIST_WORKER"):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_outer["status"])
