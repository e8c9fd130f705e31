"""wrap(), `python -m hangdoc script.py`, torchrun -m hangdoc, options and get_logger."""

from __future__ import annotations

import os
import re
import socket
import sys
import textwrap

import pytest

import hangdoc
from hangdoc.runtime import options
from hangdoc.runtime.identity import Identity
from tests.procs import run, torchrun_cmd

HOST = socket.gethostname().split(".")[0]

SCRIPT = textwrap.dedent('''\
    import os, sys
    print("argv", sys.argv)
    print("name", __name__)
    print("path0", sys.path[0] == os.path.dirname(os.path.abspath(__file__)))
    loaded = sorted(m for m in ("hangdoc.runtime.recorder", "hangdoc.runtime.watchdog", "hangdoc.runtime.nicertrace", "torch") if m in sys.modules)
    print("loaded", loaded)
    if "hangdoc.runtime.watchdog" in sys.modules:
        from hangdoc.runtime import recorder, watchdog
        print("watchdog", watchdog._current is not None, "recorder", recorder.get() is not None)
    sys.exit(int(os.environ.get("EXIT", "0")))
    ''')


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


def hangdoc_cmd(*args):
    return [sys.executable, "-m", "hangdoc", *args]


def test_run_script_like_python_does_and_nothing_else_when_off(script, tmp_path):
    res = run(hangdoc_cmd(str(script), "--lr", "0.1", "x"), cwd=str(tmp_path), timeout=60, env={"EXIT": "3"})
    assert res.returncode == 3, res.stderr
    tag = f"[{HOST}:0] "
    assert res.stdout.splitlines() == [
        tag + f"argv ['{script}', '--lr', '0.1', 'x']", tag + "name __main__", tag + "path0 True", tag + "loaded []",
    ]
    assert not (tmp_path / "hangdoc-out").exists()  # nothing asked for, nothing written


def test_no_prefix_and_module_mode(tmp_path):
    res = run(hangdoc_cmd("--no-prefix", "-m", "json.tool", "--sort-keys"), input='{"b": 1, "a": 2}', timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["{", '"a":', "2,", '"b":', "1", "}"]


def test_usage_errors_exit_2(tmp_path):
    for args in ([str(tmp_path / "missing.py")], ["--hang-timeout", "0", str(tmp_path / "missing.py")], ["run"]):
        res = run(hangdoc_cmd(*args), timeout=60)
        assert res.returncode == 2 and res.stderr.startswith("hangdoc run: error:"), (args, res.stderr)
        assert "Traceback" not in res.stderr


def test_hang_timeout_starts_watchdog_and_recorder_lazily(script, tmp_path):
    out = tmp_path / "o"
    res = run(hangdoc_cmd("--no-prefix", "--out", str(out), "--hang-timeout", "60", str(script)), cwd=str(tmp_path), timeout=90)
    assert res.returncode == 0, res.stderr
    assert "loaded ['hangdoc.runtime.recorder', 'hangdoc.runtime.watchdog', 'torch']" in res.stdout
    assert "watchdog True recorder True" in res.stdout
    res = run(hangdoc_cmd("--no-prefix", "--out", str(out), "--hang-timeout", "60", "--no-record", str(script)),
              cwd=str(tmp_path), timeout=90)
    assert "watchdog True recorder False" in res.stdout, res.stdout + res.stderr


TRAIN = textwrap.dedent('''\
    import torch
    import torch.distributed as dist
    from mypkg.steps import step
    dist.init_process_group("gloo")
    for i in range(3):
        step(torch.ones(2))
    dist.destroy_process_group()
    ''')

STEPS = textwrap.dedent('''\
    import torch.distributed as dist


    def step(t):
        dist.all_reduce(t)
        return t.sum()
    ''')


def test_torchrun_m_hangdoc_trace_writes_one_file_per_rank(tmp_path):
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "steps.py").write_text(STEPS)
    (tmp_path / "train.py").write_text(TRAIN)
    out = tmp_path / "out"
    res = run(torchrun_cmd(2, "-m", "hangdoc", "--trace", "mypkg", "--out", str(out), "train.py"),
              cwd=str(tmp_path), timeout=120)
    assert res.returncode == 0 and not res.timed_out, res.stderr[-3000:]
    files = sorted(os.listdir(out))
    assert [re.sub(r"-\d+\.txt$", "", f) for f in files] == [f"trace-{HOST}-0", f"trace-{HOST}-1"], files
    for f in files:
        lines = (out / f).read_text().splitlines()
        steps = str(tmp_path / "mypkg" / "steps.py")
        calls = [line.strip() for line in lines if line.startswith(" ")]
        assert calls.count(f"{steps}:4 step") == 3, calls
        assert sum(bool(re.fullmatch(r"\d\d:\d\d:\d\d steps\.py: +5:     dist\.all_reduce\(t\)", line)) for line in lines) == 3
        assert not any(c.startswith("torch") for c in calls)  # torch was not asked for


