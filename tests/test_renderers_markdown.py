"""The Markdown renderer: verdict, a table of groups, the tree in a code block; markup escaped."""

from __future__ import annotations

from hangdoc.analysis.grouping import build_report
from hangdoc.model import Finding, Frame, Job
from hangdoc.renderers import RenderOptions, render

from test_grouping import BASE, proc
from test_renderers_text import bloom_report


def test_bloom_markdown():
    out = render(bloom_report(), "markdown", RenderOptions())
    lines = out.splitlines()
    assert lines[0] == "# hangdoc report: 8 processes, 3 groups"
    assert "## Verdict: `dataloader-stall`" in lines
    assert "| 1 | 4 | ranks 0-3 on host node1 | `broadcast ← _bcast_pipe_scalar (engine.py:123)` |" in lines
    assert "| 3 | 1 | rank 4 on host node2 pid 1004 | `wait ← _next_batch (engine.py:600)` |" in lines
    assert "- `collective-wait`: 7 ranks wait in broadcast" in lines
    i = lines.index("```")
    assert lines[i + 1] == "<module> (pretrain_gpt.py:300)  [8/8: ranks 0-7 on hosts node[1-2]]"  # code block: not escaped
    assert lines.count("```") == 2


def test_markup_in_names_is_escaped():
    job = Job(processes=[proc(0, BASE + (Frame("f|<b>`x`", "a_b.py", 1),), host="h*1")])
    report = build_report(job)
    report.findings = [Finding("no-hang", "summary with | pipe and <b>html</b>")]
    out = render(report, "markdown", RenderOptions())
    assert "summary with \\| pipe and \\<b\\>html\\</b\\>" in out
    row = next(l for l in out.splitlines() if l.startswith("| 1 |"))
    assert row.count(" | ") == 3  # the pipe inside the summary did not add a column
    assert "h\\*1" in row
