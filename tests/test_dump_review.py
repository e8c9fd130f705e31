"""``hangdoc dump`` on real processes, the cases a review found wrong: who is a launcher, the gdb
fallback read back, processes that exit while they are dumped, ``torch.multiprocessing.spawn``
ranks, an output file that cannot be written, a dumper that hangs.

Every process is started with ``procs.spawn`` (own session, whole tree killed at teardown) and every
wait has a deadline.
"""

from __future__ import annotations

import os
import select
import shutil
import stat
import subprocess
import sys
import textwrap
import time

import pytest

from hangdoc.analysis.diagnose import diagnose
from hangdoc.analysis.grouping import build_report
from hangdoc import collect
from hangdoc import tags as tagline
from hangdoc.readers import read_paths, read_text
from hangdoc.tags import parse_tag
from tests.procs import ROOT, torchrun_cmd

PYSPY = shutil.which("py-spy")
needs_pyspy = pytest.mark.skipif(PYSPY is None, reason="py-spy not installed")

WAITER = textwrap.dedent(
    """
    import os, sys, threading, time

    def background():
        time.sleep(600)

    def waiting_for_godot():
        threading.Event().wait(600)

    threading.Thread(target=background, name="bg", daemon=True).start()
    print("ready", os.getpid(), flush=True)
    waiting_for_godot()
    """
)


def _wait_for(proc, needle, timeout=60.0):
    """``proc``'s stdout lines so far, once one of them contains ``needle``; fails after ``timeout``."""
    deadline = time.monotonic() + timeout
    fd = proc.stdout.fileno()
    seen = getattr(proc, "seen", "")
    while needle not in seen and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            chunk = os.read(fd, 65536).decode("utf-8", "replace")
            if not chunk:
                break
            seen += chunk
    proc.seen = seen
    if needle not in seen:
        raise AssertionError(f"no {needle!r} from pid {proc.pid} within {timeout}s; got {seen!r}")
    return seen.splitlines()


def _dump(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "hangdoc", "dump", *args], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, timeout=timeout, cwd=ROOT)


def _tags(text):
    return {int(f["pid"]): f for f in (parse_tag(line) for line in text.splitlines()) if f is not None}


