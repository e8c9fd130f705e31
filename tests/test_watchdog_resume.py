"""A slow step is not a hang: a stall that resolves is retracted in the log and the report, and
``--hang-timeout auto`` learns the job's own pauses (real 2-rank gloo jobs under ``-m hangdoc``)."""

import json
import os
import sys

import pytest

from hangdoc.cli.demo import stop_job
from hangdoc.runtime.watchdog import AUTO_FACTOR, Watchdog, parse_hang_timeout
from tests.procs import torchrun_cmd
from tests.test_watchdog_job import Job

pytest.importorskip("torch")

SLOW = '''
import os, sys, time
import torch, torch.distributed as dist
import hangdoc

dist.init_process_group("gloo")
rank = dist.get_rank()
pauses = {int(s): float(p) for s, p in (x.split("=") for x in os.environ["PAUSES"].split(","))}
x = torch.ones(4)
for step in range(int(os.environ.get("STEPS", "8"))):
    if rank == 0 and step in pauses:
        time.sleep(pauses[step])          # a checkpoint: slow, not stuck
    dist.all_reduce(x)
    hangdoc.step()
    print(f"PROGRESS rank={rank} step={step}", flush=True)
    time.sleep(0.05)
dist.destroy_process_group()
print(f"DONE rank={rank}", flush=True)
'''


def run_slow(tmp_path, timeout, pauses, steps=8):
    script = tmp_path / "slow.py"
    script.write_text(SLOW)
    out = str(tmp_path / "out")
    job = Job(torchrun_cmd(2, "hangdoc", "--hang-timeout", timeout, "--out", out, str(script), module=True),
              env={"PAUSES": pauses, "STEPS": str(steps)})
    try:
        assert job.wait_for(r"DONE rank=0", 120), job.log
        job.proc.wait(30)
    finally:
        stop_job(job.proc)
    return job, out


def test_a_slow_step_is_reported_then_retracted_in_the_log_and_the_report(tmp_path):
    job, out = run_slow(tmp_path, "1.5", "3=3.5")
    hang = [i for i, line in enumerate(job.lines) if "hangdoc: HANG:" in line]
    resumed = [i for i, line in enumerate(job.lines) if "hangdoc: RESUMED:" in line]
    assert hang and resumed and resumed[0] > hang[0], job.log
    assert "a slow step on rank 0, no hang" in job.lines[resumed[0]], job.log
    report = json.load(open(os.path.join(out, "report.json")))
    head = report["findings"][0]
    assert head["kind"] == "no-hang" and head["summary"].startswith("resumed after "), head
    assert any(e.startswith("retracted: the stall reported at ") for e in head["evidence"]), head
    with open(os.path.join(out, "report.txt")) as f:
        assert "resumed after" in f.read()


def test_auto_learns_the_first_long_pause_and_does_not_cry_hang_at_the_next(tmp_path):
    job, out = run_slow(tmp_path, "auto:1.5", "3=3,6=3", steps=9)
    hangs = [line for line in job.lines if "hangdoc: HANG:" in line]
    resumed = [line for line in job.lines if "hangdoc: RESUMED:" in line]
    # the first 3 s pause exceeds the 1.5 s floor (nothing learnt yet); the second is within 3 x 3 s
    assert len(hangs) >= 1 and len(resumed) >= 1, job.log
    assert all("no progress for" in h for h in hangs)
    assert len([line for line in job.lines if "hangdoc: HANG:" in line and ":0]" in line]) <= 1, job.log
    assert json.load(open(os.path.join(out, "report.json")))["findings"][0]["kind"] == "no-hang"


def test_the_auto_limit_is_a_multiple_of_the_longest_pause_above_the_floor(tmp_path):
    dog = Watchdog("auto:5", out_dir=str(tmp_path), signum=None, report=False, record=False)
    assert dog.auto and dog.limit() == 5
    dog.longest_gap = 0.5
    assert dog.limit() == 5
    dog.longest_gap = 20.0
    assert dog.limit() == AUTO_FACTOR * 20.0
    fixed = Watchdog(7, out_dir=str(tmp_path), signum=None, report=False, record=False)
    fixed.longest_gap = 100.0
    assert fixed.limit() == 7
    for bad in ("auto:0", "auto:-1", "soon", "", "inf", 0, -3):
        with pytest.raises(ValueError):
            parse_hang_timeout(bad)
