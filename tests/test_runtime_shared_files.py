"""Lock and output files in directories other users can write to (issue 20): printflock's lock,
the output prefixer's per-destination locks, NicerTrace's trace file. A lock held for ever (by
another user, or by a stopped process) must not block a print for ever, and a symlink planted at
one of these names must never make hangdoc create or append to a file of the planter's choosing."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from tests.attacker import attacker
from tests.procs import ROOT, env_for, kill_tree

PRINTS = textwrap.dedent("""
    import sys, time, warnings
    sys.path.insert(0, {root!r})
    from hangdoc import printflock
    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(20):
            printflock("line", i)
    print("took %.2f warnings %d" % (time.monotonic() - t0, len(caught)), file=sys.stderr, flush=True)
    for w in caught:
        print("warning:", w.message, file=sys.stderr, flush=True)
    """)

HOLDER = textwrap.dedent("""
    import fcntl, os, signal, sys
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o666)
    os.fchmod(fd, 0o666)
    fcntl.flock(fd, fcntl.LOCK_EX)
    print("held", flush=True)
    if sys.argv[2] == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    signal.pause()
    """)


@pytest.fixture
def shared():
    d = tempfile.mkdtemp(prefix="hangdoc-shared-")  # like /dev/shm: sticky, everyone's
    os.chmod(d, 0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _prints(lock):
    return subprocess.run([sys.executable, "-c", PRINTS.format(root=ROOT)], capture_output=True, text=True,
                          timeout=30, env=env_for({"HANGDOC_PRINTFLOCK_LOCK": lock}))


def _prints_while_held(lock, how, prefix=()):
    """20 printflock lines while another process (``prefix``: as another user) holds ``lock``
    (``how``: "stop" stops itself holding it); (the run, seconds the prints took)."""
    holder = subprocess.Popen(list(prefix) + [sys.executable, "-c", HOLDER, lock, how], stdout=subprocess.PIPE,
                              start_new_session=True)
    try:
        assert holder.stdout.readline().strip() == b"held"
        res = _prints(lock)
    finally:
        kill_tree(holder.pid)
        holder.wait(10)
    assert res.stdout.splitlines() == [f"line {i}" for i in range(20)]
    return res, float(res.stderr.split("took ")[1].split()[0])


def test_a_lock_held_by_a_stopped_process_delays_prints_once_then_they_go_without_it(shared):
    res, took = _prints_while_held(os.path.join(shared, "pf.lock"), "stop")
    assert 0.9 <= took < 3.0, res.stderr  # one wait of LOCK_WAIT (1 s), not one per print
    assert "warnings 1" in res.stderr and "held for more than" in res.stderr, res.stderr


def test_another_user_s_lock_file_is_not_used(shared):
    uid, gid, as_attacker = attacker()
    res, took = _prints_while_held(os.path.join(shared, "pf.lock"), "hold", as_attacker)
    assert took < 0.9, res.stderr  # not even waited for
    assert "owned by uid" in res.stderr and "warnings 1" in res.stderr, res.stderr


def test_a_symlink_at_the_print_lock_creates_nothing(shared):
    uid, gid, as_attacker = attacker()
    lock, victim = os.path.join(shared, "pf.lock"), os.path.join(shared, "victim")
    made = subprocess.run(as_attacker + ["ln", "-s", victim, lock], capture_output=True, text=True, timeout=30)
    assert made.returncode == 0, made.stderr
    res = _prints(lock)
    assert res.stdout.splitlines() == [f"line {i}" for i in range(20)]
    assert not os.path.lexists(victim), "printflock created a file through a planted symlink"


PREFIXED = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    from hangdoc.runtime.prefix import prefix_output
    restore = prefix_output("[x] ")
    print("hello", flush=True)
    restore()
    """)


def _prefixed(shared, log):
    env = env_for({"HANGDOC_PRINTFLOCK_LOCK": os.path.join(shared, "pf.lock")})
    with open(log, "ab") as f:
        res = subprocess.run([sys.executable, "-c", PREFIXED.format(root=ROOT)], stdout=f, stderr=subprocess.PIPE,
                             timeout=30, env=env)
    assert res.returncode == 0, res.stderr
    st = os.stat(log)
    return os.path.join(shared, f"pf-{st.st_dev}-{st.st_ino}.lock")


