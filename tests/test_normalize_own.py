"""hangdoc's own frames and threads are plumbing; one file printed at two lengths is one file."""

from __future__ import annotations

import os

from hangdoc.analysis import analyse
from hangdoc.analysis.normalize import is_plumbing
from hangdoc.model import Frame
from hangdoc.readers import read_paths
from hangdoc.renderers import RenderOptions, render
from tests.procs import ROOT

DEMO = os.path.join(ROOT, "tests", "fixtures", "records", "dataloader_demo")
STOPPED = os.path.join(ROOT, "tests", "fixtures", "dumps", "stopped_rank")


def test_recorder_wrapper_and_cli_frames_are_plumbing():
    assert is_plumbing(Frame("wrapper", "/work/main/hangdoc/runtime/recorder.py", 670))
    assert is_plumbing(Frame("_patch.<locals>.wrapper", "hangdoc/runtime/recorder.py", 670))
    assert is_plumbing(Frame("<module>", "/usr/lib/python3/site-packages/hangdoc/__main__.py", 7))
    assert not is_plumbing(Frame("main", "hangdoc_train.py", 7))


def test_report_folds_hangdoc_frames_and_hides_its_threads():
    text = render(analyse(read_paths([DEMO])), "text", RenderOptions())
    tree = text[text.index("Merged tree"):text.index("Other threads")]
    assert "recorder.py" not in tree and "hangdoc/cli" not in tree and "__main__.py" not in tree
    threads = text[text.index("Other threads"):]
    assert "prefix.py" not in threads.split("(hangdoc's own")[0]
    assert "(hangdoc's own: " in threads


def test_short_and_full_paths_of_one_file_group_together():
    report = analyse(read_paths([os.path.join(STOPPED, d) for d in ("plain", "faulthandler")]))
    formats = [sorted({p.format for p in g.members}) for g in report.groups]
    assert ["faulthandler", "py-spy"] in formats, formats
    files = {f.file for g in report.groups for f in g.stack if not f.native}
    assert not any(f.endswith("/stopped_rank.py") for f in files), files