def _script(path, text=WAITER):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def _executable(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


# -- 1. the launcher is what is executed, not a substring of the command line ----------------------

FAKE_LAUNCHER = textwrap.dedent(
    """
    import os, subprocess, sys, time
    # stands for torchrun / accelerate launch: starts one rank with its own RANK, then waits
    child = subprocess.Popen([sys.executable, {script!r}], env=dict(os.environ, RANK="1", LOCAL_RANK="1", WORLD_SIZE="2"))
    print("ready", os.getpid(), flush=True)
    child.wait(600)
    """
)


@pytest.mark.parametrize("cmdline, expected", [
    (["python", "/home/u/accelerate/train.py"], None),
    (["/usr/bin/python3", "-u", "/work/torchrun-exps/train.py", "--lr", "1"], None),
    (["python", "/x/deepspeed.launcher/train.py"], None),
    (["python", "-c", "from multiprocessing.spawn import spawn_main; spawn_main()", "--multiprocessing-fork"], None),
    (["python", "torchrun.py"], None),
    (["python", "/venv/bin/accelerate", "config"], None),
    (["/venv/bin/python3", "/venv/bin/torchrun", "--nproc-per-node=8", "train.py"], "torchrun"),
    (["python", "-m", "torch.distributed.run", "train.py"], "torch.distributed.run"),
    (["python3.11", "-X", "faulthandler", "-um", "torch.distributed.launch", "train.py"], "torch.distributed.launch"),
    (["python", "-u", "-m", "deepspeed.launcher.launch", "--world_info=x", "train.py"], "deepspeed.launcher.launch"),
    (["python", "/venv/bin/deepspeed", "train.py"], "deepspeed"),
    (["python", "/venv/bin/accelerate", "launch", "train.py"], "accelerate launch"),
    (["torchrun", "--standalone", "train.py"], "torchrun"),
])
def test_launcher_is_named_by_what_runs(cmdline, expected):
    assert collect.launcher_name(cmdline) == expected


@needs_pyspy
def test_rank_whose_path_names_a_launcher_is_a_rank(procs, tmp_path):
    ranks = []
    for r, rel in enumerate(["accelerate/train.py", "torchrun-exps/deepspeed.launcher/train.py"]):
        p = procs.spawn([sys.executable, _script(tmp_path / rel)],
                        env={"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2"})
        _wait_for(p, "ready")
        ranks.append(p)
    out = tmp_path / "trace-node1.out"
    text = ""
    for p in ranks:
        res = _dump("--pid", str(p.pid), "-o", "-")
        assert res.returncode == 0, res.stderr
        text += res.stdout + "\n"
    out.write_text(text)
    tags = _tags(text)
    for r, p in enumerate(ranks):
        assert tags[p.pid].get("role") == "rank" and tags[p.pid]["rank"] == str(r), tags[p.pid]
    # the readers keep the tag's role (their own guess from the command line would say launcher)
    job = read_paths([str(out)])
    assert sorted((q.rank, q.role) for q in job.processes) == [(0, "rank"), (1, "rank")]


@needs_pyspy
@pytest.mark.parametrize("name, args", [("torchrun", ["--nproc-per-node=1"]), ("accelerate", ["launch"])])
def test_launcher_script_is_the_launcher_and_its_child_the_rank(procs, tmp_path, name, args):
    rank_script = _script(tmp_path / "accelerate" / "train.py")
    launcher = _executable(tmp_path / "bin" / name, FAKE_LAUNCHER.format(script=rank_script))
    p = procs.spawn([sys.executable, launcher, *args, rank_script])
    _wait_for(p, "ready")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(_tags(_dump("--pid", str(p.pid), "-o", "-").stdout)) < 2:
        time.sleep(0.2)
    res = _dump("--pid", str(p.pid), "-o", "-")
    assert res.returncode == 0, res.stderr
    tags = _tags(res.stdout)
    assert len(tags) == 2, res.stdout
    (child,) = [f for pid, f in tags.items() if pid != p.pid]
    assert tags[p.pid]["role"] == "launcher" and "rank" not in tags[p.pid]
    assert child["role"] == "rank" and child["rank"] == "1"


@needs_pyspy
def test_launcher_command_with_a_rank_in_its_environment_is_a_rank(procs, tmp_path):
    # a rank's script that happens to be called torchrun: the environment says it is a rank
    p = procs.spawn([sys.executable, _executable(tmp_path / "bin" / "torchrun", WAITER)],
                    env={"RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "4"})
    _wait_for(p, "ready")
    res = _dump("--pid", str(p.pid), "-o", "-")
    (fields,) = _tags(res.stdout).values()
    assert fields["role"] == "rank" and fields["rank"] == "3"


@needs_pyspy
def test_real_torchrun_is_the_launcher(procs, tmp_path):
    script = _script(tmp_path / "torchrun" / "accelerate" / "train.py")
    p = procs.spawn(torchrun_cmd(1, script))
    deadline = time.monotonic() + 90
    tags = {}
    while time.monotonic() < deadline:
        tags = _tags(_dump("--pid", str(p.pid), "-o", "-").stdout)
        if any(f.get("rank") == "0" for f in tags.values()):
            break
        time.sleep(0.5)
    assert tags[p.pid]["role"] == "launcher" and "rank" not in tags[p.pid]
    ranks = [f for f in tags.values() if f.get("role") == "rank"]
    assert [f["rank"] for f in ranks] == ["0"], tags


# -- 2. the gdb fallback writes what the gdb reader reads ------------------------------------------


def _gdb_can_attach(pid):
    """gdb is there, may attach, and has the interpreter's own extension (``py-bt``: a Python built
    without its ``python3.X-gdb.py`` beside it, as a distribution's ``/usr/bin/python3`` without its
    -dbg package, gives C frames only)."""
    if shutil.which("gdb") is None:
        return False
    try:
        r = subprocess.run(["gdb", "-p", str(pid), "-batch", "-nx", "-iex", "set auto-load safe-path /",
                            "-ex", "info threads", "-ex", "py-bt"], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=60, start_new_session=True)
    except subprocess.TimeoutExpired:
        return False
    return "Operation not permitted" not in r.stdout and "LWP" in r.stdout and 'Undefined command: "py-bt"' not in r.stdout


def test_gdb_fallback_reads_back_as_one_process_with_python_frames(procs, tmp_path):
    p = procs.spawn([sys.executable, _script(tmp_path / "waiter.py")], env={"RANK": "2", "WORLD_SIZE": "4"})
    _wait_for(p, "ready")
    if not _gdb_can_attach(p.pid):
        pytest.skip("gdb missing, cannot attach (ptrace), or has no py-bt for this interpreter")
    out = tmp_path / "trace-node1.out"
    res = _dump("--pid", str(p.pid), "--py-spy", "/bin/false", "--no-signal", "-o", str(out))
    assert res.returncode == 0, res.stderr
    (fields,) = _tags(out.read_text()).values()
    assert fields["dumper"] == "gdb"
    job = read_paths([str(out)])
    assert not [e for s in job.sources for e in s.errors], [e for s in job.sources for e in s.errors]
    (proc,) = job.processes
    assert (proc.pid, proc.rank, proc.status, proc.format) == (p.pid, 2, "ok", "gdb")
    main = [f.function for f in proc.main_thread.frames if not f.native]
    assert main[0] == "<module>" and "waiting_for_godot" in main and main[-1] == "wait", main
    assert proc.main_thread.frames[1].file.endswith("waiter.py")
    (bg,) = [t for t in proc.threads if any(f.function == "background" for f in t.frames)]
    assert bg.frames[-1] == bg.frames[-1].__class__("sleep", "", native=True)  # time.sleep, a built-in
    findings = diagnose(build_report(job))
    assert findings and not any(f.kind == "unresponsive-process" for f in findings)


def test_gdb_reader_reads_py_bt():
    job = read_text(textwrap.dedent("""\
        [New LWP 12081]
        Thread 2 (Thread 0x7f10719ff6c0 (LWP 12081) "pt_gloo_runloop"):
        Unable to locate python frame

        Thread 1 (Thread 0x7f108ffbfb80 (LWP 12079) "python"):
        Traceback (most recent call first):
          <built-in method wait of pybind11_detail_function_record object at remote 0x7f10704712b0>
          File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 5356, in barrier
            work.wait()
          (frame information optimized out)
          File "/tmp/job.py", line 11, in worker
            dist.barrier()
          File "<string>", line 1, in <module>
        [Inferior 1 (process 12079) detached]
        """))
    (p,) = job.processes
    assert p.pid == 12079 and [t.ident for t in p.threads] == ["12081", "12079"]
    assert [f.label() for f in p.main_thread.frames] == [
        "<module> (<string>:1)", "worker (/tmp/job.py:11)",
        "barrier (torch/distributed/distributed_c10d.py:5356)", "wait"]
    assert p.threads[0].frames == () and not job.sources[0].errors


# -- 3. a process that exits while it is dumped ----------------------------------------------------

PARENT = textwrap.dedent(
    """
    import os, subprocess, sys, threading
    kids = [subprocess.Popen([sys.executable, {script!r}], env=dict(os.environ, RANK=str(r), LOCAL_RANK=str(r),
                                                                     WORLD_SIZE="2", **({{"HANGDOC_TEST_DIE": "1"}} if r else {{}})))
            for r in range(2)]
    if {reap!r}:
        for k in kids:
            threading.Thread(target=k.wait, daemon=True).start()
    print("ready", os.getpid(), flush=True)
    threading.Event().wait(600)
    """
)

# a py-spy that, asked for the marked process, kills it first (it "exits while dumped") and waits
# until it is gone or a zombie, then lets the real py-spy try
DYING_PYSPY = textwrap.dedent(
    """\
    #!/bin/sh
    pid="$3"
    if tr '\\0' '\\n' < /proc/$pid/environ 2>/dev/null | grep -qx HANGDOC_TEST_DIE=1; then
        kill -9 "$pid"
        for i in $(seq 100); do
            [ -e /proc/$pid ] || break
            grep -q '^State:.*Z' /proc/$pid/status 2>/dev/null && break
            sleep 0.05
        done
    fi
    exec {pyspy} "$@"
    """
)


@needs_pyspy
@pytest.mark.parametrize("reap", [True, False], ids=["reaped", "zombie"])
def test_process_that_exits_while_dumped_is_exited_not_unresponsive(procs, tmp_path, reap):
    parent = _script(tmp_path / "parent.py", PARENT.format(script=_script(tmp_path / "waiter.py"), reap=reap))
    p = procs.spawn([sys.executable, parent])
    _wait_for(p, "ready")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(_tags(_dump("--pid", str(p.pid), "-o", "-").stdout)) < 3:
        time.sleep(0.2)
    pyspy = _executable(tmp_path / "bin" / "py-spy", DYING_PYSPY.format(pyspy=PYSPY))
    out = tmp_path / "trace-node1.out"
    res = _dump("--pid", str(p.pid), "--py-spy", pyspy, "--timeout", "10", "-o", str(out))
    text = out.read_text()
    assert res.returncode == 0, (res.stderr, text)
    assert "unresponsive" not in res.stderr and "1 exited" in res.stderr, res.stderr
    assert "status=unresponsive" not in text
    exited = [line for line in text.splitlines() if line.startswith(tagline.EXITED_PREFIX)]
    assert len(exited) == 1 and " rank=1 " in exited[0] and " reason=" in exited[0], text
    job = read_paths([str(out)])
    # the exited rank is read as what it is: a process with no stack, status exited, named by pid
    (gone,) = [q for q in job.processes if q.status == "exited"]
    assert (gone.rank, gone.threads) == (1, [])
    assert sorted(q.rank for q in job.processes if q.rank is not None and q.status == "ok") == [0]
    assert len(job.processes) == 3  # the parent, rank 0, and the exited rank 1
    findings = diagnose(build_report(job))
    assert not any(f.kind == "unresponsive-process" for f in findings), [(f.kind, f.summary) for f in findings]
    (missing,) = [f for f in findings if f.kind == "missing-rank"]
    assert [(c.rank, c.pid) for c in missing.culprits] == [(1, gone.pid)]
    assert missing.summary == "rank 1 exited before it could be dumped"


# -- 4. ranks started by torch.multiprocessing.spawn -----------------------------------------------

SPAWN_JOB = textwrap.dedent(
    """
    import os, sys, time
    import torch.distributed as dist
    import torch.multiprocessing as mp

    def train(rank, world, init):
        os.environ["RANK"] = str(rank)  # set by the script: not in /proc/PID/environ
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        os.write(1, f"rank {rank} {os.getpid()}\\n".encode())  # one write: the ranks share the pipe
        if rank == 1:
            time.sleep(600)  # the culprit
        dist.barrier()

    if __name__ == "__main__":
        mp.spawn(train, args=(2, "file://" + sys.argv[1]), nprocs=2)
    """
)


# a py-spy that cannot read one process
FAILING_FOR_PID_PYSPY = "#!/bin/sh\n[ \"$3\" = {pid} ] && {{ echo 'Error: Permission denied' >&2; exit 1; }}\nexec {pyspy} \"$@\"\n"


@needs_pyspy
@pytest.mark.parametrize("env", [{}, {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0"}],
                         ids=["plain", "inherited-slurm-rank"])
def test_mp_spawn_ranks_are_ranks_and_the_sleeper_is_blamed(procs, tmp_path, env):
    p = procs.spawn([sys.executable, _script(tmp_path / "spawn_job.py", SPAWN_JOB), str(tmp_path / "store")], env=env)
    _wait_for(p, "rank 1", timeout=120)
    lines = _wait_for(p, "rank 0", timeout=60)
    pids = {int(x.split()[1]): int(x.split()[2]) for x in lines if x.startswith("rank ")}
    out = tmp_path / "trace-node1.out"
    deadline = time.monotonic() + 60
    while True:  # until rank 0 is in the barrier (it printed its line just before)
        res = _dump("--pid", str(p.pid), "-o", str(out))
        assert res.returncode == 0, res.stderr
        if "barrier" in out.read_text() or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    tags = _tags(out.read_text())
    assert tags[p.pid]["role"] == "launcher"
    for pid in pids.values():
        assert tags[pid]["role"] == "rank" and "rank" not in tags[pid], tags[pid]  # its RANK is not in its environment
    others = [f for pid, f in tags.items() if pid != p.pid and pid not in pids.values()]
    assert all(f.get("role") != "rank" for f in others), others  # multiprocessing's resource tracker
    findings = diagnose(build_report(read_paths([str(out)])))
    assert findings[0].kind == "collective-mismatch", [(f.kind, f.summary) for f in findings]
    assert [c.pid for c in findings[0].culprits] == [pids[1]], findings[0].summary

    # a rank that no dumper can read is still a rank: its parent waits in torch.multiprocessing.spawn
    failing = _executable(tmp_path / "bin" / "py-spy", FAILING_FOR_PID_PYSPY.format(pid=pids[1], pyspy=PYSPY))
    res = _dump("--pid", str(p.pid), "--py-spy", failing, "--no-gdb", "--no-signal", "-o", str(out))
    assert res.returncode == 1, res.stderr
    tags = _tags(out.read_text())
    assert tags[pids[1]]["status"] == "unresponsive" and tags[pids[1]]["role"] == "rank", tags[pids[1]]
    assert "rank" not in tags[pids[1]] and tags[p.pid]["role"] == "launcher"
    findings = diagnose(build_report(read_paths([str(out)])))
    assert findings[0].kind == "unresponsive-process" and [c.pid for c in findings[0].culprits] == [pids[1]]

    if env or not _gdb_can_attach(pids[0]):
        return
    # the same hang through the gdb fallback gets the same verdict
    res = _dump("--pid", str(p.pid), "--py-spy", "/bin/false", "--no-signal", "--timeout", "60", "-o", str(out),
                timeout=300)
    assert res.returncode == 0, res.stderr
    assert {f.get("dumper") for f in _tags(out.read_text()).values()} == {"gdb"}
    assert _tags(out.read_text())[pids[0]]["role"] == "rank"
    findings = diagnose(build_report(read_paths([str(out)])))
    assert findings[0].kind == "collective-mismatch", [(f.kind, f.summary) for f in findings]
    assert [c.pid for c in findings[0].culprits] == [pids[1]], findings[0].summary


# -- 5. an output file that cannot be written ------------------------------------------------------


@needs_pyspy
def test_unwritable_output_is_one_line_error_before_dumping(procs, tmp_path):
    p = procs.spawn([sys.executable, _script(tmp_path / "waiter.py")])
    _wait_for(p, "ready")
    for bad in ("/proc/nope/x.out", "/proc/x.out", str(tmp_path / "waiter.py" / "x.out")):
        res = _dump("--pid", str(p.pid), "-o", bad)
        assert res.returncode == 2, res
        assert "Traceback" not in res.stderr and res.stderr.count("\n") == 1 and bad in res.stderr, res.stderr
        assert res.stdout == ""


# a py-spy that turns the output directory into a file before it dumps: the write fails after the dump
VANISHING_DIR_PYSPY = "#!/bin/sh\nrm -rf {out_dir} && : > {out_dir}\nexec {pyspy} \"$@\"\n"


@needs_pyspy
def test_output_that_fails_after_the_dump_goes_to_stdout(procs, tmp_path):
    p = procs.spawn([sys.executable, _script(tmp_path / "waiter.py")], env={"RANK": "0"})
    _wait_for(p, "ready")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    pyspy = _executable(tmp_path / "bin" / "py-spy", VANISHING_DIR_PYSPY.format(out_dir=out_dir, pyspy=PYSPY))
    target = out_dir / "trace.out"
    res = _dump("--pid", str(p.pid), "--py-spy", pyspy, "-o", str(target))
    assert res.returncode == 3, res
    assert "Traceback" not in res.stderr and res.stderr.count("\n") == 1, res.stderr
    assert str(target) in res.stderr and "stdout" in res.stderr
    assert _tags(res.stdout)[p.pid]["rank"] == "0" and "waiting_for_godot" in res.stdout
    assert not target.exists()


# -- the dump never hangs on a dumper ---------------------------------------------------------------

# a py-spy that hangs and leaves a child of its own holding the output pipe open
HANGING_PYSPY = "#!/bin/sh\nsleep 120 &\necho $! > {marker}\nexec sleep 120\n"


def test_a_hung_dumper_and_its_children_are_killed_at_the_timeout(procs, tmp_path):
    p = procs.spawn([sys.executable, _script(tmp_path / "waiter.py")])
    _wait_for(p, "ready")
    marker = tmp_path / "grandchild.pid"
    pyspy = _executable(tmp_path / "bin" / "py-spy", HANGING_PYSPY.format(marker=marker))
    t0 = time.monotonic()
    try:
        res = _dump("--pid", str(p.pid), "--py-spy", pyspy, "--no-gdb", "--timeout", "1", "-o", "-", timeout=60)
        assert time.monotonic() - t0 < 15, res
        assert res.returncode == 1 and "py-spy_timed_out_after_1s" in res.stdout
        grandchild = int(marker.read_text())
        deadline = time.monotonic() + 5
        while os.path.exists(f"/proc/{grandchild}") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{grandchild}")
    finally:
        if marker.exists():
            try:
                os.kill(int(marker.read_text()), 9)
            except (OSError, ValueError):
                pass
