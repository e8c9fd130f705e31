"""examples/detect/nccl_skip_probe.py on gloo (CPU): real 2-rank trials, classified as gloo really
behaves, and every process it started gone afterwards.

What gloo does (torch 2.13 CPU): in pattern A (all_reduce; broadcast) rank 1's step-3 all_reduce
still pairs with rank 0's, so rank 1 completes step 3 and both then wait forever (rank 0 in its
step-3 broadcast, rank 1 in its step-4 all_reduce paired with it): hang-at-skip, steps done 3/4.
In pattern B (broadcast a; broadcast b) every call pairs with the one rank 0 issued one earlier;
gloo completes them all, and rank 1's b holds rank 0's a from step 3 on: silent, corrupt from 3.
"""

from __future__ import annotations

import json
import os
import sys

from hangdoc.proctree import alive, descendants
from tests.procs import ROOT, run

PROBE = os.path.join(ROOT, "examples", "detect", "nccl_skip_probe.py")
STEPS = 6


def probe(tmp_path, name, *flags):
    out = tmp_path / f"{name}.json"
    res = run([sys.executable, PROBE, "--backend", "gloo", "--patterns", "A,B", "--sizes", "256",
               "--steps", str(STEPS), "--parallel", "2", "--out", str(out), *flags], timeout=100)
    assert not res.timed_out and res.returncode == 0, res.stdout + res.stderr
    doc = json.loads(out.read_text())
    pids = [pid for t in doc["trials"] for pid in t["pids"]]
    assert len(pids) == 4 and not [pid for pid in pids if alive(pid)], "a rank outlived the probe"
    assert descendants(os.getpid()) == []
    return {t["pattern"]: t for t in doc["trials"]}, res.stdout


def test_gloo_stall_and_silent(tmp_path):
    # (--timeout 40, a backstop: with 12, on 2 cores loaded by a fuzz run beside `pytest -n 2`, the
    # trial's time ran out while its ranks still imported torch, before the 2 s stall could be seen)
    trials, stdout = probe(tmp_path, "stall", "--timeout", "40", "--stall", "2")
    a, b = trials["A"], trials["B"]
    assert (a["outcome"], a["hang_step"], a["steps_done"]) == ("hang-at-skip", 3, [3, 4])
    assert a["ended"] == "stall" and a["returncodes"] == [-9, -9]  # killed by the driver, no pg timeout
    assert a["raised"] == [None, None] and a["corrupt_from"] == [None, None]
    assert (b["outcome"], b["hang_step"], b["steps_done"], b["finished"]) == ("silent", None, [STEPS, STEPS], [True, True])
    assert b["corrupt_from"] == [None, 3] and b["bad_steps"] == [0, STEPS - 3]  # rank 0 is the source
    assert "hang-at-skip (step 3)" in stdout and "silent" in stdout


def test_gloo_pg_timeout_and_unbalanced_tail(tmp_path):
    # No stall kill: gloo's own timeout (3 s) ends pattern A, and without the balancing tail call
    # rank 0's last broadcast in pattern B has no partner: rank 1 exits, rank 0's read fails.
    # (--timeout 30: with 12, on 2 busy cores the driver once killed pattern A before gloo's timeout fired)
    trials, _ = probe(tmp_path, "pgto", "--timeout", "30", "--stall", "60", "--pg-timeout", "3", "--tail", "none")
    a, b = trials["A"], trials["B"]
    assert (a["outcome"], a["hang_step"]) == ("hang-at-skip", 3)  # a timeout is a hang, not an error
    # the rank that times out first exits, so the other may see its connection reset instead
    assert any("timed out" in (r or "").lower() for r in a["raised"]), a["raised"]
    assert a["returncodes"] == [3, 3] and a["ended"] in ("exited", "finished")
    assert (b["outcome"], b["hang_step"], b["steps_done"], b["finished"]) == ("error-later", STEPS - 1, [STEPS - 1, STEPS], [False, True])
    assert b["raised"][0] and b["raised"][1] is None
