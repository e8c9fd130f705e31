"""The pytest plugin on the fake backend: ranks run in-process, so these runs take milliseconds.

Each test writes a small test file, runs pytest on it through ``pytester`` (in this process), and
checks the outcome and the failure message that a user would read.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
import time

import pytest

pytest_plugins = ["pytester"]
torch = pytest.importorskip("torch")

# Imported here, once: pytester's in-process runs restore sys.modules afterwards, so whatever a
# run imports for the first time is imported (and assertion-rewritten) again by the next run.
import hypothesis  # noqa: E402,F401
import torch.distributed  # noqa: E402,F401
import torch.testing._internal.distributed.fake_pg  # noqa: E402,F401

import hangdoc.analysis.sequence  # noqa: E402,F401
import hangdoc.runtime.recorder  # noqa: E402,F401
import hangdoc.testing.order  # noqa: E402,F401


def plugin_args():
    """``-p hangdoc.testing.plugin`` unless the installed entry point loads it already."""
    eps = importlib.metadata.entry_points()
    group = eps.select(group="pytest11") if hasattr(eps, "select") else eps.get("pytest11", [])
    if any(ep.value == "hangdoc.testing.plugin" for ep in group):
        return []
    return ["-p", "hangdoc.testing.plugin"]


def run(pytester, *args):
    return pytester.runpytest(*plugin_args(), "-p", "no:cacheprovider", *args)


def failure_text(result, name):
    """The failure section of test ``name`` in pytest's output."""
    out = result.stdout.str()
    m = re.search(r"_{3,} " + re.escape(name) + r" _{3,}\n(.*?)(?=\n_{3,} \w|\n={3,} )", out, re.S)
    assert m, f"no failure section for {name} in:\n{out}"
    return re.sub(r"^\[gw\d+\] .*\n", "", m.group(1))  # xdist names the worker first


HEADER = """
import pytest, torch
import torch.distributed as dist
"""


def test_passing_ranks_and_fixtures(pytester):
    pytester.makepyfile(HEADER + """
@pytest.mark.world_size(8, backend="fake")
def test_ok(rank, world_size, collective_trace, tmp_path):
    assert dist.get_rank() == rank and dist.get_world_size() == world_size == 8
    dist.all_reduce(torch.ones(4))
    dist.broadcast(torch.ones(2), src=0)
    assert collective_trace.ops() == ["all_reduce", "broadcast"]
    assert tmp_path.is_dir()

@pytest.mark.world_size(64, backend="fake")
def test_pipeline_schedule_ok(rank, world_size):
    x = torch.ones(16)
    for micro in range(4):
        if rank > 0:
            dist.recv(x, src=rank - 1)
        if rank < world_size - 1:
            dist.send(x, dst=rank + 1)
    dist.all_reduce(x)

def test_unmarked():
    pass
""")
    result = run(pytester)
    result.assert_outcomes(passed=3)


def test_skipped_broadcast(pytester):
    pytester.makepyfile(test_skip=HEADER + """
@pytest.mark.world_size(4, backend="fake")
def test_skip(rank):
    dist.all_reduce(torch.ones(4))
    if rank != 1:
        dist.broadcast(torch.ones(8), src=0)
    dist.all_reduce(torch.ones(4))
""")
    result = run(pytester)
    result.assert_outcomes(failed=1)
    text = failure_text(result, "test_skip")
    assert "collective order diverged (world size 4, fake backend)" in text
    assert "rank 1 never issued broadcast #1 ([8] float32, src=0) that ranks 0,2-3 issued at test_skip.py:8" in text
    # side by side: the agreeing ranks left, rank 1 right, the first divergence marked
    assert re.search(r"rank 0 \(as ranks 0,2-3\)\s+\| rank 1", text)
    assert re.search(r"> #1\s+broadcast\(\[8\] float32, src=0\)\s+test_skip.py:8 test_skip\s+! \(skipped\)\n", text)
    # the calls after the hole line up again
    assert re.search(r"  #2\s+all_reduce\(\[4\] float32\)\s+test_skip.py:9 test_skip\s+\| all_reduce\(\[4\] float32\)\s+test_skip.py:9", text)
    # a few rows, not a wall of records; no Python traceback of the plugin
    assert len(text.strip().splitlines()) < 12
    assert "plugin.py" not in text


