"""The pytest plugin with real rank processes on gloo: passing, failing, crashing and hanging
tests, run under pytest-xdist, interrupted, and checked for orphan processes afterwards.

World sizes stay at 2-3 and hang timeouts at a few seconds: each rank is a Python process that
imports torch, so these tests cost seconds, not milliseconds.
"""

from __future__ import annotations

import glob
import os
import re
import signal
import sys
import threading
import time

import pytest

pytest_plugins = ["pytester"]
torch = pytest.importorskip("torch")

import hypothesis  # noqa: E402,F401  (imported once: pytester restores sys.modules after each run)
import torch.distributed  # noqa: E402,F401

from hangdoc.testing.procs import RankProcesses, child_pids  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def plugin_args():
    from tests.test_plugin_fake import plugin_args as args

    return args()


def failure_text(result, name):
    from tests.test_plugin_fake import failure_text as text

    return text(result, name)


def processes_mentioning(text: str):
    """pids of live processes whose command line contains ``text`` (a /proc scan, no psutil)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode("utf-8", "replace")
            with open(f"/proc/{name}/stat") as f:
                state = f.read().rsplit(")", 1)[-1].split()[0]
        except OSError:
            continue
        if text in cmd and state != "Z":
            found.append((int(name), cmd))
    # A warm rank (forked from a zygote, hangdoc.testing.warm) shows the zygote's command line: it is
    # found by the pid it wrote into its run directory (pytester's in-process runs keep theirs next
    # to pytester.path, in the same base directory).
    if os.path.isdir(text):
        known = {pid for pid, _ in found}
        pattern = os.path.join(os.path.dirname(os.path.abspath(text)), "**", "hangdoc-*", "started-r*")
        for path in glob.glob(pattern, recursive=True):
            try:
                with open(path) as f:
                    pid = int(f.read().strip() or 0)
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode("utf-8", "replace")
                with open(f"/proc/{pid}/stat") as f:
                    state = f.read().rsplit(")", 1)[-1].split()[0]
            except (OSError, ValueError):
                continue
            if pid not in known and state != "Z" and "hangdoc/testing/warm.py" in cmd:
                known.add(pid)
                found.append((pid, f"{cmd} (the rank of {path})"))
    return found


def assert_no_orphans(path, grace=5.0):
    deadline = time.monotonic() + grace
    while True:
        left = processes_mentioning(str(path))
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not left, f"processes left behind: {left}"


HEADER = """
import os, time
import pytest, torch
import torch.distributed as dist
"""


@pytest.fixture
def env(monkeypatch):
    # Rank processes and xdist workers import hangdoc from this checkout.
    monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


# a fixture that depends on the rank: the ranks run in processes of their own
SHARD_CONFTEST = """
import pytest
@pytest.fixture
def shard(rank, world_size):
    return list(range(rank, 10, world_size))
"""


def test_pass_fail_crash_and_divergence_under_xdist(pytester, env):
    pytester.makeconftest(SHARD_CONFTEST)
    pytester.makepyfile(test_g=HEADER + """
@pytest.mark.world_size(2)
def test_pass(rank, world_size, shard, tmp_path):
    t = torch.ones(3) * rank
    dist.all_reduce(t)
    assert t.tolist() == [1.0, 1.0, 1.0]
    assert shard[0] == rank and dist.get_rank() == rank
    (tmp_path / "x").write_text(str(rank))

@pytest.mark.world_size(2, timeout=30)
def test_crash(rank):
    dist.all_reduce(torch.ones(2))
    if rank == 0:
        raise ValueError("boom on rank 0")
    print("rank one says goodbye", flush=True)
    os.abort()

@pytest.mark.world_size(2, timeout=30)
def test_uneven(rank):
    for _ in range(2 if rank == 0 else 1):
        dist.all_reduce(torch.ones(4))
