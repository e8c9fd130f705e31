"""The watchdog in a shared temp directory (issue 20): another local user's FIFO named like a stale
signal file must not switch the watchdog off (its stale-file sweep used to block in ``open``)."""

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

from tests.attacker import attacker
from tests.procs import ROOT, env_for


def _free_pid() -> int:
    with open("/proc/sys/kernel/pid_max") as f:
        pid = int(f.read()) - 1
    while os.path.exists(f"/proc/{pid}"):
        pid -= 1
    return pid


def test_a_fifo_named_like_a_signal_file_does_not_stop_the_watchdog(tmp_path):
    uid, gid, as_attacker = attacker()
    shared = tempfile.mkdtemp(prefix="hangdoc-sharedtmp-")  # a /tmp of its own: sticky, everyone's
    os.chmod(shared, 0o1777)
    fifo = os.path.join(shared, f"hangdoc-signal-{_free_pid()}-SIGUSR1-trap.txt")
    out = str(tmp_path / "out")
    code = textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {ROOT!r})
        import hangdoc
        from hangdoc.runtime import watchdog
        watchdog.start(0.5, out_dir={out!r}, record=False, report=False)
        hangdoc.step()  # progress once: armed, the stall below is dumped after 0.5 s
        for _ in range(80):
            time.sleep(0.1)
            if any(n.startswith("stacks-") for n in os.listdir({out!r})):
                print("dumped", flush=True)
                break
        else:
            print("no dump", flush=True)
        """)
    try:
        made = subprocess.run(as_attacker + [sys.executable, "-c", f"import os; os.mkfifo({fifo!r}, 0o666)"],
                              capture_output=True, text=True, timeout=60)
        assert made.returncode == 0, made.stderr
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                             env=env_for({"TMPDIR": shared}))
        assert res.stdout.strip() == "dumped", res.stdout + res.stderr
        assert os.path.exists(fifo)  # not ours: left alone
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def _stale_files(d, n):
    pid = _free_pid()
    names = []
    for i in range(n):
        name = os.path.join(d, f"hangdoc-signal-{pid}-SIGUSR1-old{i}.txt")
        with open(name, "w") as f:
            f.write("stale\n")
        names.append(name)
    return names


def test_a_signal_file_named_with_a_superscript_digit_does_not_end_the_sweep(tmp_path, monkeypatch):
    # "²".isdigit() is True and int("²") raises ValueError: the sweep used to end at that file,
    # leaving every stale file after it (in directory order) for ever
    from hangdoc.runtime import signal_file

    d = tmp_path / "tmp"
    d.mkdir()
    odd = [str(d / "hangdoc-signal-\u00b2-SIGUSR1-x.txt"), str(d / ("hangdoc-signal-" + "9" * 200 + "-SIGUSR1-y.txt"))]
    for name in odd:
        open(name, "w").close()
    stale = _stale_files(str(d), 5)
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    signal_file.remove_stale()
    assert not any(os.path.exists(p) for p in stale)
    assert all(os.path.exists(p) for p in odd)  # no pid: left alone


def test_the_watchdog_s_own_sweep_gets_past_a_superscript_signal_file(tmp_path):
    shared = tempfile.mkdtemp(prefix="hangdoc-tmp-")
    try:
        open(os.path.join(shared, "hangdoc-signal-\u00b2-SIGUSR1-x.txt"), "w").close()
        stale = _stale_files(shared, 40)  # the odd file first in directory order or not: all go
        out = str(tmp_path / "out")
        code = textwrap.dedent(f"""
            import os, sys, time
            sys.path.insert(0, {ROOT!r})
            from hangdoc.runtime import watchdog
            watchdog.start(600, out_dir={out!r}, record=False, report=False)
            for _ in range(100):
                time.sleep(0.1)
                if not any("-old" in n for n in os.listdir({shared!r})):
                    print("swept", flush=True)
                    break
            else:
                print("left", sorted(n for n in os.listdir({shared!r}) if "-old" in n)[:3], flush=True)
            """)
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                             env=env_for({"TMPDIR": shared}))
        assert res.stdout.strip() == "swept", res.stdout + res.stderr
        assert not any(os.path.exists(p) for p in stale)
    finally:
        shutil.rmtree(shared, ignore_errors=True)
