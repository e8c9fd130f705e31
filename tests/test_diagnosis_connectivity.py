"""The all-ranks connectivity test that the collective-wait advice points to really runs (gloo, 2 ranks)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from hangdoc.proctree import free_port

torch = pytest.importorskip("torch", reason="the connectivity test needs torch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_connectivity_test_passes_on_two_gloo_ranks():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           os.path.join(ROOT, "examples", "connectivity_test.py"), "--timeout", "30", "--mbytes", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out
    assert "OK: 2 ranks on 1 hosts" in out
    assert out.count("busbw") == 2