""")
    result = pytester.runpytest(*plugin_args(), "-p", "no:cacheprovider", "-n", "2")
    result.assert_outcomes(passed=1, failed=2)
    crash = failure_text(result, "test_crash")
    # the exception headlines (with its rank), the crash after it; tracebacks in the same order
    assert crash.startswith("rank 0 failed: ValueError: boom on rank 0; rank 1 crashed (killed by SIGABRT)\n")
    assert crash.index("---- rank 0 ----") < crash.index("---- rank 1 ----")
    assert "rank 1 killed by SIGABRT before reporting a result" in crash
    assert "rank one says goodbye" in crash
    assert re.search(r'File ".*test_g.py", line 19 in test_crash', crash)  # faulthandler's stack of rank 1
    assert 'raise ValueError("boom on rank 0")' in crash and "ValueError: boom on rank 0" in crash
    assert "pluggy" not in crash
    uneven = failure_text(result, "test_uneven")
    assert uneven.startswith("collective order diverged")
    assert "rank 0 issued all_reduce #1 ([4] float32) at test_g.py:24 that rank 1 never issued" in uneven
    assert re.search(r"> #1\s+\(nothing\)\s+! all_reduce\(\[4\] float32\)\s+test_g.py:24", uneven)
    assert not (pytester.path / "hangdoc-out").exists()  # the ranks' records went to the run directory only
    assert_no_orphans(pytester.path)


@pytest.mark.parametrize("tool", ["py-spy", "faulthandler"])
def test_hang_is_dumped_diagnosed_and_killed(pytester, env, monkeypatch, tool):
    import shutil

    if tool == "py-spy" and shutil.which("py-spy") is None:
        pytest.skip("py-spy is not installed")
    if tool == "faulthandler":  # no py-spy on PATH: the ranks dump themselves
        path = os.environ["PATH"].split(os.pathsep)
        while shutil.which("py-spy", path=os.pathsep.join(path)):
            found = os.path.dirname(shutil.which("py-spy", path=os.pathsep.join(path)))
            path = [d for d in path if os.path.abspath(d or ".") != os.path.abspath(found)]
        monkeypatch.setenv("PATH", os.pathsep.join(path))
    pytester.makepyfile(test_h=HEADER + """
def load_next_batch():
    time.sleep(120)

@pytest.mark.world_size(2)
def test_hang(rank):
    dist.all_reduce(torch.ones(4))
    if rank == 0:
        dist.broadcast(torch.ones(8), src=0)
    else:
        load_next_batch()
""")
    t0 = time.monotonic()
    result = pytester.runpytest(*plugin_args(), "-p", "no:cacheprovider", "--hangdoc-timeout", "3")
    took = time.monotonic() - t0
    result.assert_outcomes(failed=1)
    text = failure_text(result, "test_hang")
    assert text.startswith("collective order diverged; hang: ranks 0-1 did not finish within 3 s (world size 2, gloo backend)")
    # the divergence: rank 1 never issued the broadcast rank 0 is stuck in
    assert "process group default_pg (ranks 0-1): " in text
    assert "broadcast #1 ([8] float32, src=0) at test_h.py:12" in text
    assert re.search(r"> #1\s+.*broadcast\(\[8\] float32, src=0\)\s+test_h.py:12 test_hang\s+\[never completed\]", text)
    # the aggregator's verdict over the stacks taken from both ranks
    assert f"hangdoc verdict (stacks of ranks 0-1 with {tool}):" in text
    assert re.search(r"load_next_batch \(\S*test_h.py:6\)", text)
    assert re.search(r"test_hang \(\S*test_h.py:12\)", text) and re.search(r"test_hang \(\S*test_h.py:14\)", text)
    assert "dump_for_parent" not in text  # the rank's guard thread is left out
    # no other thread of the rank is shown: at most the note on hangdoc's own (its SIGTERM watcher)
    others = text.split("Other threads (grouped by stack)", 1)[1].split("\n\n", 1)[0] if "Other threads" in text else ""
    assert all(line.strip().startswith("(hangdoc's own:") for line in others.strip().splitlines()[1:]), others
    assert "pluggy" not in text  # pytest's own frames are left out of the stacks
    assert took < 60
    assert_no_orphans(pytester.path)


def test_keyboard_interrupt_kills_every_rank(pytester, env):
    pytester.makepyfile(test_i=HEADER + """
@pytest.mark.world_size(2, timeout=60)
def test_wait(rank):
    if rank == 0:
        dist.barrier()
    time.sleep(60)
""")
    import _thread

    seen = []

    def interrupt_when_started():
        # pytester's in-process runs keep their basetemp somewhere next to pytester.path
        pattern = str(pytester.path.parent / "**" / "hangdoc-test_wait*" / "started-r*")
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            # ("current" symlinks show each file more than once)
            if len({os.path.basename(p) for p in glob.glob(pattern, recursive=True)}) == 2:
                time.sleep(0.3)
                seen.extend(processes_mentioning(str(pytester.path)))
                _thread.interrupt_main()
                return
            time.sleep(0.1)

    t = threading.Thread(target=interrupt_when_started, daemon=True)
    t.start()
    reprec = pytester.inline_run(*plugin_args(), "-p", "no:cacheprovider", no_reraise_ctrlc=True)
    t.join(5)
    assert reprec.ret == pytest.ExitCode.INTERRUPTED
    assert len(seen) == 2  # both ranks were running (and found by the scan) when interrupted
    assert_no_orphans(pytester.path, grace=2.0)


def test_rank_processes_die_with_their_parent(tmp_path):
    """The control pipe's EOF (the parent died, however it died) kills the rank and its children."""
    marker = str(tmp_path / "marker")
    code = (
        "import os, subprocess, sys, time\n"
        "from hangdoc.testing.procs import CONTROL_FD_ENV, start_guard\n"
        "start_guard(int(os.environ[CONTROL_FD_ENV]), lambda: None)\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}])\n"
        "time.sleep(60)\n"
    )
    env = {"PYTHONPATH": ROOT}
    ranks = RankProcesses([[sys.executable, "-c", code, marker]] * 2, [env, env], log_dir=str(tmp_path))
    try:
        deadline = time.monotonic() + 30
        while len(processes_mentioning(marker)) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(processes_mentioning(marker)) == 4, ranks.output(0)
        assert all(child_pids(p.pid) for p in ranks.procs)
        for fd in ranks._control:  # what the kernel does when the parent dies
            os.close(fd)
        ranks._control = [-1, -1]
        for p in ranks.procs:
            p.wait(timeout=10)
        assert [p.returncode for p in ranks.procs] == [-signal.SIGKILL] * 2
        assert_no_orphans(marker, grace=5.0)
    finally:
        ranks.kill_all()


