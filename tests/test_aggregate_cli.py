"""``hangdoc aggregate`` through the real command line, on real captured dumps.

Every run is a subprocess in its own session with a hard timeout, killed with its group if it
overruns. The fixtures are real py-spy dumps of real hung gloo jobs (tests/fixtures/dumps) and the
BLOOM-176B evaluation hang dumps (tests/fixtures/bloom).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DUMPS = os.path.join(ROOT, "tests", "fixtures", "dumps")
SKIP = os.path.join(DUMPS, "skip_broadcast")
BLOOM = os.path.join(ROOT, "tests", "fixtures", "bloom", "2-nodes")
TRUTH = os.path.join(SKIP, "truth.json")


def hangdoc(*args, cwd=ROOT, timeout=60, env=None):
    e = dict(os.environ, PYTHONPATH=ROOT, **(env or {}))
    e.pop("HANGDOC_DEBUG", None)
    p = subprocess.Popen(
        [sys.executable, "-m", "hangdoc", "aggregate", *args],
        cwd=cwd, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )
    try:
        out, err = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return p.returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace")


def test_skip_broadcast_plain_text_report():
    rc, out, err = hangdoc(os.path.join(SKIP, "plain"), "--rank-map", TRUTH)
    assert rc == 0, err
    assert err == ""
    assert out.startswith("hangdoc: 4 processes (ranks 0-3 on hosts node[1-2]) from 2 sources, 2 groups\n")
    assert "\033[" not in out  # stdout is a pipe: no colour
    groups = out[out.index("Groups"):out.index("Merged tree")]
    assert "#1 3 × ranks 1-3 on hosts node[1-2]\n     all_reduce ← train_step (skip_broadcast.py:28)" in groups
    assert "#2 1 × rank 0 on host node1 pid 12610\n     broadcast ← sync_params (skip_broadcast.py:23)" in groups
    # the headline comes before the groups and names rank 0
    head = out[:out.index("Groups")]
    assert "»" in head and "rank 0" in head


def test_json_to_file_atomically_and_same_as_stdout(tmp_path):
    target = tmp_path / "sub" / "report.json"
    rc, out, err = hangdoc(os.path.join(SKIP, "plain"), "--rank-map", TRUTH, "-o", str(target))
    assert rc == 0 and out == "", err
    doc = json.loads(target.read_text())
    assert [p.name for p in target.parent.iterdir()] == ["report.json"]  # no temporary left behind
    umask = os.umask(0o022)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask
    rc, out, _ = hangdoc(os.path.join(SKIP, "plain"), "--rank-map", TRUTH, "--format", "json")
    assert rc == 0 and json.loads(out) == doc
    assert doc["version"] == 1 and doc["processes"] == 4 and doc["world_size"] == 4
    assert [(g["count"], g["ranks"], g["hosts"]) for g in doc["groups"]] == [(3, "1-3", "node[1-2]"), (1, "0", "node1")]
    assert doc["groups"][1]["members"] == [{"host": "node1", "pid": 12610, "rank": 0}]
    assert sorted(os.path.basename(s["path"]) for s in doc["sources"]) == ["trace-node1.out", "trace-node2.out"]
    assert all(s["processes"] == 2 and s["errors"] == [] for s in doc["sources"])
    # the verdict itself is the diagnosis rules' business; here: present, contract-shaped, headline first
    from hangdoc.model import FINDING_KINDS

    assert doc["findings"] and doc["findings"][0]["kind"] in FINDING_KINDS and doc["findings"][0]["kind"] != "no-hang"
    assert set(doc["findings"][0]) >= {"kind", "summary", "culprits", "evidence", "advice"}
    assert all(set(c) == {"host", "pid", "rank"} for c in doc["findings"][0]["culprits"])
    assert doc["missing_ranks"] == ""


def test_input_order_does_not_change_the_report():
    a = [os.path.join(SKIP, "plain", "trace-node1.out"), os.path.join(SKIP, "plain", "trace-node2.out")]
    rc1, out1, _ = hangdoc(*a, "--rank-map", TRUTH, "--format", "json")
    rc2, out2, _ = hangdoc(*reversed(a), "--rank-map", TRUTH, "--format", "json")
    assert rc1 == rc2 == 0 and out1 == out2


@pytest.mark.parametrize("kind", ["plain", "full", "native", "locals", "json", "with-workers", "pystack", "gdb", "faulthandler"])
def test_every_captured_format_groups_rank_0_apart(kind):
    if not os.path.isdir(os.path.join(SKIP, kind)):
        pytest.skip(f"fixture {kind} not captured")
    rc, out, err = hangdoc(os.path.join(SKIP, kind), "--rank-map", TRUTH, "--format", "json")
    assert rc == 0, err
    doc = json.loads(out)
    ranked = [g for g in doc["groups"] if g["ranks"]]
    # rank 0 (skipped the broadcast's partner call) never shares a stack with ranks 1-3
    zero = [g for g in ranked if "0" in g["ranks"].replace("-", ",").split(",")]
    assert zero and all(g["ranks"] == "0" for g in zero), [(g["ranks"], g["summary"]) for g in ranked]


def test_bloom_layout_from_the_real_dumps():
    rc, out, err = hangdoc(BLOOM, "--format", "json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["processes"] == 16
    node48 = [g for g in doc["groups"] if any(m["host"] and m["host"].endswith("iam48") for m in g["members"])]
    by_summary = {}
    for g in node48:
        n = sum(1 for m in g["members"] if m["host"].endswith("iam48"))
        by_summary[g["summary"]] = by_summary.get(g["summary"], 0) + n
    # "4 in broadcast / 1 in DataLoader wait / 3 in broadcast", straight from the groups
    assert sorted(by_summary.values(), reverse=True) == [4, 3, 1], by_summary
    assert any(s.startswith("broadcast ← _bcast_pipe_scalar") for s in by_summary)
    assert any(s.startswith("broadcast ← ") and "_bcast_pipe_scalar" not in s for s in by_summary)
    rc, text, _ = hangdoc(BLOOM)
    assert rc == 0 and text.index("»") < text.index("Groups") < text.index("Merged tree")


def test_formats_markdown_and_granularity_and_plumbing():
    rc, md, err = hangdoc(os.path.join(SKIP, "plain"), "--rank-map", TRUTH, "--format", "markdown")
    assert rc == 0, err
    assert md.startswith("# hangdoc report: 4 processes, 2 groups\n") and "```" in md
    rc, folded, _ = hangdoc(os.path.join(SKIP, "plain"))
    rc2, shown, _ = hangdoc(os.path.join(SKIP, "plain"), "--show-plumbing")
    assert rc == rc2 == 0
    assert "_exception_logger.<locals>.wrapper (torch/distributed/c10d_logger.py:83)" in shown
    assert "wrapper (torch/distributed/c10d_logger.py:83)" not in folded
    rc, fn, _ = hangdoc(os.path.join(SKIP, "plain"), "--granularity", "function", "--format", "json")
    assert rc == 0 and json.loads(fn)["granularity"] == "function"


@pytest.mark.parametrize("suffix,head", [(".html", "<!DOCTYPE html"), (".md", "# hangdoc report"), (".txt", "hangdoc: 4 processes")])
def test_format_follows_the_output_suffix(tmp_path, suffix, head):
    target = tmp_path / f"report{suffix}"
    rc, out, err = hangdoc(os.path.join(SKIP, "plain"), "-o", str(target))
    assert rc == 0 and out == "", err
    assert target.read_text().lstrip().lower().startswith(head.lower())


def test_colour_always_and_never():
    rc, out, _ = hangdoc(os.path.join(SKIP, "plain"), "--color", "always")
    assert rc == 0 and "\033[" in out
    rc, out, _ = hangdoc(os.path.join(SKIP, "plain"), "--color", "never")
    assert rc == 0 and "\033[" not in out


def test_missing_ranks_from_the_rank_map(tmp_path):
    shutil.copy(os.path.join(SKIP, "plain", "trace-node1.out"), tmp_path / "trace-node1.out")
    rc, out, err = hangdoc(str(tmp_path), "--rank-map", TRUTH, "--format", "json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["missing_ranks"] == "2-3" and doc["world_size"] == 4
    rc, text, _ = hangdoc(str(tmp_path), "--rank-map", TRUTH)
    assert "Missing: ranks 2-3 (2 of world size 4: no dump, no records)" in text


def test_parse_errors_are_listed_and_the_rest_is_used(tmp_path):
    shutil.copy(os.path.join(SKIP, "plain", "trace-node1.out"), tmp_path / "trace-node1.out")
    (tmp_path / "garbage.out").write_bytes(b"\x00\xff\xfe binary \x89PNG\r\n\x1a\n" * 50)
    good = open(os.path.join(SKIP, "plain", "trace-node2.out"), encoding="utf-8").read()
    (tmp_path / "trace-node2.out").write_text(good[: len(good) * 2 // 3])  # cut off mid-dump
    rc, out, err = hangdoc(str(tmp_path), "--format", "json")
    assert rc == 0, err
    assert "Traceback" not in err
    doc = json.loads(out)
    assert doc["processes"] >= 3
    errors = [e for s in doc["sources"] for e in s["errors"]]
    assert errors and all(re.match(r"^.+:\d+: .+", e) for e in errors)
    rc, text, _ = hangdoc(str(tmp_path))
    assert rc == 0 and "parse error" in text


def test_nothing_readable_exits_2_with_one_line(tmp_path):
    rc, out, err = hangdoc(str(tmp_path / "does-not-exist.out"))
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("hangdoc aggregate: error: ")
    (tmp_path / "empty.out").write_text("")
    rc, out, err = hangdoc(str(tmp_path / "empty.out"))
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_usage_errors_exit_2(tmp_path):
    rc, _, err = hangdoc(os.path.join(SKIP, "plain"), "--format", "pdf")
    assert rc == 2 and "invalid choice" in err
    rc, _, err = hangdoc()
    assert rc == 2
    bad = tmp_path / "map.txt"
    bad.write_text("node1:12610 zero\n")
    rc, _, err = hangdoc(os.path.join(SKIP, "plain"), "--rank-map", str(bad))
    assert rc == 2 and err.strip() == f"hangdoc aggregate: error: {bad}:1: expected 'KEY RANK' (KEY is host:pid or pid), got 'node1:12610 zero'"


def test_progress_only_on_a_terminal_and_only_after_the_delay(monkeypatch):
    import io
    import time

    from hangdoc.cli import aggregate

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty = Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    p = aggregate.Progress(after=0.0)
    p.stage("reading file 3/9")
    time.sleep(0.6)
    p.done()
    text = tty.getvalue()
    assert "hangdoc: reading file 3/9…" in text and text.endswith("\r\033[K")

    quiet = Tty()
    monkeypatch.setattr(sys, "stderr", quiet)
    p = aggregate.Progress(after=30.0)  # a run shorter than the delay prints nothing
    p.stage("reading")
    time.sleep(0.3)
    p.done()
    assert quiet.getvalue() == ""

    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal: no thread at all
    assert aggregate.Progress(after=0.0)._thread is None


def test_reading_in_several_processes_gives_the_same_report():
    paths = [DUMPS, os.path.join(ROOT, "tests", "fixtures", "bloom")]
    rc1, one, err = hangdoc(*paths, "--format", "json", "-j", "1")
    assert rc1 == 0, err
    for j in ("2", "3"):
        rc, out, err = hangdoc(*paths, "--format", "json", "-j", j)
        assert rc == 0 and out == one, err
    rc, _, err = hangdoc(*paths, "-j", "0")
    assert rc == 2 and "--jobs must be at least 1" in err


def test_a_failing_helper_only_means_its_files_are_read_here(monkeypatch):
    from hangdoc.cli import aggregate
    from hangdoc.readers import read_paths

    paths = [os.path.join(SKIP, "plain"), BLOOM]
    want = json.loads(_render(read_paths(paths, rank_map=None)))
    for broken in (lambda job: b"not marshal data", lambda job: 1 / 0):
        monkeypatch.setattr(aggregate, "_encode", broken)  # takes effect in the forked helper
        got = aggregate.ParallelRead.start(paths, None, 2).finish()
        assert json.loads(_render(got)) == want


def _render(job):
    from hangdoc.analysis.grouping import build_report
    from hangdoc.renderers import RenderOptions, render

    return render(build_report(job), "json", RenderOptions())


def test_records_alone_make_a_report():
    records = sorted(glob.glob(os.path.join(ROOT, "tests", "fixtures", "records", "skip_broadcast", "collectives-*.jsonl")))
    if not records:
        pytest.skip("no collective record fixtures captured")
    rc, out, err = hangdoc(*records)
    assert rc == 0, err
    assert re.match(r"hangdoc: 0 processes, \d+ records \(ranks 0-3\) from 4 sources, 0 groups\n", out)
    rc, out, _ = hangdoc(*records, "--format", "json")
    doc = json.loads(out)
    assert doc["processes"] == 0 and doc["groups"] == [] and sum(s["records"] for s in doc["sources"]) > 0
    assert doc["findings"]


def test_an_unreadable_file_among_good_ones_is_warned_about_on_stderr(tmp_path):
    empty = tmp_path / "trace-node9.out"
    empty.write_text("")
    rc, out, err = hangdoc(os.path.join(DUMPS, "skip_broadcast", "plain", "trace-node1.out"), str(tmp_path / "gone.out"),
                           str(empty))
    assert rc == 0 and "gone.out:0: no such file or directory" in err and "trace-node9.out:0: empty file" in err
    assert err.count("warning:") == 2