def test_the_prefixer_s_destination_lock_follows_no_symlink_and_is_removed_after_use(shared, tmp_path):
    uid, gid, as_attacker = attacker()
    log = str(tmp_path / "log.txt")
    open(log, "w").close()
    st = os.stat(log)
    dest_lock, victim = os.path.join(shared, f"pf-{st.st_dev}-{st.st_ino}.lock"), os.path.join(shared, "victim")
    made = subprocess.run(as_attacker + ["ln", "-s", victim, dest_lock], capture_output=True, text=True, timeout=30)
    assert made.returncode == 0, made.stderr
    _prefixed(shared, log)
    assert open(log).read() == "[x] hello\n"
    assert not os.path.lexists(victim), "the drainer created a file through a planted symlink"
    os.unlink(dest_lock)
    # without the symlink: a lock file of its own while it writes, none left once it is done
    assert _prefixed(shared, log) == dest_lock
    deadline = time.monotonic() + 10
    while os.path.exists(dest_lock) and time.monotonic() < deadline:
        time.sleep(0.05)  # the drainer process outlives the job by a moment
    assert open(log).read() == "[x] hello\n[x] hello\n"
    assert not os.path.exists(dest_lock), "the per-destination lock file was left behind"


def test_nicertrace_never_appends_through_a_symlink_at_its_trace_file(tmp_path):
    from hangdoc.runtime import options
    from hangdoc.runtime.nicertrace import NicerTrace

    out = tmp_path / "out"
    out.mkdir()
    victim = tmp_path / "victim"
    os.symlink(victim, options.file_path("trace", str(out)))  # planted at this process's name
    tracer = NicerTrace(packages_to_include=None, out_dir=str(out))
    with pytest.raises(OSError):
        tracer.start()
    tracer.stop()
    assert not victim.exists()


def test_nicertrace_never_appends_to_another_user_s_file_at_its_trace_name():
    # a regular file, writable by all, that another user planted at this process's trace name in a
    # shared output directory: appending there would write our trace into their file
    uid, gid, as_attacker = attacker()
    out = tempfile.mkdtemp(prefix="hangdoc-shared-out-")  # pytest's tmp_path is root's alone
    os.chmod(out, 0o1777)
    try:
        _planted_trace_file_is_refused(out, uid, as_attacker)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _planted_trace_file_is_refused(out, uid, as_attacker):
    from hangdoc.runtime import options
    from hangdoc.runtime.nicertrace import NicerTrace

    planted = options.file_path("trace", out)
    made = subprocess.run(as_attacker + [sys.executable, "-c",
                                         f"import os; fd = os.open({planted!r}, os.O_WRONLY | os.O_CREAT, 0o666); "
                                         "os.fchmod(fd, 0o666); os.write(fd, b'theirs\\n')"],
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    assert os.stat(planted).st_uid == uid
    tracer = NicerTrace(packages_to_include=None, out_dir=out)
    with pytest.raises(OSError, match="owned by uid"):
        tracer.start()
    tracer.stop()
    with open(planted) as f:
        assert f.read() == "theirs\n"


def test_the_exchange_and_the_exit_verdict_read_only_fresh_regular_files_of_the_output_dir(tmp_path):
    """A link, a FIFO or an empty file named like a rank's dump in a shared output directory is
    never taken for one (the stall report and the exit verdict would open it)."""
    from hangdoc.runtime import exchange, exit_verdict

    secret = tmp_path / "secret.txt"
    secret.write_text("root only\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "stacks-n1-r0-11.txt").write_text("# hangdoc process rank=0\n")
    os.symlink(secret, out / "stacks-n1-r1-12.txt")
    os.mkfifo(out / "collectives-n1-r2-13.jsonl")
    (out / "stacks-n1-r3-14.txt").write_text("")
    (out / "stacks-n1-r4-gone.txt").write_text("# exited\n")
    since = time.time() - 60
    assert exchange.fresh_rank_files(str(out), since) == {0: [str(out / "stacks-n1-r0-11.txt")]}
    assert exit_verdict._fresh(str(out), since) == {0: [str(out / "stacks-n1-r0-11.txt")],
                                                    4: [str(out / "stacks-n1-r4-gone.txt")]}
    assert exchange.fresh_rank_files(str(out), time.time() + 60) == {}
