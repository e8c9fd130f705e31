"""The diagnosis when no file can be written (issue 20): a real 2-rank gloo job hangs (one rank skips
a broadcast) with an output directory that is a file, or on a full file system. The watchdog, the
recorder and the exchange need no files: the verdict is printed all the same, naming the rank."""

import importlib.util
import os
import shutil
import subprocess
import time

import pytest

from hangdoc import examples
from hangdoc.cli.demo import stop_job
from hangdoc.proctree import alive
from tests.test_watchdog_job import Job
from tests.procs import torchrun_cmd

if importlib.util.find_spec("torch") is None:
    pytest.skip("torch is not installed", allow_module_level=True)


@pytest.fixture
def full_fs(tmp_path):
    """A 64 KiB tmpfs filled to the last byte (mount needs root and a container that allows it)."""
    mnt = tmp_path / "full"
    mnt.mkdir()
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("a full file system is made with mount -t tmpfs, which needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"mount -t tmpfs not allowed here: {r.stderr.strip()}")
    try:
        (mnt / "out").mkdir()
        fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            while os.write(fd, b"\0" * 512):
                pass
        except OSError:  # ENOSPC: full
            pass
        finally:
            os.close(fd)
        yield str(mnt / "out")
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


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
