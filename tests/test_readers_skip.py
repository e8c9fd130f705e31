"""Skipping stretches of a file that hold no anchor (hangdoc/readers/registry.py ANCHORS) loses
nothing: every real fixture read 64 bytes at a time, so that nearly every line is its own stretch
and is skipped unless it holds an anchor, gives the same processes and events as a plain read.
"""

import glob
import os

import pytest

from hangdoc.readers import read_paths, stream

HERE = os.path.dirname(os.path.abspath(__file__))
FILES = sorted(glob.glob(os.path.join(HERE, "fixtures", "logs", "*", "*.log"))
               + glob.glob(os.path.join(HERE, "fixtures", "gpu", "*", "log.txt"))
               + glob.glob(os.path.join(HERE, "fixtures", "gpu", "*", "trace-*.out"))
               + glob.glob(os.path.join(HERE, "fixtures", "dumps", "*", "*", "*.out"))
               + glob.glob(os.path.join(HERE, "fixtures", "dumps", "*", "*", "*.log"))
               + glob.glob(os.path.join(HERE, "fixtures", "dumps", "*", "*", "*.txt")))


def digest(paths):
    job = read_paths(paths)
    procs = sorted((p.host or "", p.pid or 0, -1 if p.rank is None else p.rank, p.status,
                    tuple(tuple(f.label() for f in t.frames) for t in p.threads)) for p in job.processes)
    events = sorted((e.kind, e.line, -1 if e.rank is None else e.rank, repr(sorted(e.fields.items()))) for e in job.events)
    return procs, events


def test_the_corpus_is_there():
    assert len(FILES) > 150


@pytest.mark.parametrize("chunk", [64])
def test_reading_in_tiny_stretches_loses_nothing(chunk, monkeypatch):
    whole = [digest([f]) for f in FILES]
    monkeypatch.setattr(stream, "BLOCK", chunk)
    for f, want in zip(FILES, whole):
        assert digest([f]) == want, f