def test_detect_starts_the_detector_not_torch_debug(tmp_path):
    """--detect turns on the recorder and the divergence detector (tests/test_detect_gloo.py runs
    it in real jobs); torch's own DETAIL checks (~700 µs a call) stay off."""
    (tmp_path / "d.py").write_text(textwrap.dedent('''\
        import os, sys
        from hangdoc.runtime import detect, recorder
        det = detect.get()
        print("policy", det.policy if det else None, "recorder", recorder.get() is not None)
        print("debug", os.environ.get("TORCH_DISTRIBUTED_DEBUG"), "fr", os.environ.get("TORCH_FR_DUMP_TEMP_FILE", "").startswith(sys.argv[1]))
        '''))
    out = tmp_path / "o"
    for opts, policy in ((["--detect"], "warn"), (["--detect-policy", "abort"], "abort")):
        res = run(hangdoc_cmd("--no-prefix", *opts, "--out", str(out), "d.py", str(out)), cwd=str(tmp_path), timeout=90)
        assert res.returncode == 0, res.stderr
        assert res.stdout.splitlines() == [f"policy {policy} recorder True", "debug None fr True"], res.stdout + res.stderr
    with pytest.raises(ValueError, match="detect must be"):
        hangdoc.wrap(lambda: None, detect="explode")


def test_wrap_in_process():
    assert hangdoc.wrap(lambda a, b=1: a + b, prefix=False)(2, b=3) == 5

    @hangdoc.wrap(prefix=False)
    def main():
        return "ok"

    assert main() == "ok" and main.__name__ == "main"
    with pytest.raises(ZeroDivisionError):
        hangdoc.wrap(lambda: 1 / 0, prefix=False)()


def test_output_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HANGDOC_OUT", raising=False)
    assert options.output_dir(create=False) == str(tmp_path / "hangdoc-out")
    monkeypatch.setenv("HANGDOC_OUT", "env-out")
    assert options.output_dir() == str(tmp_path / "env-out") and (tmp_path / "env-out").is_dir()
    assert options.output_dir("arg-out", create=False) == str(tmp_path / "arg-out")
    ident = Identity(host="h", rank=9, local_rank=1, world_size=16, local_world_size=8, pid=4)
    assert options.file_path("stacks", "x", ident) == str(tmp_path / "x" / "stacks-h-r9-4.txt")
    with pytest.raises(ValueError):
        options.file_name("nope", ident)


def test_get_logger_records_carry_host_and_rank(tmp_path):
    (tmp_path / "l.py").write_text(textwrap.dedent('''\
        import logging, hangdoc
        log = hangdoc.get_logger("train")
        seen = []
        class Keep(logging.Handler):
            def emit(self, record):
                seen.append((record.host, record.rank, record.local_rank))
        log.addHandler(Keep())
        log.info("step %d", 7)
        print(seen)
        '''))
    res = run([sys.executable, str(tmp_path / "l.py")], timeout=60, env={"RANK": "6", "LOCAL_RANK": "2", "WORLD_SIZE": "8"})
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"[('{HOST}', 6, 2)]"
    assert re.fullmatch(rf"\[{HOST}:6\] \S+ \S+ INFO train: step 7", res.stderr.strip()), res.stderr


