"""``hangdoc dump`` on real processes: py-spy, the watchdog-signal fallback, unresponsive and stopped ones."""

import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time

import pytest

from hangdoc.tags import parse_tag

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TARGET = textwrap.dedent(
    """
    import sys, threading, time
    sys.path.insert(0, {root!r})
    if {wrapped!r}:
        from hangdoc.runtime import watchdog
        watchdog.start(600, out_dir={out!r}, record=False, report=False)

    def waiting_for_godot():
        threading.Event().wait()

    if {save_restore!r}:
        import signal
        # the job sets a handler of its own and puts the old one back: the action is the default
        # again (SIGUSR1 would end it), while the watchdog's signal file keeps its usual name
        signal.signal(signal.SIGUSR1, signal.signal(signal.SIGUSR1, lambda *a: None))
    if {fork!r}:
        import os
        if os.fork() == 0:
            waiting_for_godot()  # a worker forked by the rank, with the rank's environment
    print("ready", flush=True)
    waiting_for_godot()
    """
)


@pytest.fixture
def target(tmp_path):
    started = []

    def start(wrapped=False, env=None, fork=False, save_restore=False):
        code = TARGET.format(root=ROOT, wrapped=wrapped, out=str(tmp_path / "out"), fork=fork, save_restore=save_restore)
        full_env = dict(os.environ, **(env or {}))
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True, env=full_env)
        started.append(p)
        assert p.stdout.readline().strip() == b"ready"
        return p

    yield start
    for p in started:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except OSError:
            pass
        p.wait(timeout=10)


def _dump(*args, timeout=60):
    p = subprocess.run([sys.executable, "-m", "hangdoc", "dump", *args], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, timeout=timeout, cwd=ROOT)
    return p


def _blocks(text):
    """(tag fields, body) per process block."""
    out = []
    for line in text.splitlines():
        fields = parse_tag(line)
        if fields is not None:
            out.append([fields, []])
        elif out:
            out[-1][1].append(line)
    return [(f, "\n".join(b)) for f, b in out]


needs_pyspy = pytest.mark.skipif(shutil.which("py-spy") is None, reason="py-spy not installed")


@needs_pyspy
def test_pyspy_dump_tags_rank_from_the_process_environment(target):
    p = target(env={"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8"})
    r = _dump("--pid", str(p.pid), "-o", "-")
    assert r.returncode == 0, r.stderr
    (fields, body), = _blocks(r.stdout)
    assert fields["pid"] == str(p.pid) and fields["rank"] == "5" and fields["local_rank"] == "1"
    assert fields["world_size"] == "8" and fields["ppid"] == str(os.getpid())
    assert "status" not in fields
    assert "waiting_for_godot" in body and "Thread" in body


def test_signal_fallback_reads_faulthandler_of_a_wrapped_process(target):
    p = target(wrapped=True)
    r = _dump("--pid", str(p.pid), "--py-spy", "/bin/false", "--no-gdb", "-o", "-")
    assert r.returncode == 0, r.stderr
    (fields, body), = _blocks(r.stdout)
    assert fields["dumper"] == "signal"
    assert "waiting_for_godot" in body and "most recent call first" in body
    assert p.poll() is None  # the signal did not kill it


def test_the_signal_is_not_sent_where_it_would_end_the_process(target):
    """faulthandler's handler replaced and the default action put back (signal.signal twice): the
    kernel's SigCgt says SIGUSR1 is no longer caught; sending it would kill the rank."""
    p = target(wrapped=True, save_restore=True)
    r = _dump("--pid", str(p.pid), "--py-spy", "/bin/false", "--no-gdb", "-o", "-")
    assert "SIGUSR1 has no handler in the process (it would end it)" in r.stdout + r.stderr, (r.stdout, r.stderr)
    time.sleep(0.2)
    assert p.poll() is None  # still alive


def test_unresponsive_process_is_recorded_with_the_reason(target, tmp_path):
    p = target()
    hung_pyspy = tmp_path / "py-spy"
    hung_pyspy.write_text("#!/bin/sh\nexec sleep 30\n")
    hung_pyspy.chmod(hung_pyspy.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "trace.out"
    t0 = time.monotonic()
    r = _dump("--pid", str(p.pid), "--py-spy", str(hung_pyspy), "--no-gdb", "--timeout", "1", "-o", str(out))
    assert time.monotonic() - t0 < 15
    assert r.returncode == 1
    assert "1 unresponsive" in r.stderr
    (fields, body), = _blocks(out.read_text())
    assert fields["status"] == "unresponsive"
    assert fields["reason"] == "py-spy_timed_out_after_1s"
    assert body.strip() == "Error: py-spy timed out after 1s"
    from hangdoc.readers import read_paths

    (proc,) = read_paths([str(out)]).processes
    assert (proc.pid, proc.status) == (p.pid, "unresponsive") and "timed out" in proc.status_detail


@needs_pyspy
def test_forked_worker_is_tagged_as_the_ranks_worker(target):
    p = target(env={"RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "4"}, fork=True)
    r = _dump("--pid", str(p.pid), "-o", "-")
    assert r.returncode == 0, r.stderr
    (rank, _), (worker, body) = _blocks(r.stdout)
    assert rank["rank"] == "2" and rank["role"] == "rank"
    assert worker["role"] == "dataloader-worker" and worker["parent_rank"] == "2" and "rank" not in worker
    assert worker["ppid"] == rank["pid"] and "waiting_for_godot" in body


@needs_pyspy
def test_stopped_process_is_marked_and_still_dumped(target):
    p = target()
    os.kill(p.pid, signal.SIGSTOP)
    try:
        r = _dump("--pid", str(p.pid), "--timeout", "5", "-o", "-")
    finally:
        os.kill(p.pid, signal.SIGCONT)
    (fields, body), = _blocks(r.stdout)
    assert fields["status"] == "stopped" and fields["reason"].startswith("state_")
    assert "waiting_for_godot" in body


def test_no_process_is_exit_2():
    r = _dump("--pid", "999999999")
    assert r.returncode == 2 and "no process" in r.stderr


def test_the_output_prefixer_s_drainer_is_not_dumped_as_part_of_the_job(tmp_path):
    """A wrapped job's output goes through hangdoc's drainer process (its own, no rank): hangdoc dump
    must not list it as a second, rank-less process of the job."""
    from hangdoc import collect

    (tmp_path / "job.py").write_text("import time\nprint('ready', flush=True)\ntime.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-m", "hangdoc", "job.py"], cwd=str(tmp_path), stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        assert p.stdout.readline().endswith("ready\n")
        drainers = [pid for pid in collect.all_pids()
                    if (info := collect.describe(pid)) is not None and any("hangdoc_prefix_drainer" in a for a in info.cmdline)]
        assert drainers, "the job runs no drainer: prefixing changed, this test must too"
        found = {i.pid for i in collect.find_processes()}
        assert p.pid in found and not set(drainers) & found
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=10)


def test_py_spy_beside_the_interpreter_is_found_without_path(monkeypatch):
    """A venv's py-spy (``pip install py-spy``) sits beside its python; ``venv/bin/python -m hangdoc
    dump`` from a script or cron often has no venv on PATH, and gdb's stacks lose thread names."""
    beside = os.path.join(os.path.dirname(os.path.abspath(sys.executable)), "py-spy")
    if not os.path.isfile(beside):
        pytest.skip("no py-spy beside this interpreter")
    from hangdoc import collect

    monkeypatch.setenv("PATH", "/nonexistent")
    assert collect.find_pyspy() == beside
