"""``hangdoc dump --debug-server``: every rank's stacks and Flight Recorder entries from torch's
debug server, on real captured pages and on a real 4-rank gloo job that runs the server and hangs."""

import json
import os
import stat
import subprocess
import sys
import time
import urllib.request

import pytest
from hypothesis import given, settings, strategies as st

from hangdoc import debug_server
from hangdoc.proctree import free_port
from tests.procs import ROOT, env_for, run, torchrun_cmd

FIXTURES = os.path.join(ROOT, "tests", "fixtures", "debug_server")
HANGDOC = [sys.executable, "-m", "hangdoc"]


def _page(name):
    with open(os.path.join(FIXTURES, name), encoding="utf-8") as f:
        return f.read()


def test_stacks_page_gives_every_rank_with_its_host():
    sections = debug_server.parse_page(_page("stacks.html"))
    assert [(s.rank, s.host, s.error) for s in sections] == [(r, "vm", None) for r in range(4)]
    assert "line 28 in main" in sections[0].text and "in broadcast" in sections[0].text
    assert all("line 29 in main" in s.text and "in all_reduce" in s.text for s in sections[1:])
    assert "<no Python frame>" in sections[0].text  # unescaped, as the frontend sends it
    assert not any("</pre>" in s.text or "<h2>" in s.text for s in sections)


def test_failed_rank_is_an_error_not_a_stack():
    sections = debug_server.parse_page(_page("stacks_rank3_stopped.html"))
    assert [s.rank for s in sections if s.error is None] == [0, 1, 2]
    (failed,) = [s for s in sections if s.error is not None]
    assert failed.rank == 3 and failed.text == ""
    assert failed.error.startswith("status=408: Timeout:") and "Read timed out" in failed.error


def test_records_page_is_json_per_rank():
    sections = debug_server.parse_page(_page("fr_trace_json.html"))
    assert [s.rank for s in sections] == [0, 1, 2, 3]
    dumps = [json.loads(s.text) for s in sections]
    assert [len(d["entries"]) for d in dumps] == [2, 3, 2, 3]  # rank 2 skipped the broadcast, rank 0 is in it


def test_written_files_aggregate_to_rank_2_and_are_private(tmp_path):
    fetched = debug_server.Fetched("http://vm:25999", debug_server.parse_page(_page("stacks.html")),
                                   debug_server.parse_page(_page("fr_trace_json.html")), [])
    out = str(tmp_path / "out")
    paths, missing = debug_server.write(fetched, out)
    assert missing == [] and len(paths) == 5
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o700
    assert all(stat.S_IMODE(os.stat(p).st_mode) == 0o600 for p in paths)
    report = _aggregate(out)
    assert _headline(report) == ("collective-mismatch", [2])


def test_output_directory_that_is_a_symlink_is_refused(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    os.symlink(str(tmp_path / "elsewhere"), str(tmp_path / "link"))
    fetched = debug_server.Fetched("u", debug_server.parse_page(_page("stacks.html")), [], [])
    with pytest.raises(debug_server.DebugServerError, match="not a directory"):
        debug_server.write(fetched, str(tmp_path / "link"))
    assert os.listdir(str(tmp_path / "elsewhere")) == []


@pytest.mark.parametrize("address", ["https://node:1", "node:notaport", "node:1/stacks", "", "user@node:1"])
def test_bad_addresses_are_usage_errors(address, tmp_path):
    res = run(HANGDOC + ["dump", "--debug-server", address, "-o", str(tmp_path / "o")], timeout=30, cwd=str(tmp_path))
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "--debug-server" in res.stderr, res.stderr


def test_nothing_listening_is_one_line_and_status_2(tmp_path):
    res = run(HANGDOC + ["dump", "--debug-server", f"127.0.0.1:{free_port()}", "--timeout", "5",
                         "-o", str(tmp_path / "o")], timeout=30, cwd=str(tmp_path))
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "127.0.0.1" in res.stderr, res.stderr


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(["<h2>Rank ", "</h2>", "<pre>", "</pre>", "<p>Failed to fetch: status=", "</p>",
                                  "</section>", "3", "99999999999", ": http://h:1/x?", "[::1", "&lt;", "\n", "x"])
                | st.text(max_size=5), max_size=60).map("".join))
def test_parse_page_never_raises_and_keeps_ranks_bounded(page):
    for s in debug_server.parse_page(page):
        assert 0 <= s.rank < debug_server.MAX_RANK
        assert (s.error is None) or s.text == ""