def test_script_exception_traceback_as_python_shows_it(tmp_path):
    (tmp_path / "boom.py").write_text('def f():\n    raise ValueError("bad")\n\n\nf()\n')
    res = run(hangdoc_cmd("boom.py"), cwd=str(tmp_path), timeout=60)
    plain = run([sys.executable, "boom.py"], cwd=str(tmp_path), timeout=60)
    assert res.returncode == plain.returncode == 1
    tag = f"[{HOST}:0] "
    assert res.stderr.splitlines() == [tag + line for line in plain.stderr.splitlines()], res.stderr


def test_unknown_module_and_signal_say_so_in_one_line(script, tmp_path):
    for mod in ("nosuchmodule", "nosuchpkg.sub"):
        res = run(hangdoc_cmd("-m", mod), timeout=60)
        plain = run([sys.executable, "-m", mod], timeout=60)
        assert res.returncode == plain.returncode == 1
        assert res.stderr == plain.stderr, res.stderr  # "python: No module named ...", one line
    res = run(hangdoc_cmd("--dump-signal", "SIGFOO", str(script)), timeout=60)
    assert res.returncode == 2 and res.stderr.strip() == (
        "hangdoc run: error: --dump-signal SIGFOO: no such signal (e.g. SIGUSR1, SIGUSR2, 'none')")
    assert run(hangdoc_cmd("--dump-signal", "usr2", str(script)), cwd=str(tmp_path), timeout=60).returncode == 0


def test_ctrl_c_shows_where_the_script_was_and_ends_by_sigint(tmp_path):
    import signal
    import subprocess
    import time

    (tmp_path / "slow.py").write_text("import time\nprint('ready', flush=True)\ntime.sleep(60)\n")
    p = subprocess.Popen(hangdoc_cmd("slow.py"), cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().endswith("ready\n")
        time.sleep(0.3)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=30)
    finally:
        p.kill()
        p.wait()
    tag = f"[{HOST}:0] "
    assert p.returncode == -signal.SIGINT  # killed by SIGINT after the traceback, as python is
    assert err.splitlines()[0] == tag + "Traceback (most recent call last):"
    assert tag + '  File "' + str(tmp_path / "slow.py") + '", line 3, in <module>' in err.splitlines()
    assert err.splitlines()[-1] == tag + "KeyboardInterrupt"


def test_a_helper_that_cannot_start_does_not_stop_the_job(tmp_path):
    from hangdoc.runtime.nicertrace import NicerTrace

    other = NicerTrace(path=str(tmp_path / "other.txt")).start()  # only one tracer per process
    try:
        with pytest.warns(RuntimeWarning, match="trace not started"):
            assert hangdoc.wrap(lambda: "ran", prefix=False, trace="mypkg", out=str(tmp_path / "o"))() == "ran"
    finally:
        other.stop()


def test_flight_recorder_is_turned_on_only_where_a_gpu_is_visible(monkeypatch, tmp_path):
    from hangdoc.runtime import wrap as w

    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
                 "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(w, "gpus_visible", lambda: False)
    w.flight_recorder_env(str(tmp_path))
    assert "TORCH_FR_BUFFER_SIZE" not in os.environ  # gloo: no completion tracking, ~1.2 us a call
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"].startswith(str(tmp_path))
    monkeypatch.setattr(w, "gpus_visible", lambda: True)
    w.flight_recorder_env(str(tmp_path))
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "20000"
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "0")  # the user's setting wins
    w.flight_recorder_env(str(tmp_path))
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "0"
    monkeypatch.undo()  # the real check: CUDA_VISIBLE_DEVICES="" hides every GPU
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert w.gpus_visible() is False
