"""The pytest plugin leaves no process behind (issue 20): children a rank started in a session of
their own (``start_new_session=True``: out of reach of ``killpg``) die with a passing test, a
hung test that was killed, and a pytest process that was SIGKILLed; the fake backend's in-process
ranks too."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time

import pytest

pytest_plugins = ["pytester"]
torch = pytest.importorskip("torch")

import hypothesis  # noqa: E402,F401  (imported once: pytester restores sys.modules after each run)
import torch.distributed  # noqa: E402,F401

from tests.procs import ROOT, kill_tree  # noqa: E402
from tests.test_plugin_gloo import HEADER, assert_no_orphans, env, plugin_args, processes_mentioning  # noqa: E402,F401

# each rank starts a child in a session of its own, named by a marker in its command line
START_CHILD = """
import subprocess, sys
def start_child(tag):
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", MARKER, tag], start_new_session=True)
"""


def _marker(pytester) -> str:
    return f"hangdoc-orphan-{os.getpid()}-{pytester.path.name}"


def test_children_in_sessions_of_their_own_die_with_passing_and_hung_tests(pytester, env):
    marker = _marker(pytester)
    pytester.makepyfile(test_o=HEADER + f"MARKER = {marker!r}\n" + START_CHILD + """
@pytest.mark.world_size(2, timeout=60)
def test_pass(rank):
    start_child("pass")
    dist.all_reduce(torch.ones(2))

@pytest.mark.world_size(2, timeout=3)
def test_hang(rank):
    start_child("hang")
    dist.all_reduce(torch.ones(2))
    if rank == 0:
        dist.broadcast(torch.ones(2), src=0)
    else:
        time.sleep(120)

@pytest.mark.world_size(2, backend="fake", timeout=60)
def test_fake_pass(rank):
    start_child("fake")
""")
    result = pytester.runpytest(*plugin_args(), "-p", "no:cacheprovider")
    try:
        result.assert_outcomes(passed=2, failed=1)
        assert_no_orphans(marker, grace=5.0)
    finally:
        for pid, _ in processes_mentioning(marker):
            kill_tree(pid)


def test_children_in_sessions_of_their_own_die_with_a_sigkilled_pytest(pytester, tmp_path):
    marker = _marker(pytester)
    pytester.makepyfile(test_k=HEADER + f"MARKER = {marker!r}\n" + START_CHILD + """
@pytest.mark.world_size(2, timeout=60)
def test_wait(rank):
    start_child("killed")
    dist.barrier()
    time.sleep(120)
""")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen([sys.executable, "-m", "pytest", *plugin_args(), "-p", "no:cacheprovider",
                          "--basetemp", str(tmp_path / "bt"), "test_k.py"],
                         cwd=str(pytester.path), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while len(processes_mentioning(marker + " killed")) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)  # both ranks started their child
        assert len(processes_mentioning(marker + " killed")) == 2
        os.kill(p.pid, signal.SIGKILL)  # no cleanup of pytest's own runs now
        p.wait(10)
        assert_no_orphans(marker, grace=10.0)
    finally:
        kill_tree(p.pid)
        for pid, _ in processes_mentioning(marker):
            kill_tree(pid)
