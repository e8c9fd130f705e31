"""``hangdoc demo``, the README's first command: a real 4-rank hang on gloo (the last rank skips a
broadcast) under the watchdog; every rank dumps, rank 0 prints the verdict naming rank 3, then every
process of the job is gone."""

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from hangdoc.proctree import alive
from tests.procs import env_for

if importlib.util.find_spec("torch") is None:
    pytest.skip("torch is not installed", allow_module_level=True)


def _processes_mentioning(text):
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    found.append(int(name))
        except OSError:
            pass
    return [p for p in found if alive(p)]


def test_demo_prints_the_verdict_and_leaves_nothing_running(tmp_path):
    out = str(tmp_path / "demo-out")
    p = subprocess.Popen([sys.executable, "-m", "hangdoc", "demo", "--timeout", "2", "--out", out], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=env_for(), start_new_session=True)
    try:
        log, _ = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, 9)
            p.wait()
    assert p.returncode == 0, log
    # the verdict comes from rank 0 through the job's log, and names the rank that skipped
    assert re.search(r"^\[[\w.-]+:0\] hangdoc: VERDICT: \[collective-mismatch\] rank 3 ", log, re.M), log
    assert re.search(r"^\[[\w.-]+:0\] hangdoc:   culprit: rank 3 ", log, re.M), log
    assert len(re.findall(r"hangdoc: VERDICT:", log)) == 1, log
    assert "hangdoc demo: verdict" in log
    report = json.load(open(os.path.join(out, "report.json")))
    assert report["processes"] == 4
    assert [c["rank"] for c in report["findings"][0]["culprits"]] == [3]
    # every rank dumped its stacks and records
    names = os.listdir(out)
    for rank in range(4):
        assert any(re.match(rf"collectives-.*-r{rank}-\d+\.jsonl$", n) for n in names), names
    pids = [int(m.group(1)) for n in names for m in [re.match(r"stacks-.*-r\d-(\d+)\.txt$", n)] if m]
    assert len(pids) == 4
    # and no process of the job (ranks by pid, torchrun by its --out) survives
    assert not [pid for pid in pids if alive(pid)]
    assert _processes_mentioning(out) == []
    # torchrun's shutdown noise after the verdict is not shown
    assert "SignalException" not in log and "Traceback" not in log


def test_demo_list_and_unknown_scenario():
    r = subprocess.run([sys.executable, "-m", "hangdoc", "demo", "--list"], stdout=subprocess.PIPE, text=True, env=env_for(), timeout=30)
    assert r.returncode == 0 and "skip_broadcast" in r.stdout and "pipeline" in r.stdout
    r = subprocess.run([sys.executable, "-m", "hangdoc", "demo", "nope"], stderr=subprocess.PIPE, text=True, env=env_for(), timeout=30)
    assert r.returncode == 2 and "unknown scenario 'nope'" in r.stderr
