"""Stack and record rules that find the same kind of hang give one finding, not two."""

from __future__ import annotations

import os

from hangdoc.analysis import analyse
from hangdoc.readers import read_paths
from tests.procs import ROOT

FIXTURES = os.path.join(ROOT, "tests", "fixtures", "records")


def test_one_collective_mismatch_with_the_records_culprit_and_the_stacks_evidence():
    report = analyse(read_paths([os.path.join(FIXTURES, "skip_broadcast")]))
    mismatches = [f for f in report.findings if f.kind == "collective-mismatch"]
    assert len(mismatches) == 1
    [f] = mismatches
    assert f is report.findings[0]
    assert [c.rank for c in f.culprits] == [2]  # the records are exact; the stacks could only say "one of 1-3"
    note = [e for e in f.detail if e.startswith("the stacks alone said: ")]  # -v only: the records prove it
    assert len(note) == 1 and "pointing at ranks 1-3, not only at rank 2" in note[0]
    assert f.confidence >= 0.9