RAISE = HEADER + """
def check(shard):
    raise ValueError(f"bad shard {shard}")

@pytest.mark.world_size(2, timeout=30)
def test_raise(rank):
    dist.all_reduce(torch.ones(2))
    if rank == 1:
        check(rank)
    dist.all_reduce(torch.ones(2))      # rank 0 waits here for rank 1, which raised
"""


def test_rank_raises_short_traceback_headlines_before_the_collectives(pytester, env):
    pytester.makepyfile(test_r=RAISE)
    result = pytester.runpytest(*plugin_args(), "-p", "no:cacheprovider", "--tb=short", "-rf")
    result.assert_outcomes(failed=1)
    text = failure_text(result, "test_raise")
    # rank 1's exception is the news; rank 0 failed after it (its peer was gone), and the records
    # only say that rank 1 stopped early: no "collective order diverged" in front of the exception
    assert text.startswith("rank 1 failed: ValueError: bad shard 1")
    assert "collective order diverged" not in text
    assert text.index("---- rank 1 ----") < text.index("---- rank 0 ----")
    # the rank's traceback in pytest's short style, as the parent was asked for
    assert re.search(r"---- rank 1 ----\ntest_r.py:12: in test_raise\n    check\(rank\)\n"
                     r"test_r.py:6: in check\n    raise ValueError\(f\"bad shard \{shard\}\"\)\nE   ValueError: bad shard 1\n",
                     text)
    assert "def check" not in text and "rank = 1" not in text  # the long style's source and arguments
    result.stdout.fnmatch_lines(["FAILED test_r.py::test_raise - rank 1 failed: ValueError: bad shard 1*"])
    assert_no_orphans(pytester.path)


def test_rank_tracebacks_with_tb_line(pytester, env):
    pytester.makepyfile(test_r=RAISE)
    out = pytester.runpytest(*plugin_args(), "-p", "no:cacheprovider", "--tb=line").stdout.str()
    body = out[out.index("= FAILURES ="):out.index("short test summary")]
    assert "---- rank" not in body and "def check" not in body and "plugin.py" not in body
    # one line per rank, then pytest's crash line at the raising line, with the headline
    assert re.search(r"\nrank 1: \S*test_r.py:6: ValueError: bad shard 1\n", body)
    assert re.search(r"\n\S*test_r.py:6: rank 1 failed: ValueError: bad shard 1(; then rank 0 failed \(\w+\))?\n", body)
    assert len([ln for ln in body.splitlines()[1:] if ln.strip() and not ln.startswith("=")]) <= 3


def test_hung_fake_rank_processes_are_reported_and_killed(pytester, env):
    """The fake backend in rank processes (a fixture depends on the rank) honours the timeout too."""
    pytester.makeconftest(SHARD_CONFTEST)
    pytester.makepyfile(test_fh=HEADER + """
def load_next_batch():
    time.sleep(120)

@pytest.mark.world_size(2, backend="fake", timeout=5)
def test_fake_hang(rank, shard):
    dist.all_reduce(torch.ones(2))
    if rank == 1:
        load_next_batch()
    dist.all_reduce(torch.ones(2))
""")
    t0 = time.monotonic()
    result = pytester.runpytest(*plugin_args(), "-p", "no:cacheprovider")
    assert time.monotonic() - t0 < 60
    result.assert_outcomes(failed=1)
    text = failure_text(result, "test_fake_hang")
    # (5 s: with 2 s, rank 0 alone did not finish in time once, two test processes on 2 busy cores)
    assert text.startswith("hang: rank 1 did not finish within 5 s (world size 2, fake backend); rank 0 finished")
    assert re.search(r"load_next_batch \(\S*test_fh.py:6\)", text)  # where rank 1 was
    # the fake group completed rank 0's call at once; the aggregator must not call it an extra one
    assert "rank 0 waits in all_reduce #1 (test_fh.py:13) for rank 1, which is behind" in text
    assert "extra" not in text
    assert_no_orphans(pytester.path)
