"""A member that died in native code (hangdoc.runtime.detect_fatal, hangdoc.runtime.detect_gone): the
real fatal-signal stack gloo's abort left, read from the output directory as hostile input."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from hangdoc.runtime import detect_fatal
from hangdoc.runtime.detect_gone import gone_member
from hangdoc.runtime.fatal import path_for

HERE = os.path.dirname(os.path.abspath(__file__))
REAL = os.path.join(HERE, "fixtures", "detect", "fatal", "fatal-vm-r1-13169.txt")

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc")


def _placed(tmp_path, pid):
    shutil.copy(REAL, path_for(str(tmp_path), "vm", 1, pid))


def test_the_call_a_rank_died_in_and_the_users_line(tmp_path):
    _placed(tmp_path, 13169)
    assert detect_fatal.read_where(str(tmp_path), "vm", 1, 13169) == {
        "signal": "Aborted", "op": "all_to_all_single", "site": "moe_capacity_alltoall_splits.py:80"}
    # nothing for another rank or pid, an empty file (a rank killed outright), a link, a FIFO
    assert detect_fatal.read_where(str(tmp_path), "vm", 2, 13169) is None
    open(path_for(str(tmp_path), "vm", 3, 7), "wb").close()
    assert detect_fatal.read_where(str(tmp_path), "vm", 3, 7) is None
    os.symlink(REAL, path_for(str(tmp_path), "vm", 4, 7))
    assert detect_fatal.read_where(str(tmp_path), "vm", 4, 7) is None
    os.mkfifo(path_for(str(tmp_path), "vm", 5, 7))
    assert detect_fatal.read_where(str(tmp_path), "vm", 5, 7) is None  # (and it did not block)


def test_a_dump_outside_any_collective_names_the_main_threads_line():
    text = open(REAL).read().replace("/torch/distributed/", "/torch/other/")
    assert detect_fatal.where(text) == {"signal": "Aborted", "op": None, "site": "moe_capacity_alltoall_splits.py:80"}
    assert detect_fatal.where("Traceback (most recent call last):\n") is None


def test_a_member_that_died_inside_a_collective_is_that_calls_mismatch(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(10)
    _placed(tmp_path, dead.pid)

    def pub(n, pid, quiet=True):
        return {"quiet": quiet, "last": "default_pg", "host": "vm", "pid": pid,
                "g": {"default_pg": {"n": n, "w": [{"start": n - 1, "sig": [0], "tab": [
                    ["0", "all_to_all_single([256,16] float32)", "moe_capacity_alltoall_splits.py:80", n - 1]]}]}}}

    pubs = {0: pub(14, os.getpid()), 1: pub(13, dead.pid, quiet=False), 2: pub(14, os.getpid()), 3: pub(14, os.getpid())}
    read = lambda r, pid: detect_fatal.read_where(str(tmp_path), "vm", r, pid)  # noqa: E731
    v = gone_member(0, pubs[0], pubs.get, lambda g: (0, 1, 2, 3), "vm", fatal_of=read)
    assert (v.kind, v.deviants) == ("collective-mismatch", [1]), v.summary
    assert v.summary == ("rank 1 died in native code (Fatal Python error: Aborted) inside all_to_all_single at "
                         "moe_capacity_alltoall_splits.py:80, while rank 0 waits in all_to_all_single([256,16] float32) "
                         "at moe_capacity_alltoall_splits.py:80 (#13 of default_pg): the backend ended it on a call "
                         "that does not match its peers' (sizes, split sizes, dtypes)")
    # the others' publications show whose call it was: the dead rank and two more issued the export's
    # all_gather there, rank 0 its forward's (examples/bugs/b4_lib_fsdp_export_skipped_on_eval_error.py)
    def at(pub, call, site):
        pub["g"]["default_pg"]["w"] = [{"start": 13, "sig": [0], "tab": [["h" + site, call, site, 13]]}]
        return pub

    pubs = {0: at(pub(14, os.getpid()), "all_gather_single([300] float32)", "fsdp.py:94"),
            1: at(pub(14, dead.pid, quiet=False), "all_gather([600] float32)", "fsdp.py:106"),
            2: at(pub(14, os.getpid()), "all_gather([600] float32)", "fsdp.py:106"),
            3: at(pub(14, os.getpid()), "all_gather([600] float32)", "fsdp.py:106")}
    pubs[1]["g"]["default_pg"]["n"] = 13  # (published as it issued it: count 13 then, #13 shown)
    v = gone_member(0, pubs[0], pubs.get, lambda g: (0, 1, 2, 3), "vm", fatal_of=read, final=True)
    assert (v.kind, v.deviants) == ("collective-mismatch", [0]), v.summary
    assert v.summary.endswith("; rank 0 issued all_gather_single([300] float32) at fsdp.py:94 there where the others "
                              "issued all_gather([600] float32) at fsdp.py:106"), v.summary
    # without the file: gone without a word, as before
    v = gone_member(0, pubs[0], pubs.get, lambda g: (0, 1, 2, 3), "vm")
    assert v.kind == "rank-failed" and "gone without a word" in v.summary


def test_a_member_dead_in_the_very_call_is_not_blamed_on_one_survivors_word(tmp_path):
    # as in examples/bugs/dtype_mismatch.py: gloo aborts one rank in the call where another, the
    # culprit, waits with another dtype; only that one's publication shows the call yet: the side that
    # aborted is not known to be the wrong one, so this member gives no verdict (it named the dead one)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(10)
    _placed(tmp_path, dead.pid)  # rank 1's fatal file: it died in all_to_all_single at moe...py:80

    def pub(n, pid, call, quiet=True):
        return {"quiet": quiet, "last": "default_pg", "host": "vm", "pid": pid,
                "g": {"default_pg": {"n": n, "w": [{"start": n - 1, "sig": [0], "tab": [
                    ["h" + call, call, "moe_capacity_alltoall_splits.py:80", n - 1]]}]}}}

    read = lambda r, pid: detect_fatal.read_where(str(tmp_path), "vm", r, pid)  # noqa: E731
    me = pub(3, os.getpid(), "all_to_all_single([1024] float64)")
    pubs = {0: me, 1: pub(2, dead.pid, "all_to_all_single([1024] float32)", quiet=False)}
    assert gone_member(0, me, pubs.get, lambda g: (0, 1, 2, 3), "vm", fatal_of=read, final=True) is None
    # two survivors that agree there: the dead member is the odd one
    pubs[2] = pub(3, os.getpid(), "all_to_all_single([1024] float64)")
    v = gone_member(0, me, pubs.get, lambda g: (0, 1, 2, 3), "vm", fatal_of=read, final=True)
    assert (v.kind, v.deviants) == ("collective-mismatch", [1]), v.summary
