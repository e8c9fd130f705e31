"""The Python stack of a rank that dies of a fatal signal (hangdoc.runtime.fatal): real processes."""

import os
import stat
import subprocess
import sys
import textwrap

from tests.procs import ROOT, env_for

SCRIPT = textwrap.dedent("""
    import os, sys
    from hangdoc.runtime import fatal
    path = fatal.arm(sys.argv[1], "n1", 3)
    print(path, flush=True)
    def log_loss_spike():
        if sys.argv[2] == "abort":
            os.abort()
    log_loss_spike()
    fatal.disarm()
""")


def run(tmp_path, how):
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), how], capture_output=True, text=True,
                       timeout=60, cwd=ROOT, env=env_for())
    return r, r.stdout.strip()


def test_an_abort_leaves_the_stack_in_a_private_file_that_the_aggregate_reads_as_the_rank(tmp_path):
    r, path = run(tmp_path, "abort")
    assert r.returncode == -6, r.stderr
    assert os.path.basename(path) == f"fatal-n1-r3-{os.path.basename(path).split('-')[-1]}"
    assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600
    text = open(path).read()
    assert text.startswith("Fatal Python error: Aborted")
    assert "in log_loss_spike" in text
    out = subprocess.run([sys.executable, "-m", "hangdoc", "aggregate", "-v", str(tmp_path)], capture_output=True,
                         text=True, timeout=60, cwd=ROOT, env=env_for())
    assert "rank 3 on host n1" in out.stdout, out.stdout
    assert "died of a fatal signal in this stack (Fatal Python error: Aborted)" in out.stdout


def test_a_clean_end_leaves_no_file(tmp_path):
    r, path = run(tmp_path, "clean")
    assert r.returncode == 0, r.stderr
    assert path.endswith(".txt") and not os.path.exists(path)
    assert os.listdir(tmp_path) == []


def test_a_planted_link_is_never_written_through(tmp_path):
    """Another user who guessed the name (host, rank, pid) and planted a link gets nothing: not armed."""
    target = tmp_path / "victim"
    target.write_text("")
    out = tmp_path / "out"
    out.mkdir()
    script = SCRIPT.replace('path = fatal.arm(', 'os.symlink(sys.argv[3], fatal.path_for(sys.argv[1], "n1", 3, os.getpid()))\npath = fatal.arm(')
    r = subprocess.run([sys.executable, "-c", script, str(out), "abort", str(target)], capture_output=True, text=True,
                       timeout=60, cwd=ROOT, env=env_for())
    assert r.returncode == -6
    assert r.stdout.strip() == "None"
    assert target.read_text() == ""


def test_a_forked_child_s_crash_is_not_written_as_the_rank_s(tmp_path):
    script = SCRIPT.replace("log_loss_spike()\n", "pid = os.fork()\nif pid == 0:\n    os.abort()\nos.waitpid(pid, 0)\n")
    r = subprocess.run([sys.executable, "-c", script, str(tmp_path), "clean"], capture_output=True, text=True,
                       timeout=60, cwd=ROOT, env=env_for())
    assert r.returncode == 0, r.stderr
    assert os.listdir(tmp_path) == []


def test_a_job_that_enables_faulthandler_itself_later_keeps_it(tmp_path):
    """torchelastic's ``@record`` enables faulthandler (to stderr) at the start of main, after
    hangdoc armed it: the job's choice wins, and hangdoc's stop never disables it."""
    script = textwrap.dedent("""
        import faulthandler, os, sys
        from hangdoc.runtime import fatal
        fatal.arm(sys.argv[1], "n1", 3)
        faulthandler.enable(all_threads=True)
        fatal.disarm()
        print(faulthandler.is_enabled(), flush=True)
        os.abort()
    """)
    r = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                       timeout=60, cwd=ROOT, env=env_for())
    assert r.returncode == -6 and r.stdout.strip() == "True"
    assert "Fatal Python error: Aborted" in r.stderr
    assert os.listdir(tmp_path) == []
