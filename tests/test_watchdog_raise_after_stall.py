"""A rank that raises while the stall it dumped still holds (the job's teardown: SIGTERM killed the
DataLoader worker it waited for) keeps the stall's dump: the teardown's error is no new evidence."""

import glob
import os
import subprocess
import sys
import textwrap

from tests.procs import ROOT, env_for

SCRIPT = textwrap.dedent("""
    import sys, time
    import hangdoc
    for _ in range(3):
        hangdoc.step()  # progress: the stall timer runs from here
        time.sleep(0.05)
    def wait_for_batch():
        time.sleep(float(sys.argv[1]))
    wait_for_batch()
    raise RuntimeError("DataLoader worker (pid 1) is killed by signal: Terminated.")
""")


def run(tmp_path, sleep):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "hangdoc", "--hang-timeout", "1", "--out", str(out), str(script), str(sleep)],
                       capture_output=True, text=True, timeout=60, cwd=ROOT, env=env_for())
    [stacks] = glob.glob(os.path.join(out, "stacks-*.txt"))
    return r, open(stacks).read()


def test_a_raise_during_the_stall_leaves_the_stall_s_dump(tmp_path):
    r, text = run(tmp_path, 3)
    assert r.returncode == 1 and "RuntimeError: DataLoader worker" in r.stderr  # Python's own traceback still shows it
    assert "reason=raised_" not in text and "in wait_for_batch" in text, text[:600]
    assert "raised RuntimeError during the stall it reported" in r.stderr


def test_a_raise_with_no_stall_is_dumped(tmp_path):
    r, text = run(tmp_path, 0)
    assert r.returncode == 1
    assert text.startswith("# hangdoc process") and "reason=raised_RuntimeError" in text.splitlines()[0]
