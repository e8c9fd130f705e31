"""Real hung torchrun jobs (gloo) under ``python -m hangdoc --hang-timeout``: the store is
unreachable (files fallback), rank 0 is not stalled (another rank takes over), ``hangdoc dump``
reads a hung job from outside, and every process is gone afterwards.

The 4-rank skip_broadcast case (every rank dumps, rank 0 names rank 3) is ``tests/test_demo.py``:
``hangdoc demo`` runs exactly that job."""

import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest

from hangdoc import examples
from hangdoc.cli.demo import stop_job
from hangdoc.proctree import alive
from hangdoc.tags import parse_tag
from tests.procs import env_for, torchrun_cmd

if importlib.util.find_spec("torch") is None:
    pytest.skip("torch is not installed", allow_module_level=True)

TIMEOUT = 2


class Job:
    """A torchrun job whose merged output is read line by line in the background."""

    def __init__(self, cmd, env=None):
        self.lines = []
        self.proc = subprocess.Popen(cmd, env=env_for(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, text=True, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(re.search(pattern, line) for line in self.lines):
                return True
            if self.proc.poll() is not None:
                time.sleep(0.2)
                return any(re.search(pattern, line) for line in self.lines)
            time.sleep(0.1)
        return False

    @property
    def log(self):
        return "\n".join(self.lines)


def test_store_unreachable_falls_back_to_files(tmp_path):
    """The launcher serves the store; stopped (SIGSTOP), it answers nothing: the ranks' store
    operations time out and the report comes from the files in the shared output directory."""
    import signal

    out = str(tmp_path / "out")
    cmd = torchrun_cmd(2, "hangdoc", "--hang-timeout", str(TIMEOUT), "--out", out, examples.copy_to("skip_broadcast", str(tmp_path / "job")), module=True)
    job = Job(cmd)
    try:
        # both ranks are past init (their store connections are made) once step 1 is done
        assert job.wait_for(r"PROGRESS rank=1 step=1 ", 60), job.log
        time.sleep(0.3)
        os.kill(job.proc.pid, signal.SIGSTOP)
        assert job.wait_for(r"hangdoc: full report:", 30), job.log
        assert any("store unreachable" in line for line in job.lines), job.log
        verdicts = [line for line in job.lines if "hangdoc: VERDICT:" in line]
        assert len(verdicts) == 1 and ":0] " in verdicts[0], job.log
        # both ranks' dumps reached the report although the store never answered
        assert json.load(open(os.path.join(out, "report.json")))["processes"] == 2
        assert "dumps from ranks 0-1 of 2" in job.log, job.log
        names = os.listdir(out)
        for rank in (0, 1):
            assert any(re.match(rf"collectives-.*-r{rank}-\d+\.jsonl$", n) for n in names), (names, job.log)
    finally:
        pids = stop_job(job.proc, grace=0.5)  # a stopped launcher does not act on SIGTERM
        job.proc.wait(timeout=10)
    assert not [p for p in pids if alive(p)]


TAKEOVER = '''
import time, torch, torch.distributed as dist
import hangdoc
dist.init_process_group("gloo")
rank = dist.get_rank()
pair = dist.new_group([1, 2])
x = torch.zeros(2)
dist.all_reduce(x)
print(f"PROGRESS rank={rank}", flush=True)
if rank == 0:
    while True:              # rank 0 is healthy: it keeps making progress
        hangdoc.step()
        time.sleep(0.1)
elif rank == 1:
    dist.all_reduce(x, group=pair)
else:
    dist.broadcast(x, src=1, group=pair)
'''


def test_a_stalled_rank_takes_over_when_rank_0_is_not_stalled(tmp_path):
    script = tmp_path / "takeover.py"
    script.write_text(TAKEOVER)
    out = str(tmp_path / "out")
    job = Job(torchrun_cmd(3, "hangdoc", "--hang-timeout", "2", "--out", out, str(script), module=True))
    try:
        assert job.wait_for(r"hangdoc: full report:", 60), job.log
        time.sleep(0.5)
        verdicts = [line for line in job.lines if "hangdoc: HANG:" in line]
        # exactly one of the two stalled ranks reports, and says rank 0 sent nothing
        assert len(verdicts) == 1 and re.match(r"^\[[\w.-]+:[12]\] ", verdicts[0]), job.log
        assert "dumps from ranks 1-2 of 3" in verdicts[0], job.log
        assert re.search(r":[12]\] hangdoc:   no dump from ranks 0$", job.log, re.M), job.log
        assert "rank 0 did not report" in job.log
        assert not any(re.match(r"stacks-.*-r0-", n) for n in os.listdir(out))

        # the job still hangs (the watchdog kills nothing): dump it from outside
        assert job.proc.poll() is None
        trace = tmp_path / "trace-node.out"
        r = subprocess.run([sys.executable, "-m", "hangdoc", "dump", "--pid", str(job.proc.pid), "-o", str(trace)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=60, env=env_for())
        assert r.returncode == 0, r.stderr
        tags = [parse_tag(line) for line in trace.read_text().splitlines() if parse_tag(line)]
        assert sorted(t["rank"] for t in tags if "rank" in t) == ["0", "1", "2"]
        assert [t.get("role") for t in tags if "rank" not in t] == ["launcher"]
        assert all(t["world_size"] == "3" for t in tags if "rank" in t)
        from hangdoc.readers import read_paths

        dumped = read_paths([str(trace)])
        assert sorted(p.rank for p in dumped.processes if p.rank is not None) == [0, 1, 2]
        stacks = {p.rank: " ".join(f.function for f in p.main_thread.frames) for p in dumped.processes if p.rank is not None}
        assert "all_reduce" in stacks[1] and "broadcast" in stacks[2] and "sleep" not in stacks[1]
    finally:
        pids = stop_job(job.proc)
    assert len(pids) >= 3
    assert not [p for p in pids if alive(p)]
