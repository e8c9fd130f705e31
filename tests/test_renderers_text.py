"""The text renderer: headline first, compressed rank/host sets, the tree, folding, colour, caps."""

from __future__ import annotations

import re

from hangdoc.analysis.grouping import build_report
from hangdoc.model import Culprit, Finding, Frame, Job, ParseError, Process, Source, Thread
from hangdoc.renderers import RenderOptions, render

from test_grouping import BASE, BCAST_A, bloom_job, proc

ANSI = re.compile(r"\033\[[0-9;]*m")


def bloom_report(**kw):
    report = build_report(bloom_job(), **kw)
    report.findings = [
        Finding(
            "dataloader-stall",
            "rank 4 waits for its DataLoader while ranks 0-3,5-7 wait in broadcast",
            culprits=[Culprit("node2", 1004, 4)],
            evidence=["rank 4: wait ← _next_batch (engine.py:600)"],
            advice=["py-spy dump --subprocesses the DataLoader workers of rank 4"],
            confidence=0.9,
        ),
        Finding("collective-wait", "7 ranks wait in broadcast", confidence=0.4),
    ]
    return report


def test_headline_then_groups_then_tree():
    out = render(bloom_report(), "text", RenderOptions())
    lines = out.splitlines()
    assert lines[0] == "hangdoc: 8 processes (ranks 0-7 on hosts node[1-2]) from 0 sources, 3 groups"
    assert lines[2] == "» dataloader-stall: rank 4 waits for its DataLoader while ranks 0-3,5-7 wait in broadcast"
    assert "    culprits: rank 4 (node2 pid 1004)" in lines
    assert "    advice: py-spy dump --subprocesses the DataLoader workers of rank 4" in lines
    assert "  collective-wait: 7 ranks wait in broadcast" in lines
    i = lines.index("Groups (main-thread stacks, function+line, largest first)")
    assert lines[i + 1] == "  #1 4 × ranks 0-3 on host node1"
    assert lines[i + 2] == "     broadcast ← _bcast_pipe_scalar (engine.py:123)"
    assert lines[i + 5] == "  #3 1 × rank 4 on host node2 pid 1004"
    assert out.index("» dataloader-stall") < out.index("Groups") < out.index("Merged tree")
    tree = out[out.index("Merged tree"):]
    assert "<module> (pretrain_gpt.py:300)  [8/8: ranks 0-7 on hosts node[1-2]]" in tree
    assert "├─ _exec_load_micro_batch (deepspeed/runtime/pipe/engine.py:650)  [4/8: ranks 0-3 on host node1]" in tree
    assert "└─ _exec_load_micro_batch (deepspeed/runtime/pipe/engine.py:640)  [1/8: rank 4 on host node2]" in tree
    assert re.search(r"broadcast \(torch/distributed/distributed_c10d.py:1500\)  #1$", tree, re.M)
    assert "\033" not in out


def test_plumbing_folded_unless_asked():
    folded = render(bloom_report(), "text", RenderOptions())
    assert "_exception_logger.<locals>.wrapper" not in folded
    assert "1 plumbing frame folded" in folded
    shown = render(bloom_report(), "text", RenderOptions(show_plumbing=True))
    assert "_exception_logger.<locals>.wrapper (torch/distributed/c10d_logger.py:83)" in shown


def test_colour_only_when_asked_and_text_unchanged_by_it():
    plain = render(bloom_report(), "text", RenderOptions())
    coloured = render(bloom_report(), "text", RenderOptions(color=True))
    assert "\033[" in coloured
    assert ANSI.sub("", coloured) == plain


