"""``hangdoc dump`` on a shared node (issue 20): what a process (or another user) controls must not
reach root's dump as anything but data. Real processes; the attack runs as a second user."""

import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time

import pytest

from hangdoc.readers import read_paths
from tests.attacker import attacker, attacker_dir
from tests.procs import ROOT, env_for, kill_tree

# A process of another user that looks hangdoc-wrapped (a signal file open, a SIGUSR1 handler) and,
# when signalled, swaps a symlink to root's secret in at the signal file's name.
SWAPPER = textwrap.dedent(
    """
    import os, signal, sys, time
    d, secret = sys.argv[1], sys.argv[2]
    name = os.path.join(d, "hangdoc-signal-%d-SIGUSR1-x.txt" % os.getpid())
    f = open(name, "w+b")
    def swap(*_):
        os.unlink(name)
        os.symlink(secret, name)
    signal.signal(signal.SIGUSR1, swap)
    print("ready", flush=True)
    while True:
        time.sleep(1)
    """
)


def _dump(*args):
    return subprocess.run([sys.executable, "-m", "hangdoc", "dump", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=env_for())


def test_root_dump_never_reads_a_file_swapped_in_at_the_signal_file_and_writes_0600(tmp_path):
    uid, gid, as_attacker = attacker()
    secret = tmp_path / "secret"
    secret.write_text("TOPSECRET-4242\n" * 4)
    secret.chmod(0o600)
    d = attacker_dir(uid, gid)
    p = subprocess.Popen(as_attacker + [sys.executable, "-c", SWAPPER, d, str(secret)], stdout=subprocess.PIPE,
                         start_new_session=True, cwd=d)
    try:
        assert p.stdout.readline().strip() == b"ready"
        out = tmp_path / "trace.out"
        r = _dump("--pid", str(p.pid), "--py-spy", "/bin/false", "--no-gdb", "-o", str(out))
        text = out.read_text()
        assert "TOPSECRET" not in text, text
        assert "TOPSECRET" not in r.stdout + r.stderr
        assert f"pid={p.pid}" in text  # the process is in the dump, as unresponsive
        assert stat.S_IMODE(os.stat(out).st_mode) == 0o600
    finally:
        kill_tree(p.pid)
        p.wait(10)
        shutil.rmtree(d, ignore_errors=True)


# A wrapped rank whose environment and code try to forge tag lines: HANGDOC_HOST and SLURM_JOB_ID
# with a newline, and a function from a "file" whose name holds a newline (faulthandler prints it).
FORGER = textwrap.dedent(
    """
    import sys, threading
    sys.path.insert(0, {root!r})
    from hangdoc.runtime import watchdog
    watchdog.start(600, out_dir={out!r}, record=False, report=False)
    code = compile("import threading\\ndef wait():\\n    threading.Event().wait()\\n",
                   "x.py\\n# hangdoc process host=forged3 pid=3 rank=1 world_size=2\\n", "exec")
    ns = {{}}
    exec(code, ns)
    print("ready", flush=True)
    ns["wait"]()
    """
)


def test_no_process_input_forges_a_tag_line_in_root_s_dump_or_the_watchdog_s(tmp_path):
    out_dir = tmp_path / "out"
    env = env_for({"RANK": "0", "WORLD_SIZE": "2",
                   "HANGDOC_HOST": "n1\n# hangdoc process host=forged1 pid=1 rank=1 world_size=2",
                   "SLURM_JOB_ID": "7\n# hangdoc process host=forged2 pid=2 rank=1 world_size=2"})
    p = subprocess.Popen([sys.executable, "-c", FORGER.format(root=ROOT, out=str(out_dir))], stdout=subprocess.PIPE,
                         start_new_session=True, env=env)
    try:
        assert p.stdout.readline().strip() == b"ready"
        dump = tmp_path / "trace.out"
        _dump("--pid", str(p.pid), "--py-spy", "/bin/false", "--no-gdb", "-o", str(dump))
        assert "forged3" in dump.read_text()  # the signal dump was taken, the file name is in it
        deadline = time.monotonic() + 10
        while not list(out_dir.glob("stacks-*")) and time.monotonic() < deadline:
            time.sleep(0.1)  # the watchdog writes its own dump of the signal too
        stacks = list(out_dir.glob("stacks-*"))
        assert stacks
        for path in [dump] + stacks:
            job = read_paths([str(path)])
            hosts = sorted({pr.host for pr in job.processes})
            assert len(job.processes) == 1, (path, hosts, path.read_text()[:2000])
            assert not any("forged" in (h or "").split("\n")[0] for h in hosts), hosts
            assert job.processes[0].pid == p.pid and job.processes[0].rank == 0
    finally:
        kill_tree(p.pid)
        p.wait(10)


# An argv that py-spy prints as it is: lines that read as tags only once the readers have dropped
# the escape sequences and NULs in them (a colour reset, an OSC title spanning a line break, an
# escape nested in an escape), and a section header.
ESCAPED_FORGERIES = "\n".join([
    "a",
    "#\x1b[0m hangdoc process host=forgedA pid=9 rank=1 world_size=2",
    "#\x1b]0;title\n\x07 hangdoc process host=forgedB pid=8 rank=1 world_size=2",
    "#\x1b\x1b[0m[0m hangdoc process host=forgedC pid=7 rank=1 world_size=2",
    "#\x1b]8;;\x1b\\ hangdoc exited host=forgedD pid=6 rank=1 reason=exited",
    "\x1b[31m#\x9b0m hangdoc process host=forgedE pid=5 rank=1 world_size=2",
    "=== Rank 5: forgedF:1 ===",  # torch's debug-server section header: the lines after it would be rank 5's
])


def test_escape_sequences_in_argv_forge_no_tag_line_in_a_py_spy_dump(tmp_path):
    py_spy = os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.access(py_spy, os.X_OK):
        pytest.skip("py-spy is not installed next to this Python")
    p = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(600)",
                          ESCAPED_FORGERIES], stdout=subprocess.PIPE, start_new_session=True, env=env_for())
    try:
        assert p.stdout.readline().strip() == b"ready"
        out = tmp_path / "trace.out"
        r = _dump("--pid", str(p.pid), "--py-spy", py_spy, "--no-gdb", "-o", str(out))
        text = out.read_text()
        assert r.returncode == 0 and "forgedA" in text and "Thread" in text, (r.stderr, text)  # py-spy's dump
        job = read_paths([str(out)])
        got = [(pr.host, pr.pid, pr.rank, pr.status) for pr in job.processes]
        assert len(job.processes) == 1, (got, text)
        assert job.processes[0].pid == p.pid and job.processes[0].status == "ok", (got, text)
        assert not any("forged" in str(pr.host) for pr in job.processes), got
    finally:
        kill_tree(p.pid)
        p.wait(10)
