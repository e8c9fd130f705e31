"""Warm rank processes (hangdoc.testing.warm): forked from per-rank-index zygotes that imported torch
once, each rank with a hash seed of its own, reused across tests, cold with HANGDOC_TESTING_WARM=0,
and gone, zygotes too, when the pytest process is SIGKILLed."""

from __future__ import annotations

import glob
import json
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

from tests.test_plugin_gloo import env, plugin_args, processes_mentioning  # noqa: E402,F401

# what a rank saw: whether torch was imported before the test module (a warm rank's was), its
# parent, and a string hash (salted per interpreter unless PYTHONHASHSEED is set)
PROBE = """
import sys
PRELOADED = "torch" in sys.modules
import json, os
import pytest, torch
import torch.distributed as dist

@pytest.mark.world_size(2, timeout=60)
def test_probe(rank):
    dist.all_reduce(torch.ones(1))
    with open(os.path.join(OUT, f"r{rank}-{os.getpid()}.json"), "w") as f:
        json.dump({"rank": rank, "pid": os.getpid(), "ppid": os.getppid(), "preloaded": PRELOADED,
                   "hash": hash("hangdoc warm rank"), "sid": os.getsid(0)}, f)
"""


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return ""


def _probes(out) -> list:
    return [json.load(open(p)) for p in sorted(glob.glob(os.path.join(str(out), "r*.json")))]


def test_ranks_are_forked_from_zygotes_reused_across_tests_with_a_hash_seed_each(pytester, env, tmp_path):
    out = tmp_path / "probes"
    out.mkdir()
    pytester.makepyfile(test_w=f"OUT = {str(out)!r}\n" + PROBE)
    for _ in range(2):
        result = pytester.runpytest(*plugin_args(), "-p", "no:cacheprovider")
        result.assert_outcomes(passed=1)
    seen = _probes(out)
    assert len(seen) == 4, seen
    assert all(s["preloaded"] for s in seen), seen  # torch was there before the test module
    assert all(s["sid"] == s["pid"] for s in seen), seen  # a session of its own, as a cold rank
    zygote = {}
    for s in seen:
        assert "hangdoc/testing/warm.py" in _cmdline(s["ppid"]), s
        zygote.setdefault(s["rank"], set()).add(s["ppid"])
    # one zygote per rank index, the same one for both runs
    assert all(len(z) == 1 for z in zygote.values()), zygote
    assert zygote[0] != zygote[1]
    if not os.environ.get("PYTHONHASHSEED"):
        by_rank = {s["rank"]: s["hash"] for s in seen}
        assert by_rank[0] != by_rank[1], "ranks forked from one seed would iterate sets alike"


def test_warm_off_starts_fresh_interpreters(pytester, env, tmp_path, monkeypatch):
    monkeypatch.setenv("HANGDOC_TESTING_WARM", "0")
    out = tmp_path / "probes"
    out.mkdir()
    pytester.makepyfile(test_c=f"OUT = {str(out)!r}\n" + PROBE)
    pytester.runpytest(*plugin_args(), "-p", "no:cacheprovider").assert_outcomes(passed=1)
    seen = _probes(out)
    assert len(seen) == 2
    assert not any(s["preloaded"] for s in seen), seen
    assert all(s["ppid"] == os.getpid() for s in seen), seen  # started by this (in-process) pytest


def test_a_killed_pytest_process_takes_its_zygotes_and_ranks_with_it(pytester, env, tmp_path):
    pytester.makepyfile(test_k="""
import time
import pytest, torch
import torch.distributed as dist

@pytest.mark.world_size(2, timeout=120)
def test_sleep(rank):
    dist.all_reduce(torch.ones(1))
    time.sleep(120)
""")
    proc = subprocess.Popen([sys.executable, "-m", "pytest", *plugin_args(), "-p", "no:cacheprovider", "-q",
                             f"--basetemp={tmp_path / 'bt'}", "test_k.py"], cwd=str(pytester.path),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        started = []
        while time.monotonic() < deadline and len(started) < 2:
            started = glob.glob(str(tmp_path / "bt" / "hangdoc-test_sleep0" / "started-r*"))
            time.sleep(0.2)
        assert len(started) == 2, "the ranks never reached the test"
        ranks = [int(open(p).read()) for p in started]
        zygotes = sorted({int(open(f"/proc/{r}/stat").read().rsplit(")", 1)[-1].split()[1]) for r in ranks})
        assert len(zygotes) == 2 and all("hangdoc/testing/warm.py" in _cmdline(z) for z in zygotes)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 15
        left = ranks + zygotes
        while time.monotonic() < deadline:
            left = [p for p in ranks + zygotes if _cmdline(p) and "warm.py" in _cmdline(p)]
            if not left:
                break
            time.sleep(0.1)
        assert not left, f"left behind: {[(p, _cmdline(p)) for p in left]}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
