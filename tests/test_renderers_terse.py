"""Terse reports by default: the headline, its culprit, the lines that prove it and the advice;
every other evidence line with ``-v`` (and always in JSON, as ``detail``). hangdoc's own wrapper
frames are plumbing, folded like torch's."""

from __future__ import annotations

import json
import os
import sys

from hangdoc.analysis.normalize import is_plumbing
from hangdoc.model import Frame
from hangdoc.renderers.text import TERSE_EVIDENCE
from tests.procs import ROOT, run

RECORDS = os.path.join(ROOT, "tests", "fixtures", "records", "skip_broadcast")
BOILERPLATE = ("If these ranks belong to different process groups", "Why not blame", "the stacks alone said",
               "never completed")


def aggregate(*args: str) -> str:
    done = run([sys.executable, "-m", "hangdoc", "aggregate", RECORDS, "--color", "never", *args], timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return done.stdout


def headline_block(text: str) -> list:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("» "))
    end = next(i for i in range(start + 1, len(lines)) if not lines[i].startswith("    "))
    return lines[start:end]


def test_default_text_is_terse_and_v_shows_every_line():
    terse = headline_block(aggregate())
    evidence = [x for x in terse if x.startswith("    evidence: ")]
    assert 1 <= len(evidence) <= TERSE_EVIDENCE
    assert "rank 2 never issued broadcast #3" in evidence[0]  # the line that proves it comes first
    assert not any(b in x for x in terse for b in BOILERPLATE)
    assert any(x.startswith("    culprits: rank 2 ") for x in terse) and any(x.startswith("    advice: ") for x in terse)
    assert len(terse) <= 8, terse
    hint = [x for x in terse if "-v shows them" in x]
    assert len(hint) == 1

    verbose = headline_block(aggregate("-v"))
    for b in BOILERPLATE:
        assert any(b in x for x in verbose), b
    assert len(verbose) > len(terse) + 5
    n = int(hint[0].split("+")[1].split()[0])
    assert len([x for x in verbose if x.startswith(("    evidence: ", "    detail: "))]) == len(evidence) + n


def test_json_keeps_every_line():
    doc = json.loads(aggregate("--format", "json"))
    head = doc["findings"][0]
    text = " ".join(head["evidence"] + head["detail"])
    for b in BOILERPLATE:
        assert b in text, b
    assert all(isinstance(x, str) for x in head["detail"])


def test_markdown_is_terse_too():
    md = aggregate("--format", "markdown")
    assert not any(b in md for b in BOILERPLATE)
    assert "more evidence line" in md
    assert "Why not blame" in aggregate("--format", "markdown", "-v")


def test_the_recorders_generated_wrapper_is_plumbing():
    # the real wrapper the recorder puts around all_reduce: its code is generated, named <string>
    import torch.distributed as dist

    from hangdoc.runtime import recorder

    r = recorder.enable(capacity=10)
    try:
        assert r is not None
        code = dist.all_reduce.__code__
        assert dist.all_reduce.__hangdoc_original__ is not None
        for name in (code.co_name, getattr(code, "co_qualname", code.co_name)):
            assert is_plumbing(Frame(name, code.co_filename, code.co_firstlineno + 3)), (name, code.co_filename)
    finally:
        recorder.disable()
    assert not is_plumbing(Frame("wrapper", "train.py", 3))  # a user's own wrapper is not


def test_html_shows_the_proof_and_folds_the_rest():
    from hangdoc.model import Finding, Job, Report
    from hangdoc.renderers import RenderOptions, render

    head = Finding("collective-mismatch", "rank 2 skipped `broadcast`", evidence=["e1", "e2", "e3", "e4"],
                   detail=["Why not blame rank 0"], confidence=0.95)
    only_detail = Finding("p2p-stall", "s", detail=["d1"], confidence=0.4)
    report = Report(job=Job(), findings=[head, only_detail])
    page = render(report, "html", RenderOptions())
    verdict = page[page.index('<section id="verdict">'):page.index("</section>")]
    assert verdict.index("e3") < verdict.index("2 more lines") < verdict.index("e4") < verdict.index("Why not blame")
    assert "<details><summary>2 more lines of evidence" in verdict
    assert "rank 2 skipped <code>broadcast</code>" in verdict
    assert 'title="confidence 0.95 (certain): how sure' in verdict
    assert "d1" in verdict  # a finding with detail only still shows it
    assert "<details open><summary>2 more lines" in render(report, "html", RenderOptions(verbose=True))