def test_shape_mismatch(pytester):
    pytester.makepyfile(test_shape=HEADER + """
@pytest.mark.world_size(3, backend="fake")
def test_shape(rank):
    n = 5 if rank == 2 else 4
    dist.all_reduce(torch.ones(n))
""")
    result = run(pytester)
    result.assert_outcomes(failed=1)
    text = failure_text(result, "test_shape")
    assert "rank 2 issued all_reduce([5] float32) at test_shape.py:7 where ranks 0-1 issued all_reduce #0 ([4] float32)" in text
    assert "(shape mismatch)" in text
    assert re.search(r"> #0\s+all_reduce\(\[4\] float32\).*! all_reduce\(\[5\] float32\)", text)


def test_uneven_loop_count(pytester):
    pytester.makepyfile(test_uneven=HEADER + """
@pytest.mark.world_size(4, backend="fake")
def test_uneven(rank):
    batches = 3 if rank == 3 else 2
    for _ in range(batches):
        dist.all_reduce(torch.ones(4))
""")
    result = run(pytester)
    result.assert_outcomes(failed=1)
    text = failure_text(result, "test_uneven")
    assert "rank 3 issued all_reduce #2 ([4] float32) at test_uneven.py:8 that ranks 0-2 never issued" in text
    assert re.search(r"> #2\s+\(nothing\)\s+! all_reduce\(\[4\] float32\)\s+test_uneven.py:8", text)


def test_pipeline_send_recv_order(pytester):
    pytester.makepyfile(test_pp=HEADER + """
@pytest.mark.world_size(4, backend="fake")
def test_pp(rank, world_size):
    x, last = torch.ones(16), world_size - 1
    if rank == last:
        dist.send(x, dst=rank - 1)      # the bug: the gradient goes back before the activation came in
        dist.recv(x, src=rank - 1)
        return
    if rank > 0:
        dist.recv(x, src=rank - 1)      # activation in
    dist.send(x, dst=rank + 1)          # activation out
    dist.recv(x, src=rank + 1)          # gradient in
    if rank > 0:
        dist.send(x, dst=rank - 1)      # gradient out
""")
    result = run(pytester)
    result.assert_outcomes(failed=1)
    text = failure_text(result, "test_pp")
    assert "point-to-point schedule is wrong (world size 4, fake backend)" in text
    assert "the schedule deadlocks under blocking semantics: rank 2 -> rank 3 -> rank 2" in text
    assert "rank 3 blocks in send([16] float32, peer=2) at test_pp.py:8, waiting for rank 2" in text
    assert "rank 2 blocks in send([16] float32, peer=3) at test_pp.py:13, waiting for rank 3" in text
    assert re.search(r"rank 2\s+\| rank 3", text)


def test_p2p_shape_mismatch_and_unmatched(pytester):
    pytester.makepyfile(test_p2p=HEADER + """
@pytest.mark.world_size(2, backend="fake")
def test_mismatch(rank):
    if rank == 0:
        dist.send(torch.ones(4), dst=1)
    else:
        dist.recv(torch.ones(5), src=0)

@pytest.mark.world_size(2, backend="fake")
def test_unmatched(rank):
    if rank == 0:
        req = dist.isend(torch.ones(4), dst=1)
""")
    result = run(pytester)
    result.assert_outcomes(failed=2)
    assert "rank 0 sent send([4] float32, peer=1) at test_p2p.py:7 but rank 1 received it as recv([5] float32, peer=0)" in failure_text(result, "test_mismatch")
    assert "rank 0 posted 1 send to rank 1 that rank 1 never received" in failure_text(result, "test_unmatched")


