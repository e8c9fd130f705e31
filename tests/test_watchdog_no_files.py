"""The diagnosis when files or the store fail (issue 20): a real 2-rank gloo job hangs (one rank
skips a broadcast) with an output directory that is a file, on a full file system, or with the
store's host (torchrun) dead. The watchdog, the recorder and the exchange need no files, and a dead
store hands over to the files at once: the verdict is printed all the same, naming the rank."""

import contextlib
import importlib.util
import os
import shutil
import subprocess
import time

import pytest

from hangdoc import examples
from hangdoc.cli.demo import stop_job
from hangdoc.proctree import alive, descendants, kill_tree
from tests.test_watchdog_job import Job
from tests.procs import torchrun_cmd

if importlib.util.find_spec("torch") is None:
    pytest.skip("torch is not installed", allow_module_level=True)


@contextlib.contextmanager
def small_tmpfs(mnt, what):
    """A 64 KiB tmpfs mounted at ``mnt`` with an ``out`` directory in it, unmounted afterwards
    (mount needs root and a container that allows it: the test is skipped otherwise)."""
    mnt.mkdir()
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip(f"{what} is made with mount -t tmpfs, which needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"mount -t tmpfs not allowed here: {r.stderr.strip()}")
    try:
        (mnt / "out").mkdir()
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.fixture
def full_fs(tmp_path):
    """A 64 KiB tmpfs filled to the last byte."""
    with small_tmpfs(tmp_path / "full", "a full file system") as mnt:
        fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            while os.write(fd, b"\0" * 512):
                pass
        except OSError:  # ENOSPC: full
            pass
        finally:
            os.close(fd)
        yield str(mnt / "out")


def _verdict(tmp_path, out):
    job = Job(torchrun_cmd(2, "hangdoc", "--hang-timeout", "2", "--out", out,
                           examples.copy_to("skip_broadcast", str(tmp_path / "job")), module=True))
    try:
        assert job.wait_for(r"hangdoc: full report:", 60), job.log
        time.sleep(0.3)
        job.before_stop = list(job.lines)  # torchrun prints a traceback of its own when stopped
    finally:
        pids = stop_job(job.proc)
    assert not [p for p in pids if alive(p)]
    verdicts = [line for line in job.lines if "hangdoc: VERDICT:" in line]
    assert len(verdicts) == 1, job.log
    assert "dumps from ranks 0-1 of 2" in job.log, job.log
    assert any("culprit: rank 1" in line for line in job.lines), job.log
    assert any("full report: not written" in line for line in job.lines), job.log
    return job


def test_an_output_directory_that_is_a_file_still_gives_the_verdict(tmp_path):
    out = tmp_path / "not-a-dir"
    out.write_text("")
    job = _verdict(tmp_path, str(out))
    assert any("running without files" in line for line in job.lines), job.log


def test_a_full_disk_still_gives_the_verdict(tmp_path, full_fs):
    job = _verdict(tmp_path, full_fs)
    assert any("kept in memory for the report" in line for line in job.lines), job.log
    assert not any("Traceback" in line or "OSError" in line for line in job.before_stop), job.log


def test_the_store_s_host_dead_gives_the_verdict_from_files_at_the_first_dump(tmp_path):
    """torchrun serves the store; killed, every store operation fails at once (a broken pipe): the
    ranks' files take over then, not at the watchdog's re-dump 4x the stall later."""
    import re
    import signal

    out = str(tmp_path / "out")
    job = Job(torchrun_cmd(2, "hangdoc", "--hang-timeout", "2", "--out", out,
                           examples.copy_to("skip_broadcast", str(tmp_path / "job")), module=True))
    ranks = []
    try:
        assert job.wait_for(r"PROGRESS rank=1 step=1 ", 60), job.log
        time.sleep(0.3)
        ranks = descendants(job.proc.pid)  # found now: orphaned, they are nobody's descendants
        os.kill(job.proc.pid, signal.SIGKILL)  # the ranks live on, in sessions of their own
        deadline = time.monotonic() + 30  # (job.wait_for stops at the launcher's exit)
        while not any("hangdoc: full report:" in line for line in job.lines) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert any("hangdoc: full report:" in line for line in job.lines), job.log
    finally:
        pids = stop_job(job.proc)
        for pid in ranks:
            kill_tree(pid)
        job.proc.wait(10)
    time.sleep(0.2)
    assert len(ranks) >= 2 and not [p for p in pids + ranks if alive(p)]
    hang = [line for line in job.lines if "hangdoc: HANG:" in line]
    assert len(hang) == 1 and "dumps from ranks 0-1 of 2" in hang[0], job.log
    # the first dump comes 2 s into the stall, the re-dump at 8 s: the verdict is the first's
    assert float(re.search(r"no progress for ([\d.]+)s", hang[0]).group(1)) < 6.0, job.log
    assert any("culprit: rank 1" in line for line in job.lines), job.log
    assert not any("report failed" in line for line in job.lines), job.log


@pytest.fixture
def read_only_dir(tmp_path):
    """An existing output directory on a file system mounted read-only (root writes through a mode
    of 0555, not through a read-only mount)."""
    with small_tmpfs(tmp_path / "ro", "a read-only file system") as mnt:
        r = subprocess.run(["mount", "-o", "remount,ro", str(mnt)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"remount,ro not allowed here: {r.stderr.strip()}")
        with pytest.raises(OSError):
            (mnt / "out" / "probe").write_text("x")
        yield str(mnt / "out")


def test_a_read_only_output_directory_still_gives_the_verdict(tmp_path, read_only_dir):
    job = _verdict(tmp_path, read_only_dir)
    assert any("kept in memory for the report" in line or "running without files" in line for line in job.lines), job.log
    assert not any("Traceback" in line or "OSError" in line for line in job.before_stop), job.log
    assert os.listdir(read_only_dir) == []
