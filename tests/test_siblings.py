"""The reporting rank finds a silent sibling rank's state on its node (real processes)."""

import os
import signal
import subprocess
import sys
import textwrap

from tests.procs import env_for

PARENT = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    # two "ranks", children of this "launcher": rank 1 stops itself, rank 0 looks for the silent one
    one = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSTOP)"],
                           env=dict(os.environ, RANK="1"))
    for _ in range(100):
        with open(f"/proc/{one.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                break
        time.sleep(0.05)
    zero = subprocess.run([sys.executable, "-c",
        "from hangdoc.runtime.siblings import unanswered; "
        "print([(p.rank, p.pid, p.status, p.status_detail) for p in unanswered([1, 2], 'n1')])"],
        env=dict(os.environ, RANK="0"), capture_output=True, text=True, timeout=60)
    print(one.pid, zero.stdout.strip(), zero.stderr[-500:])
    os.kill(one.pid, signal.SIGKILL)
    one.wait()
""")


def test_a_stopped_sibling_rank_is_found_with_its_state():
    r = subprocess.run([sys.executable, "-c", PARENT], env=env_for(), capture_output=True, text=True, timeout=90)
    pid, found = r.stdout.split(" ", 1)
    assert found.startswith(f"[(1, {pid}, 'stopped', 'posted no dump; its process is stopped (SIGSTOP"), r.stdout + r.stderr
