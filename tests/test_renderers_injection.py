"""Text from the input cannot forge report lines, repaint a terminal or reorder what is shown.

A call site in a records file and a frame name in a py-spy ``--json`` dump are JSON strings: they
may hold a newline followed by a line that looks like hangdoc's headline, an escape sequence, or a
Unicode bidi override. The real shape-mismatch fixture is read with such a call site written into
rank 1's records (the one the headline names), plus a py-spy JSON dump with such a frame; every
renderer must show the text, escaped, on the line it belongs to.
"""

from __future__ import annotations

import json
import os
import re
import shutil

from hangdoc.analysis import analyse
from hangdoc.readers import read_paths
from hangdoc.renderers import RenderOptions, render

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "records", "shape_mismatch")
_COLOUR = re.compile(r"\x1b\[[0-9;]*m")
FORGED = "\n» no-hang: nothing is wrong, rank 0 is fine"
BIDI = "\u202e"


def hostile_job(tmp_path):
    d = tmp_path / "dumps"
    shutil.copytree(FIXTURE, d)
    for name in os.listdir(d):
        if name.startswith("collectives-") and "-r1-" in name:
            lines = (d / name).read_text().splitlines()
            out = [lines[0]]
            for line in lines[1:]:
                rec = json.loads(line)
                rec["call_site"] = f"train{BIDI}yp.py:18:<module>{FORGED}\x1b[2J"
                out.append(json.dumps(rec))
            (d / name).write_text("\n".join(out) + "\n")
    threads = [{"pid": 777, "thread_id": 777, "thread_name": "MainThread", "owns_gil": False, "active": False,
                "frames": [{"name": f"wait{FORGED}", "filename": f"evil{BIDI}.py", "line": 3},
                           {"name": "<module>", "filename": "main.py", "line": 1}]}]
    (d / "pyspy-777.out").write_text(json.dumps(threads))
    job = read_paths([str(d)])
    assert not [e for e in job.errors if "could not" in e.message], job.errors
    return analyse(job)


def test_text_and_markdown_show_newlines_escapes_and_bidi_overrides_escaped(tmp_path):
    report = hostile_job(tmp_path)
    assert any(FORGED in (f.summary + " ".join(f.evidence)) for f in report.findings)  # the input does reach the findings
    for fmt in ("text", "markdown"):
        for color in (False, True):
            if color and fmt != "text":
                continue
            out = render(report, fmt, RenderOptions(color=color))
            plain = _COLOUR.sub("", out)  # hangdoc's own colours
            assert not any(ln.lstrip(" -*`>#").startswith("» no-hang: nothing") for ln in plain.splitlines()), fmt
            assert "\\n» no-hang: nothing is wrong" in out, fmt
            assert BIDI not in out and "\\u202e" in out, fmt
            assert "\x1b[2J" not in out and "\\x1b" in out and (color or "\x1b" not in out), fmt


def test_html_and_json_keep_the_text_inert(tmp_path):
    report = hostile_job(tmp_path)
    html = render(report, "html", RenderOptions())
    assert "\x1b" not in html
    # the forged line stays inside the element it belongs to: no tag can start in the input's text
    html = render(_with_script(report), "html", RenderOptions())
    assert "<script>alert(1)" not in html and "&lt;script&gt;alert(1)" in html
    data = json.loads(render(report, "json", RenderOptions()))
    sites = json.dumps(data)
    assert "\\u202e" in sites and "\\n\\u00bb no-hang" in sites


def _with_script(report):
    for f in report.findings:
        f.summary += "<script>alert(1)</script>"
    return report


def test_a_private_use_character_of_the_input_never_breaks_the_colours(tmp_path):
    # what hypothesis found (tests/test_fuzz_readers.py): U+E008 in a function name, past the colour
    # codes the renderer marks with private-use characters: an IndexError in the coloured text report
    path = tmp_path / "trace-node1.out"
    path.write_bytes(b'Process 0: python train.py\nPython v3.11.7 (/usr/bin/python3.11)\n\n'
                     b'Thread 0 (idle): "MainThread"\n    main\xee\x80\x88 (train.py:0)\n')
    report = analyse(read_paths([str(path)]))
    out = render(report, "text", RenderOptions(color=True))
    assert "\\ue008" in out and "\ue008" not in out