def test_exception_on_one_rank(pytester):
    pytester.makepyfile(test_exc=HEADER + """
@pytest.mark.world_size(4, backend="fake")
def test_exc(rank):
    dist.all_reduce(torch.ones(1))
    assert rank != 2, "rank two is unhappy"
""")
    result = run(pytester)
    result.assert_outcomes(failed=1)
    text = failure_text(result, "test_exc")
    assert "AssertionError: rank two is unhappy" in text
    assert "raised on rank 2 of 4 (fake backend" in text


def test_fixture_that_needs_the_rank_moves_fake_runs_into_rank_processes(pytester):
    pytester.makeconftest("""
import pytest
@pytest.fixture
def shard(rank, world_size):
    return list(range(rank, 10, world_size))
""")
    modcol = pytester.getmodulecol(HEADER + """
@pytest.mark.world_size(2, backend="fake")
def test_shard(rank, shard):
    pass

@pytest.mark.world_size(2, backend="fake")
def test_plain(rank, tmp_path):
    pass

@pytest.mark.world_size(2)
def test_gloo(rank):
    pass
""", configargs=plugin_args())
    items = pytester.genitems([modcol])
    plugin = sys.modules["hangdoc.testing.plugin"]
    _in_process, _spec = plugin._in_process, plugin._spec
    assert [_in_process(item, _spec(item)) for item in items] == [False, True, False]


def test_x_k_and_last_failed(pytester):
    pytester.makepyfile(test_sel=HEADER + """
@pytest.mark.world_size(2, backend="fake")
def test_a_bad(rank):
    if rank == 0:
        dist.barrier()

@pytest.mark.world_size(2, backend="fake")
def test_b_bad(rank):
    dist.all_reduce(torch.ones(1 + rank))

@pytest.mark.world_size(2, backend="fake")
def test_c_good(rank):
    dist.barrier()
""")
    r = pytester.runpytest(*plugin_args(), "-x")
    r.assert_outcomes(failed=1)  # -x stops after the first divergence
    r = pytester.runpytest(*plugin_args())
    r.assert_outcomes(failed=2, passed=1)
    r = pytester.runpytest(*plugin_args(), "--lf", "-k", "b_bad")
    r.assert_outcomes(failed=1)
    assert "test_a_bad" not in r.stdout.str() and "test_c_good" not in r.stdout.str()


def test_bad_mark_is_a_usage_error(pytester):
    pytester.makepyfile(HEADER + """
@pytest.mark.world_size(2, backend="nccl-on-cpu")
def test_x(rank):
    pass
""")
    result = run(pytester)
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*world_size backend must be one of*nccl-on-cpu*"])


def test_hangdoc_timeout_option_is_registered(pytester):
    result = pytester.runpytest(*plugin_args(), "--help")
    result.stdout.fnmatch_lines(["*--hangdoc-timeout=SECONDS*"])


def test_xfail_and_skip_marks_apply_to_the_multi_rank_outcome(pytester):
    pytester.makepyfile(HEADER + """
@pytest.mark.xfail(strict=True, reason="known divergence")
@pytest.mark.world_size(2, backend="fake")
def test_known_bug(rank):
    if rank == 0:
        dist.barrier()

@pytest.mark.xfail(strict=True, reason="should diverge but does not")
@pytest.mark.world_size(2, backend="fake")
def test_fixed_bug(rank):
    dist.barrier()

@pytest.mark.skipif(True, reason="not today")
@pytest.mark.world_size(2)
def test_skipped(rank):
    raise AssertionError("never runs")

@pytest.mark.world_size(2, backend="fake")
def test_skips_itself(rank):
    pytest.skip("no GPU")
""")
    result = run(pytester, "-rxXs")
    result.assert_outcomes(xfailed=1, failed=1, skipped=2)
    result.stdout.fnmatch_lines(["*XPASS(strict)*should diverge but does not*"])


# -- the timeout on the fake backend: ranks run in this process, and still never hang it ---------