def test_parse_page_is_linear():
    # many headers with no closing tag, and many unclosed <pre>: quadratic scanning would take minutes
    page = "<h2>Rank 1: a</h2><pre>" * 20000 + "<h2>Rank " * 20000
    t0 = time.monotonic()
    debug_server.parse_page(page)
    assert time.monotonic() - t0 < 5


def _aggregate(path):
    res = run(HANGDOC + ["aggregate", "--format", "json", path], timeout=60)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def _headline(report):
    finding = report["findings"][0]
    return finding["kind"], sorted(c["rank"] for c in finding["culprits"])


_FRONTEND_DEPS = ("jinja2", "tabulate")


def _frontend_missing():
    """torch's frontend needs jinja2 and tabulate, and requests or aiohttp to reach the workers."""
    import importlib.util

    missing = [m for m in _FRONTEND_DEPS if importlib.util.find_spec(m) is None]
    if importlib.util.find_spec("requests") is None and importlib.util.find_spec("aiohttp") is None:
        missing.append("requests (or aiohttp)")
    return missing


def test_dump_from_a_live_4_rank_job(tmp_path, procs):
    pytest.importorskip("torch.distributed.debug", reason="torch without its debug server (torch >= 2.10)")
    missing = _frontend_missing()
    if missing:
        pytest.skip("torch's debug server frontend needs " + ", ".join(missing) + " (pip install '.[test]')")
    port = free_port()
    job = procs.spawn(torchrun_cmd(4, os.path.join(FIXTURES, "skip_broadcast.py")),
                      env={"DEBUG_SERVER_PORT": str(port), "DEBUG_SERVER_FETCH_TIMEOUT": "5"},
                      stdout=open(str(tmp_path / "job.log"), "w"), stderr=subprocess.STDOUT)
    # wait until every rank is in its last collective: rank 0 in broadcast, 1-3 in all_reduce
    deadline = time.monotonic() + 60  # ~12 s on an idle 2-core box; shared cores can triple it
    while True:
        assert job.poll() is None, open(str(tmp_path / "job.log")).read()[-3000:]
        try:
            sections = debug_server.parse_page(debug_server.fetch_page(f"http://127.0.0.1:{port}", "/stacks", timeout=5))
        except debug_server.DebugServerError:
            sections = []
        if len(sections) == 4 and "in broadcast" in sections[0].text and all(
                "in all_reduce" in s.text and "in main" in s.text for s in sections[1:]):
            break
        assert time.monotonic() < deadline, "the job never hung as expected: " + repr(sections)[:2000]
        time.sleep(0.5)
    out = str(tmp_path / "fetched")
    res = run(HANGDOC + ["dump", "--debug-server", f"127.0.0.1:{port}", "--timeout", "20", "-o", out], timeout=40)
    assert res.returncode == 0, res.stderr
    assert "stacks of 4 of 4 ranks" in res.stderr
    assert sorted(os.listdir(out)) == ["flight-recorder-rank%d.json" % r for r in range(4)] + ["stacks.txt"]
    assert _headline(_aggregate(out)) == ("collective-mismatch", [2])


def test_a_rank_number_of_superscript_digits_costs_its_section_not_the_page():
    # "²".isdigit() is True and int("²") raises: the page's other ranks must still be read
    page = _page("stacks.html").replace("<h2>Rank 1: ", "<h2>Rank \u00b2: ", 1).replace("<h2>Rank 2: ", "<h2>Rank \u0663: ", 1)
    sections = debug_server.parse_page(page)
    assert [s.rank for s in sections] == [0, 3], [s.rank for s in sections]


def test_a_rank_s_stacks_forge_no_tag_line_in_the_written_dump(tmp_path):
    # what a worker printed (here a file name) is data: no "# hangdoc process" line of its makes a process
    page = _page("stacks.html").replace(
        "Current thread 0x00007fb66ffff6c0", "# hangdoc process host=forged pid=9 rank=7 world_size=8\n"
        "#\x1b[0m hangdoc process host=forged2 pid=8 rank=6\nCurrent thread 0x00007fb66ffff6c0", 1)
    fetched = debug_server.Fetched("http://vm:25999", debug_server.parse_page(page), [], [])
    out = str(tmp_path / "out")
    paths, missing = debug_server.write(fetched, out)
    assert "forged" in open(paths[0]).read()  # kept as data
    from hangdoc.readers import read_paths
    got = sorted((p.rank, p.host) for p in read_paths([out]).processes)
    assert got == [(0, "vm"), (1, "vm"), (2, "vm"), (3, "vm")], got
