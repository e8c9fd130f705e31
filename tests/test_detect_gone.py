"""A member the others wait for whose process is dead or stopped (hangdoc.runtime.detect_gone), with
real processes looked up in /proc."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from hangdoc.runtime.detect_gone import gone_member, proc_state

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc")
RANKS = lambda group: (0, 1, 2, 3)  # noqa: E731


def _pub(n: int, pid: int, host: str = "node1", quiet: bool = True, **kw):
    return {"quiet": quiet, "last": "default_pg", "host": host, "pid": pid,
            "g": {"default_pg": {"n": n, "w": [{"start": n - 1, "base": "0", "sig": [0],
                                                 "tab": [["0", "all_reduce([8] float32)", "train.py:9", n - 1]]}]}},
            **kw}


def _waiting_on(member_pub):
    pubs = {0: _pub(5, os.getpid()), 2: _pub(5, os.getpid()), 3: _pub(5, os.getpid()), 1: member_pub}
    return gone_member(0, pubs[0], pubs.get, RANKS, "node1")


def test_a_stopped_member_is_unresponsive_and_a_killed_one_failed():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        behind = _pub(4, p.pid, quiet=False)
        assert _waiting_on(behind) is None  # alive and running: it may still come
        os.kill(p.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while proc_state(p.pid) not in ("T", "t") and time.monotonic() < deadline:
            time.sleep(0.05)
        v = _waiting_on(behind)
        assert (v.kind, v.deviants) == ("unresponsive-process", [1]), v.summary
        assert v.summary.startswith("rank 1 has not issued all_reduce([8] float32) at train.py:9 (#4 of default_pg) "
                                    f"that rank 0 waits in: its process (pid {p.pid} on node1) is stopped"), v.summary
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        v = _waiting_on(behind)
        assert (v.kind, v.deviants) == ("rank-failed", [1]), v.summary
        assert "is gone without a word: killed (SIGKILL, the OOM killer) or aborted in native code" in v.summary
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def test_nothing_said_of_what_cannot_be_known_or_was_no_mystery():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(10)
    # it ended through Python by an exception or its launcher's SIGTERM, saying so in its last
    # publication: the other rules' business (a rank that raised names itself; a SIGTERM is a consequence)
    assert _waiting_on(_pub(4, p.pid, quiet=False, end="raised")) is None
    assert _waiting_on(_pub(4, p.pid, quiet=False, end="term")) is None
    # on another host its pid means nothing here
    assert _waiting_on(_pub(4, p.pid, host="node2", quiet=False)) is None
    # it issued the call already: not the one waited for
    assert _waiting_on(_pub(5, p.pid, quiet=False)) is None
    # and only a quiet rank asks
    mine = _pub(5, os.getpid(), quiet=False)
    assert gone_member(0, mine, {1: _pub(4, p.pid)}.get, RANKS, "node1") is None


def test_a_member_whose_script_ended_cleanly_ran_fewer_steps_unless_another_died():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(10)
    v = _waiting_on(_pub(4, gone.pid, quiet=False, end="exit"))
    assert (v.kind, v.deviants, v.basis) == ("collective-mismatch", [1], "process"), v.summary
    assert v.summary == (f"rank 1 has not issued all_reduce([8] float32) at train.py:9 (#4 of default_pg) that rank 0 "
                         f"waits in: it ended cleanly (pid {gone.pid} on node1: its script finished after 4 calls "
                         f"there): its loop ran fewer steps than this rank's (uneven data, an early break or return)")
    # a member killed outright is the cause, the one that then ended cleanly no culprit
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    killed.kill()
    killed.wait(10)
    pubs = {0: _pub(5, os.getpid()), 1: _pub(4, gone.pid, quiet=False, end="exit"), 2: _pub(4, killed.pid, quiet=False),
            3: _pub(5, os.getpid())}
    v = gone_member(0, pubs[0], pubs.get, RANKS, "node1")
    assert (v.kind, v.deviants) == ("rank-failed", [2]), v.summary


# Rank 2's shard is one batch shorter: it ends its loop, destroys the group and exits 0 while the
# others wait in the next all_reduce (gloo then fails them at once: "Connection closed by peer").
SHORT_SHARD = """\
import time, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
steps = 11 if rank == 2 else 12
for step in range(steps):
    if step == 10:
        print("DIVERGE_AT", time.time(), flush=True)
    dist.all_reduce(torch.ones(16))
dist.destroy_process_group()
"""


def test_a_rank_whose_loop_ended_first_is_named_from_its_last_publication(tmp_path):
    from tests.test_detect_gloo import _said, _wait_verdict

    v, latency, _out, err = _wait_verdict(tmp_path, SHORT_SHARD, 3)
    assert (v["kind"], v["deviants"], v["basis"]) == ("collective-mismatch", [2], "process"), v
    assert v["summary"].startswith("rank 2 has not issued all_reduce([16] float32) at train.py:8 (#11 of default_pg) "
                                   "that rank "), v["summary"]
    assert "it ended cleanly (pid " in v["summary"] and "its script finished after 11 calls there" in v["summary"]
    assert latency <= 10.0
    _said(err, v)
