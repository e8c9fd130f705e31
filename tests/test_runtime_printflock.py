"""printflock: whole lines under load (32 processes x 10,000 lines, pipe and file; a torchrun job)."""

from __future__ import annotations

import io
import os
import re
import sys
import textwrap
import warnings

import pytest
from hypothesis import given, settings, strategies as st

from tests.procs import ROOT, run, torchrun_cmd


def test_32_processes_to_a_shared_pipe_and_file():
    # 32 processes x 2,000 lines of ~200 chars per target. The full 32 x 10,000 takes
    # 7-17 s on two shared cores; it is `python benchmarks/stress_printflock.py` (the default).
    res = run([sys.executable, os.path.join(ROOT, "benchmarks", "stress_printflock.py"),
               "--procs", "32", "--lines", "2000", "--timeout", "120"], timeout=240)
    assert not res.timed_out
    results = re.findall(r"printflock (pipe|file) 32 procs x 2000 lines: (\d+) whole, (\d+) torn, (\d+) lost, (\d+) duplicated",
                         res.stdout)
    assert sorted(r[0] for r in results) == ["file", "pipe"], res.stdout + res.stderr
    for target, whole, torn, lost, dup in results:
        assert (int(whole), int(torn), int(lost), int(dup)) == (64_000, 0, 0, 0), (target, res.stdout)
    assert res.returncode == 0


def test_the_stress_check_detects_torn_lines():
    # The checker itself must be able to fail: plain print tears lines under the same load.
    res = run([sys.executable, os.path.join(ROOT, "benchmarks", "stress_printflock.py"),
               "--procs", "8", "--lines", "2000", "--target", "file", "--mode", "print"], timeout=120)
    torn = int(re.search(r"(\d+) torn", res.stdout).group(1))
    assert torn > 0 and res.returncode == 1, res.stdout


JOB = textwrap.dedent('''\
    import os, sys
    import torch.distributed as dist
    from hangdoc import printflock as print
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dist.barrier()
    for i in range(1500):
        # 6,000 chars: bigger than PIPE_BUF, so only the lock keeps lines whole
        print(f"R{rank} L{i:05d} " + chr(97 + rank) * 6000, "|", sep="")
    print(f"R{rank} to stderr", file=sys.stderr)
    dist.barrier()
    dist.destroy_process_group()
    ''')


def test_torchrun_ranks_printing_long_lines_stay_whole(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    res = run(torchrun_cmd(4, "-m", "hangdoc", "--no-prefix", str(script)), timeout=120)
    assert res.returncode == 0 and not res.timed_out, res.stderr[-3000:]
    seen = set()
    for line in res.stdout.splitlines():
        m = re.fullmatch(r"R(\d) L(\d{5}) ([a-d]{6000})\|", line)
        assert m and set(m.group(3)) == {chr(97 + int(m.group(1)))}, line[:80]
        seen.add((int(m.group(1)), int(m.group(2))))
    assert seen == {(r, i) for r in range(4) for i in range(1500)}
    assert {f"R{r} to stderr" for r in range(4)} <= set(res.stderr.splitlines())


@settings(max_examples=200, deadline=None)
@given(
    args=st.lists(st.one_of(st.text(), st.integers(), st.floats(allow_nan=False)), max_size=5),
    sep=st.one_of(st.none(), st.text(max_size=3)),
    end=st.one_of(st.none(), st.text(max_size=3)),
)
def test_same_output_as_print(args, sep, end):
    from hangdoc import printflock

    ours, theirs = io.StringIO(), io.StringIO()
    printflock(*args, sep=sep, end=end, file=ours)
    print(*args, sep=sep, end=end, file=theirs)
    assert ours.getvalue() == theirs.getvalue()


def test_to_a_real_file_descriptor(tmp_path):
    from hangdoc import printflock

    with open(tmp_path / "out.txt", "w") as f:
        f.write("buffered first\n")  # still in the stream's buffer: must come out before ours
        printflock("ünïcode", 1, flush=True, file=f)
    assert (tmp_path / "out.txt").read_text() == "buffered first\nünïcode 1\n"


def test_degrades_with_one_warning_where_flock_is_unavailable(monkeypatch, tmp_path):
    import errno

    from hangdoc.runtime import printflock as mod

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(mod, "_disabled", False)
    monkeypatch.setattr(mod, "_lock_fd", None)
    monkeypatch.setattr(mod.fcntl, "flock", no_flock)
    monkeypatch.setenv("HANGDOC_PRINTFLOCK_LOCK", str(tmp_path / "lock"))
    buf = io.StringIO()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mod.printflock("one", file=buf)
        mod.printflock("two", file=buf)
    assert buf.getvalue() == "one\ntwo\n"
    assert len(caught) == 1 and "flock unavailable" in str(caught[0].message)


def test_lock_file_is_node_local_and_per_user(monkeypatch):
    from hangdoc.runtime.printflock import lock_path

    monkeypatch.delenv("HANGDOC_PRINTFLOCK_LOCK", raising=False)
    path = lock_path()
    assert path.startswith(("/dev/shm/", "/tmp/")) and str(os.getuid()) in os.path.basename(path)
    assert not path.startswith(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