HANG_TESTS = HEADER + """
import subprocess, sys, threading

@pytest.mark.world_size(4, backend="fake", timeout=1)
def test_event(rank):
    dist.all_reduce(torch.ones(2))
    if rank == 2:
        threading.Event().wait()            # nobody ever sets it
    dist.all_reduce(torch.ones(2))

@pytest.mark.world_size(2, backend="fake", timeout=1)
def test_go_never_arrives(rank):
    go = torch.zeros(1)
    if rank == 0:
        go.fill_(1)
    while go.item() == 0:                   # the fake group never delivers rank 0's go
        dist.broadcast(go, src=0)

@pytest.mark.world_size(2, backend="fake", timeout=1)
def test_waits_for_its_child(rank, tmp_path):
    if rank == 1:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", str(tmp_path)])
        child.wait()

def test_after():
    pass
"""


def run_bounded(pytester, *args, timeout=120):
    """A pytest subprocess that cannot hang this test: before the fix, it would have."""
    try:
        return pytester.runpytest_subprocess(*plugin_args(), "-p", "no:cacheprovider", "-p", "no:xdist",
                                             *args, timeout=timeout)
    except pytester.TimeoutExpired:
        pytest.fail(f"the pytest run hung (killed after {timeout} s)")


def test_hanging_in_process_ranks_are_interrupted_reported_and_cleaned_up(pytester):
    from tests.test_plugin_gloo import assert_no_orphans

    pytester.makepyfile(test_hang=HANG_TESTS)
    t0 = time.monotonic()
    result = run_bounded(pytester, "-rf")
    assert time.monotonic() - t0 < 60
    result.assert_outcomes(failed=3, passed=1)  # the session went on after each hang

    text = failure_text(result, "test_event")
    # which rank, how long, and what became of the others (they run one after another)
    assert text.startswith("hang: rank 2 did not finish within 1 s (world size 4, fake backend); "
                           "ranks 0-1 finished, rank 3 did not run")
    # where it was: the rank's stack, from the test function in
    assert re.search(r"---- rank 2 stacks at the timeout ----\nThread MainThread \(most recent call last\):\n"
                     r'  File ".*test_hang.py", line 10, in test_event\n    threading.Event\(\).wait\(\)', text)
    assert "pluggy" not in text and "_pytest" not in text
    # its one all_reduce is a prefix of the others' two: no divergence of its own
    assert "collective order diverged" not in text
    result.stdout.fnmatch_lines(["FAILED test_hang.py::test_event - hang: rank 2 did not finish within 1 s*"])

    loop = failure_text(result, "test_go_never_arrives")
    # rank 1's broadcasts, which the finished rank 0 never issued, are a divergence of their own when
    # they fit the recorder; past its 100,000 calls (a fast machine in 1 s) only the hang is said
    hang_head = "hang: rank 1 did not finish within 1 s (world size 2, fake backend); rank 0 finished"
    assert loop.startswith((hang_head, "collective order diverged; " + hang_head))
    # a busy loop: the stack at the timeout is at one of its two lines
    assert re.search(r"line 18, in test_go_never_arrives\n    while go.item\(\) == 0:"
                     r"|line 19, in test_go_never_arrives\n    dist.broadcast\(go, src=0\)", loop)
    assert re.search(r"rank 1 issued (more than )?[\d,]+ collective calls before the timeout, "
                     r"the last broadcast\(\[1\] float32, src=0\) at test_hang.py:19", loop)

    child = failure_text(result, "test_waits_for_its_child")
    assert "hang: rank 1 did not finish within 1 s" in child
    assert re.search(r"killed the processes started during the test: \d+ \(.*time.sleep\(120\)", child)
    assert_no_orphans(pytester.path)


