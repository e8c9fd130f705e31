"""A job that fails before any stall gets an in-job verdict (hangdoc/runtime/exit_verdict.py).

Real torchrun jobs of the bug scenarios, run at once: a rank SIGKILLed (``dead_rank``), gloo
aborting rank 0 itself on a dtype mismatch (``dtype_mismatch``: the next rank reports), gloo
aborting the rank that issued an extra all_reduce (``extra_collective``, with ``--detect``), and a
healthy job stopped whole by SIGTERM, which must get no verdict. The hang timeout is far beyond the
jobs' life, so no stall verdict can be what is read.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

from tests.procs import ROOT, kill_group, spawn, torchrun_cmd

BUGS = os.path.join(ROOT, "examples", "bugs")
LIMIT = 150


def _job(out, script, nproc=4, *more):
    return torchrun_cmd(nproc, "hangdoc", "--record", *more, "--hang-timeout", "120", "--out", str(out), script,
                        module=True)


def _wait_all(procs, limit):
    end = time.monotonic() + limit
    outs = {}
    for name, p in procs.items():
        try:
            outs[name] = p.communicate(timeout=max(1.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            kill_group(p)
            outs[name] = p.communicate()
        finally:
            kill_group(p)
    return outs


def _report(out):
    with open(os.path.join(out, "report.json")) as f:
        head = json.load(f)["findings"][0]
    return head["kind"], sorted(c["rank"] for c in head["culprits"])


def test_failing_jobs_get_a_verdict_and_a_job_stopped_whole_gets_none(tmp_path):
    healthy = tmp_path / "healthy.py"
    healthy.write_text(textwrap.dedent("""
        import time, torch, torch.distributed as dist
        dist.init_process_group("gloo")
        x = torch.ones(4)
        print("STARTED", dist.get_rank(), flush=True)
        while True:
            dist.all_reduce(x)
            time.sleep(0.05)
    """))
    procs = {
        "dead": spawn(_job(tmp_path / "dead", os.path.join(BUGS, "dead_rank.py"))),
        # with the divergence detector too: the job dies within a second of the divergence, before
        # any publication is due; the ranks' last states go out on their way out (atexit, SIGTERM)
        "dtype": spawn(_job(tmp_path / "dtype", os.path.join(BUGS, "dtype_mismatch.py"), 4, "--detect")),
        "healthy": spawn(_job(tmp_path / "healthy", str(healthy), nproc=2)),
        # rank 1's extra all_reduce gets it aborted inside the call (gloo's enforce: ``terminate
        # called``, no Python on its way out): its call was published as it was issued, being of a
        # signature new to it, so the others' last checks name it (3 ranks: a majority of two)
        "extra": spawn(_job(tmp_path / "extra", os.path.join(BUGS, "extra_collective.py"), 3, "--detect")),
    }
    try:
        # the healthy job is stopped as scancel or a time limit stops a job: SIGTERM to its launcher
        p = procs["healthy"]
        started, end = 0, time.monotonic() + LIMIT
        while started < 2 and time.monotonic() < end:
            line = p.stdout.readline()
            if not line:
                break
            started += line.startswith("STARTED") or "]:STARTED" in line or "] STARTED" in line
        assert started == 2, "the healthy job did not start"
        time.sleep(1.0)
        os.kill(p.pid, signal.SIGTERM)
        outs = _wait_all(procs, LIMIT)
    finally:
        for p in procs.values():
            kill_group(p)

    dead_log = "".join(outs["dead"])
    assert "hangdoc: DUMP: the job is failing (rank 0: " in dead_log, dead_log[-3000:]
    assert _report(tmp_path / "dead") == ("rank-failed", [2]), dead_log[-3000:]
    assert "rank 2 died while the job ran" in dead_log

    dtype_log = "".join(outs["dtype"])
    said = "\n".join(line for line in dtype_log.splitlines() if "hangdoc" in line or "terminate" in line)
    # rank 0 is the one gloo aborts: the lowest rank left reports
    assert "terminate called after throwing" in dtype_log
    assert (tmp_path / "dtype" / "report.json").exists(), said
    assert _report(tmp_path / "dtype") == ("collective-mismatch", [1]), said
    with open(tmp_path / "dtype" / "divergence.json") as f:
        divergence = json.load(f)
    assert divergence["deviants"] == [1] and divergence["index"] == 2, divergence
    assert "hangdoc: DIVERGENCE: rank 1 diverged from " in dtype_log and "all_reduce([1024] float64)" in dtype_log

    extra_log = "".join(outs["extra"])
    with open(tmp_path / "extra" / "divergence.json") as f:
        divergence = json.load(f)
    assert (divergence["deviants"], divergence["agreeing"]) == ([1], [0, 2]), divergence
    assert divergence["deviant"][1:3] == ["all_reduce([1] float32)", "extra_collective.py:27"], divergence
    assert "hangdoc: DIVERGENCE: rank 1 diverged from " in extra_log, extra_log[-3000:]

    healthy_log = "".join(outs["healthy"])
    assert "hangdoc: DUMP" not in healthy_log and "VERDICT" not in healthy_log, healthy_log[-3000:]
    assert not (tmp_path / "healthy" / "report.json").exists()


HOLD = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, {root!r})
    from hangdoc.runtime import on_term
    done = []
    on_term.install(lambda: done.append("action"))
    with on_term.holding():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)  # a dump in progress
        print("BLOCK-DONE", done, flush=True)
    print("AFTER-BLOCK", flush=True)
""")


def test_sigterm_waits_for_a_held_block_then_ends_the_process(tmp_path):
    script = tmp_path / "hold.py"
    script.write_text(HOLD.format(root=ROOT))
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert "BLOCK-DONE ['action']" in res.stdout, res.stdout + res.stderr
    assert "AFTER-BLOCK" not in res.stdout
    assert res.returncode == -signal.SIGTERM, (res.returncode, res.stderr)
