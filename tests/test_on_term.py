"""A launcher's SIGTERM to a rank stuck in a collective (a C call) still leaves its records, and the
process ends as SIGTERM ends it; a forked child's SIGTERM never touches the rank (real processes)."""

import glob
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.procs import env_for

pytest.importorskip("torch")

STUCK = textwrap.dedent("""
    import os, sys, time, multiprocessing
    import torch, torch.distributed as dist
    from hangdoc.runtime import recorder

    recorder.enable(capacity=1000, out_dir=sys.argv[1])
    dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=int(sys.argv[3]), world_size=2)
    x = torch.ones(4)
    dist.all_reduce(x)
    if int(sys.argv[3]) == 0:
        if sys.argv[4] == "fork":  # a forked child terminated with SIGTERM must not end the rank
            p = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
            p.start()
            time.sleep(0.5)
            p.terminate()
            p.join()
        print("READY", flush=True)
        dist.all_reduce(x)   # rank 1 never joins: blocked in gloo, a C call
    else:
        time.sleep(120)
""")


def start(tmp_path, rank, mode):
    script = tmp_path / "stuck.py"
    script.write_text(STUCK)
    return subprocess.Popen([sys.executable, str(script), str(tmp_path / "out"), str(tmp_path / "store"), str(rank), mode],
                            env=env_for(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


@pytest.mark.parametrize("mode", ["plain", "fork"])
def test_sigterm_while_blocked_in_a_collective_dumps_the_records(tmp_path, mode):
    ranks = [start(tmp_path, r, mode) for r in (0, 1)]
    try:
        line = ranks[0].stdout.readline()
        assert line.strip() == "READY", line + ranks[0].stdout.read()
        time.sleep(1.0)  # in the second all_reduce now
        assert ranks[0].poll() is None, "a forked child's SIGTERM ended the rank"
        assert not glob.glob(str(tmp_path / "out" / "collectives-*")), "dumped before any signal"
        t0 = time.monotonic()
        ranks[0].send_signal(signal.SIGTERM)
        rc = ranks[0].wait(15)
        assert time.monotonic() - t0 < 5
        assert rc in (-signal.SIGTERM, 128 + signal.SIGTERM), rc
        [dump] = glob.glob(str(tmp_path / "out" / "collectives-*.jsonl"))
        recs = [json.loads(line) for line in open(dump) if line.startswith('{"rank"')]
        assert [(r["op"], r["seq"], r["state"]) for r in recs][-2:] == [("all_reduce", 0, "completed"),
                                                                        ("all_reduce", 1, "issued")]
    finally:
        for p in ranks:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(10)