def test_a_rank_deaf_to_the_interruption_ends_the_session_instead_of_hanging_it(pytester):
    pytester.makepyfile(test_deaf=HEADER + """
@pytest.mark.world_size(2, backend="fake", timeout=1)
def test_blocked_in_cpp(rank):
    dist.all_reduce(torch.ones(2))
    if rank == 1:
        torch.futures.Future().wait()       # never set: blocked in C++, where signals do not reach
""")
    t0 = time.monotonic()
    result = run_bounded(pytester)
    assert time.monotonic() - t0 < 60
    assert result.ret != 0
    err = result.stderr.str()
    assert ("test_deaf.py::test_blocked_in_cpp: rank 1 did not finish within 1 s (fake backend, in this process) "
            "and did not leave the test when interrupted") in err
    assert re.search(r'File ".*test_deaf.py", line 8, in test_blocked_in_cpp', err)
    assert "ending this pytest process" in err


# -- failures shaped by --tb, the raising rank first ---------------------------------------------

RAISE_AND_DIVERGE = HEADER + """
def check(shard):
    raise ValueError(f"bad shard {shard}")

@pytest.mark.world_size(3, backend="fake")
def test_mix(rank):
    dist.all_reduce(torch.ones(3 if rank == 1 else 2))
    if rank == 1:
        check(rank)
    dist.all_reduce(torch.ones(2))

@pytest.mark.world_size(3, backend="fake")
def test_stops_early(rank):
    dist.all_reduce(torch.ones(2))
    if rank == 1:
        check(rank)
    dist.all_reduce(torch.ones(2))
"""


def test_a_raising_rank_headlines_and_the_diff_follows_when_relevant(pytester):
    pytester.makepyfile(test_rd=RAISE_AND_DIVERGE)
    result = run(pytester, "-rf")
    result.assert_outcomes(failed=2)
    text = failure_text(result, "test_mix")
    # the exception first, with its rank; the shape mismatch (which happened before it) after it
    assert text.startswith("rank 1 failed: ValueError: bad shard 1; collective order diverged\n")
    assert text.index("---- rank 1 ----") < text.index("ValueError: bad shard 1\n") < text.index(
        "collective order diverged (world size 3, fake backend)")
    assert "rank 1 issued all_reduce([3] float32) at test_rd.py:9" in text
    result.stdout.fnmatch_lines(["FAILED test_rd.py::test_mix - rank 1 failed: ValueError: bad shard 1*"])
    # a rank that raised issued fewer calls: that is no divergence, the exception says it all
    early = failure_text(result, "test_stops_early")
    assert "ValueError: bad shard 1" in early and "raised on rank 1 of 3" in early
    assert "collective order diverged" not in early
    result.stdout.fnmatch_lines(["FAILED test_rd.py::test_stops_early - rank 1 failed: ValueError: bad shard 1"])


def test_tb_option_shapes_the_rank_tracebacks(pytester):
    pytester.makepyfile(test_rd=RAISE_AND_DIVERGE)
    short = failure_text(run(pytester, "--tb=short", "-k", "mix"), "test_mix")
    assert re.search(r"---- rank 1 ----\ntest_rd.py:11: in test_mix\n    check\(rank\)\n"
                     r"test_rd.py:5: in check\n    raise ValueError\(f\"bad shard \{shard\}\"\)\nE   ValueError: bad shard 1\n",
                     short)
    assert "def check" not in short  # the long style's function source

    line = run(pytester, "--tb=line", "-k", "mix").stdout.str()
    body = line[line.index("= FAILURES ="):line.index("short test summary")]
    assert "---- rank" not in body and "def check" not in body and "plugin.py" not in body
    assert re.search(r"\nrank 1: \S*test_rd.py:5: ValueError: bad shard 1\n"
                     r"collective order diverged in process group default_pg: rank 1 issued all_reduce\(\[3\] float32\)",
                     body)
    # pytest's own crash line, at the raising line, with the headline
    assert re.search(r"\n\S*test_rd.py:5: rank 1 failed: ValueError: bad shard 1; collective order diverged\n", body)

    none = run(pytester, "--tb=no", "-rf", "-k", "mix").stdout.str()
    assert "FAILURES" not in none and "---- rank" not in none
    assert "FAILED test_rd.py::test_mix - rank 1 failed: ValueError: bad shard 1" in none
