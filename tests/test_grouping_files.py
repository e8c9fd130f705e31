"""Order independence on real dumps: shuffling the files and the processes inside each file never
changes the report (groups, members, tree, summaries), only the line numbers it came from."""

from __future__ import annotations

import glob
import json
import os
import re
import tempfile

from hypothesis import given, settings
from hypothesis import strategies as st

from hangdoc.analysis.grouping import build_report
from hangdoc.ranges import compress_ranks, expand_ranks
from hangdoc.readers import read_paths
from hangdoc.renderers import RenderOptions, render

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = sorted(
    glob.glob(os.path.join(ROOT, "tests", "fixtures", "dumps", "*", "plain", "*.out"))
    + glob.glob(os.path.join(ROOT, "tests", "fixtures", "bloom", "2-nodes", "*.out"))
)
_PROCESS = re.compile(r"^Process \d+: ", re.M)


def blocks(path):
    text = open(path, encoding="utf-8").read()
    starts = [m.start() for m in _PROCESS.finditer(text)] or [0]
    return [text[a:b] for a, b in zip(starts, starts[1:] + [len(text)])]


# the same file name in several scenarios would be one host: keep scenario/name apart
CASES = [(os.path.relpath(p, ROOT).replace(os.sep, "__"), blocks(p)) for p in FILES]


def report_of(order, shuffles, granularity):
    with tempfile.TemporaryDirectory() as d:
        paths = []
        for i in order:
            name, bl = CASES[i]
            perm = shuffles[i] if i in shuffles else list(range(len(bl)))
            path = os.path.join(d, name)
            with open(path, "w", encoding="utf-8") as f:
                f.write("".join(bl[k] for k in perm))
            paths.append(path)
        job = read_paths(paths)
        report = build_report(job, granularity)
        doc = json.loads(render(report, "json", RenderOptions()))
    for s in doc["sources"]:
        s["path"] = os.path.basename(s["path"])
    return doc, report


BASELINE = {g: report_of(range(len(CASES)), {}, g)[0] for g in ("function+line", "function")}


@st.composite
def orders(draw):
    order = draw(st.permutations(list(range(len(CASES)))))
    shuffles = {i: draw(st.permutations(list(range(len(CASES[i][1]))))) for i in range(len(CASES))}
    return order, shuffles


@settings(max_examples=15, deadline=None)
@given(orders(), st.sampled_from(["function+line", "function"]))
def test_file_and_block_order_never_changes_the_report(o, granularity):
    order, shuffles = o
    doc, report = report_of(order, shuffles, granularity)
    assert doc == BASELINE[granularity]
    assert sum(g.count for g in report.groups) == len(report.job.processes) == doc["processes"]
    for g in report.groups:
        assert expand_ranks(compress_ranks(g.ranks)) == g.ranks


def test_the_fixtures_are_there():
    assert len(CASES) >= 4 and sum(len(b) for _, b in CASES) >= 30
