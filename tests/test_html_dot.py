"""DOT export and SVG through Graphviz: the same tree as the HTML picture, strings escaped for DOT."""

from __future__ import annotations

import os
import re
import shutil
import sys
import xml.etree.ElementTree as ET

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hangdoc.analysis import analyse
from hangdoc.analysis.grouping import build_report
from hangdoc.model import Frame, Job, Process, Thread
from hangdoc.readers import read_paths
from hangdoc.renderers import RenderOptions, dot, render, svg

from tests.procs import ROOT, run
from test_html_render import TRUNK

DOT = shutil.which("dot")
needs_dot = pytest.mark.skipif(DOT is None, reason="Graphviz's dot is not installed (Debian: apt-get install -y graphviz)")
BLOOM16 = os.path.join(ROOT, "tests/fixtures/bloom/2-nodes")
NASTY = [
    'say "hi"', "back\\slash", "ends with \\", "\\N\\G\\l\\n", "&lt;&amp;", "<script>alert(1)</script>",
    "new\nline", "}; digraph x {", "tab\there", "é 漢字 🙂", "'single'",
]


def dot_strings(text: str):
    """Every double-quoted DOT string, unescaped the way Graphviz reads a label (\\l = line end)."""
    out = []
    for m in re.finditer(r'"((?:[^"\\]|\\.)*)"', text, re.S):
        raw, lines, cur, i = m.group(1), [], [], 0
        while i < len(raw):
            c = raw[i]
            if c == "\\":
                nxt = raw[i + 1]
                if nxt == "l":
                    lines.append("".join(cur))
                    cur = []
                else:
                    assert nxt in '"\\', f"stray DOT escape \\{nxt} in {raw!r}"
                    cur.append(nxt)
                i += 2
                continue
            cur.append(c)
            i += 1
        if cur or not lines:
            lines.append("".join(cur))
        out.append([line.replace("&amp;", "&") for line in lines])
    return out


def report_with(functions):
    procs = [
        Process(host="n1", pid=i, rank=i, threads=[Thread("1", "MainThread", TRUNK + (Frame(f, f + ".py", i),), is_main=True)])
        for i, f in enumerate(functions)
    ]
    return build_report(Job(processes=procs))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.text(min_size=1, max_size=25), min_size=1, max_size=4, unique=True))
def test_labels_read_back_as_the_frame_names(functions):
    text = render(report_with(functions), "dot", RenderOptions())
    labels = [line for s in dot_strings(text) for line in s]
    for f in functions:
        shown = dot._CONTROL.sub("\ufffd", f)
        assert any(line.startswith(shown + "  ") for line in labels), (f, labels)


def test_tree_of_the_bloom_dumps_with_hosts_on_edges_and_the_culprit_in_red():
    report = analyse(read_paths([BLOOM16]))
    text = render(report, "dot", RenderOptions())
    assert text.startswith("digraph hangdoc {") and text.rstrip().endswith("}")
    edges = re.findall(r"  (n\d+) -> (n\d+) \[label=\"([^\"]*)\"([^\]]*)\];", text)
    culprit = [e for e in edges if 'color="#c62828"' in e[3]]
    assert culprit and all("jean-zay-iam" in e[2] for e in edges)
    # the culprit path ends in the box of the DataLoader wait
    last = culprit[-1][1]
    box = re.search(rf"  {last} \[label=\"([^\"]*)\"", text).group(1)
    assert "_next_batch" in box and "culprit" in box
    assert re.search(r"jean-zay-iam48 pid \d+\\l1 process\\l", text)


@needs_dot
def test_graphviz_accepts_and_shows_nasty_names_verbatim():
    text = render(report_with(NASTY), "dot", RenderOptions())
    out = svg.render(report_with(NASTY), RenderOptions())
    root = ET.fromstring(out)
    shown = " | ".join("".join(t.itertext()) for t in root.iter("{http://www.w3.org/2000/svg}text")).replace("\xa0", " ")
    for name in NASTY:
        expect = dot._CONTROL.sub("\ufffd", name)
        assert expect in shown, (name, shown)
    assert "digraph x" not in text.split("{", 1)[0]


@needs_dot
def test_aggregate_format_svg(tmp_path):
    out = tmp_path / "tree.svg"
    done = run([sys.executable, "-m", "hangdoc", "aggregate", BLOOM16, "--format", "svg", "-o", str(out)], timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    root = ET.parse(out).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    assert "_next_batch" in out.read_text()


def test_format_svg_without_graphviz_is_one_clear_line(tmp_path):
    # a PATH with python but no dot
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    os.symlink(sys.executable, bin_dir / "python")
    done = run([str(bin_dir / "python"), "-m", "hangdoc", "aggregate", BLOOM16, "--format", "svg", "-o", str(tmp_path / "t.svg")],
               timeout=120, cwd=ROOT, env={"PATH": str(bin_dir)})
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "hangdoc aggregate: error: --format svg needs Graphviz's `dot`; install graphviz or use --format html/dot"
    ]
    assert not (tmp_path / "t.svg").exists()


def test_svg_render_raises_graphviz_missing(monkeypatch):
    monkeypatch.setattr(svg, "find_dot", lambda: None)
    with pytest.raises(svg.GraphvizMissing, match="install graphviz or use --format html/dot"):
        svg.render(report_with(["f"]), RenderOptions())
