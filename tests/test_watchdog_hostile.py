"""The watchdog in a shared temp directory (issue 20): another local user's FIFO named like a stale
signal file must not switch the watchdog off (its stale-file sweep used to block in ``open``)."""

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

from tests.attacker import attacker
from tests.procs import ROOT, env_for


def _free_pid() -> int:
    with open("/proc/sys/kernel/pid_max") as f:
        pid = int(f.read()) - 1
    while os.path.exists(f"/proc/{pid}"):
        pid -= 1
    return pid


def test_a_fifo_named_like_a_signal_file_does_not_stop_the_watchdog(tmp_path):
    uid, gid, as_attacker = attacker()
    shared = tempfile.mkdtemp(prefix="hangdoc-sharedtmp-")  # a /tmp of its own: sticky, everyone's
    os.chmod(shared, 0o1777)
    fifo = os.path.join(shared, f"hangdoc-signal-{_free_pid()}-SIGUSR1-trap.txt")
    out = str(tmp_path / "out")
    code = textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {ROOT!r})
        import hangdoc
        from hangdoc.runtime import watchdog
        watchdog.start(0.5, out_dir={out!r}, record=False, report=False)
        hangdoc.step()  # progress once: armed, the stall below is dumped after 0.5 s
        for _ in range(80):
            time.sleep(0.1)
            if any(n.startswith("stacks-") for n in os.listdir({out!r})):
                print("dumped", flush=True)
                break
        else:
            print("no dump", flush=True)
        """)
    try:
        made = subprocess.run(as_attacker + [sys.executable, "-c", f"import os; os.mkfifo({fifo!r}, 0o666)"],
                              capture_output=True, text=True, timeout=60)
        assert made.returncode == 0, made.stderr
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                             env=env_for({"TMPDIR": shared}))
        assert res.stdout.strip() == "dumped", res.stdout + res.stderr
        assert os.path.exists(fifo)  # not ours: left alone
    finally:
        shutil.rmtree(shared, ignore_errors=True)
