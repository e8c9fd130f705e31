"""A rank whose main thread ended (it raised) while a non-daemon thread keeps its process alive:
its dump shows the main thread in ``threading._shutdown``; hangdoc names it ``rank-failed`` when
the others wait in collectives for it (hangdoc.analysis.ended_stacks)."""

import json
import os
import subprocess
import sys
import time

import pytest

from procs import env_for, kill_group, spawn

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

RAISES = """\
import threading, time

def heartbeat():
    while True:  # a metrics pusher nobody stops
        time.sleep(0.2)

threading.Thread(target=heartbeat, name="heartbeat").start()
print("ready", flush=True)
raise ValueError("loss is nan")
"""


def _dump_after(tmp_path, source, ready):
    """Start ``source``, wait until its stderr has ``ready``, take ``hangdoc dump --pid`` of it and
    read the dump with hangdoc's readers."""
    script = tmp_path / "s.py"
    script.write_text(source)
    err = tmp_path / "err.txt"
    with open(err, "w") as e:
        proc = spawn([sys.executable, str(script)], stderr=e)
    try:
        deadline = time.monotonic() + 30
        while ready not in err.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready in err.read_text(), err.read_text()
        time.sleep(0.2)  # the main thread goes on from printing the traceback into _shutdown
        trace = tmp_path / "trace-node.out"
        r = subprocess.run([sys.executable, "-m", "hangdoc", "dump", "--pid", str(proc.pid), "-o", str(trace)],
                           capture_output=True, text=True, timeout=60, env=env_for())
        assert r.returncode == 0, r.stderr
    finally:
        kill_group(proc)
    from hangdoc.readers import read_paths

    [p] = [p for p in read_paths([str(trace)]).processes if p.pid == proc.pid]
    return p


def test_a_process_whose_main_thread_raised_is_seen_ended_with_the_thread_that_holds_it(tmp_path):
    from hangdoc.analysis.ended_stacks import main_ended

    p = _dump_after(tmp_path, RAISES, "ValueError: loss is nan")
    assert main_ended(p) == "'heartbeat' at heartbeat (s.py:5)", [t.frames for t in p.threads]


def test_a_live_main_thread_is_not_ended(tmp_path):
    from hangdoc.analysis.ended_stacks import main_ended

    source = RAISES.replace('raise ValueError("loss is nan")', 'import sys; print("sleeping", file=sys.stderr, flush=True)\n'
                                                                 'time.sleep(60)')
    p = _dump_after(tmp_path, source, "sleeping")
    assert main_ended(p) is None


def _aggregate(*args):
    r = subprocess.run([sys.executable, "-m", "hangdoc", "aggregate", "--format", "json"] + list(args),
                       capture_output=True, text=True, timeout=120, cwd=ROOT, env=env_for())
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["findings"]


def test_alone_an_ended_main_thread_is_no_failed_rank(tmp_path):
    """Nobody waits for it: a program at its end held by a thread, not a rank that left a job."""
    p = _dump_after(tmp_path, RAISES, "ValueError: loss is nan")
    assert p.main_thread is not None
    kinds = [f["kind"] for f in _aggregate(str(tmp_path / "trace-node.out"))]
    assert "rank-failed" not in kinds, kinds


@pytest.mark.parametrize("fix", ["exception_thread"])
def test_plain_py_spy_dumps_of_the_bug_name_the_rank_that_left(fix):
    """Real py-spy dumps of examples/bugs/exception_thread.py (tests/fixtures/bugs/README.md): rank 1
    raised, its heartbeat thread keeps it alive, ranks 0, 2, 3 wait in all_reduce."""
    d = os.path.join(HERE, "fixtures", "bugs", fix)
    [head, *rest] = _aggregate("--rank-map", os.path.join(d, "pyspy-rank-map.txt"), os.path.join(d, "pyspy"))
    assert head["kind"] == "rank-failed", head
    assert [c["rank"] for c in head["culprits"]] == [1], head
    assert "'heartbeat' at heartbeat (exception_thread.py:28)" in head["summary"], head
    # rank 1 is no longer read as blocked outside any collective
    assert not any(f["kind"] == "collective-mismatch" for f in rest), rest