def test_hosts_and_ranks_compress():
    procs = [proc(r, BCAST_A, host=f"iam{r // 8 + 1:02d}", pid=100 + r % 8) for r in range(384) if r // 8 + 1 != 35 and r != 128]
    out = render(build_report(Job(processes=procs)), "text", RenderOptions())
    assert "ranks 0-127,129-271,280-383 on hosts iam[01-34,36-48]" in out


def test_groups_and_errors_are_capped():
    procs = [proc(r, BASE + (Frame(f"f{r}", "t.py", r),)) for r in range(30)]
    errors = [ParseError("trace.out", n, "unexpected line") for n in range(1, 31)]
    job = Job(processes=procs, sources=[Source("trace.out", processes=30, errors=errors)])
    out = render(build_report(job), "text", RenderOptions(max_groups=5))
    assert "#5 " in out and "#6 " not in out
    assert "… 25 more groups (25 processes) not shown" in out
    assert "25 more branches not shown" in out
    assert "trace.out:20: unexpected line" in out and "trace.out:21: unexpected line" not in out
    assert "… 10 more (--format json lists them all)" in out


def test_deep_stacks_and_processes_without_identity():
    deep = tuple(Frame(f"r{i}", "rec.py", i) for i in range(3000))
    job = Job(processes=[Process(threads=[Thread("1", "MainThread", deep, is_main=True)]), Process(pid=7)])
    out = render(build_report(job), "text", RenderOptions(show_plumbing=True))
    assert "r2999 (rec.py:2999)" in out
    assert "hangdoc: 2 processes (no rank) from 0 sources, 2 groups" in out


def test_long_rank_sets_are_cut_in_the_middle_but_json_keeps_them():
    import json

    procs = [proc(r, BCAST_A, host=f"n{r:05d}") for r in range(0, 4000) if r % 97]
    report = build_report(Job(processes=procs))
    out = render(report, "text", RenderOptions())
    line = next(l for l in out.splitlines() if l.startswith("  #1"))
    assert line.endswith("ranks 1-96,98-193,195-290,292-387,389-484,486-581,…(+35),3978-3999 on hosts n[00001-00096,00098-00193,00195-00290,…(+38),03978-03999]")
    assert len(line) < 200
    doc = json.loads(render(report, "json", RenderOptions()))
    assert "…" not in doc["groups"][0]["ranks"] and len(doc["groups"][0]["ranks"].split(",")) == 42


# -- control characters from the input never reach the terminal ---------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_NASTY = st.lists(st.sampled_from(list("ab.py/") + ["\x1b", "\x1b[2J", "\r", "\x07", "\x9b", "\x00", "\n", "*", "|", "`"]),
                  min_size=1, max_size=8).map("".join)


@settings(max_examples=60, deadline=None)
@given(host=_NASTY, fn=_NASTY, file=_NASTY, thread=_NASTY, source=_NASTY)
def test_control_characters_in_names_are_shown_escaped(host, fn, file, thread, source):
    from hangdoc.analysis import analyse

    frames = (Frame("main", "train.py", 1), Frame(fn, file + ".py", 7))
    job = Job(processes=[Process(host=host, pid=9, rank=0, role="rank", threads=[Thread("9", thread, frames, is_main=True)]),
                         Process(host=host, pid=10, rank=1, role="rank", threads=[Thread("10", thread, frames[:1], is_main=True)])],
              sources=[Source(source, errors=[ParseError(source, 3, "bad " + fn)])])
    report = analyse(job)
    plain = render(report, "text")
    assert not re.search("[\x00-\x09\x0b-\x1f\x7f-\x9f]", plain)
    colored = render(report, "text", RenderOptions(color=True))
    # the only escape sequences are the report's own colours
    assert "\x1b" not in re.sub(r"\x1b\[[0-9;]*m", "", colored)
    assert not re.search("[\x00-\x09\x0b-\x1a\x1c-\x1f\x7f-\x9f]", colored)
    md = render(report, "markdown")
    assert not re.search("[\x00-\x09\x0b-\x1f\x7f-\x9f]", md)
    for line in md.splitlines():
        if line.startswith("| ") and not line.startswith("| #"):
            assert len(re.findall(r"(?<!\\)\|", line)) == 5, line  # a value never adds a table column


def test_children_of_a_rank_only_when_all_the_unranked_are():
    """The header once said "2 without rank (children of rank 0)" when only the DataLoader worker
    was rank 0's child and the other was a rank whose number was unknown."""
    from hangdoc.analysis import analyse

    def p(pid, **kw):
        return Process(host="n1", pid=pid, threads=[Thread(str(pid), "MainThread", (Frame("main", "t.py", 1),), is_main=True)], **kw)

    worker = dict(role="dataloader-worker", parent_rank=0)
    mixed = render(analyse(Job(processes=[p(1, rank=0, role="rank"), p(2, role="rank"), p(3, **worker)])), "text")
    assert "rank 0 and 2 without rank (1 of them a child of rank 0) on host n1" in mixed.splitlines()[0]
    only = render(analyse(Job(processes=[p(1, rank=0, role="rank"), p(3, **worker), p(4, **worker)])), "text")
    assert "rank 0 and 2 without rank (children of rank 0) on host n1" in only.splitlines()[0]
