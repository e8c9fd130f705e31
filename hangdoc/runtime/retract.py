"""A stall that resolves is retracted where it was announced: the job's log and the report files.

The watchdog reports a stall after ``hang_timeout`` without progress; a checkpoint or an evaluation
that takes longer than that is a slow step, not a hang. When progress comes back, the rank that
wrote the report prints ``hangdoc: RESUMED ...`` into the log and rewrites ``report.txt`` and
``report.json`` with a ``no-hang`` finding that keeps the retracted verdict as evidence, so that
nobody reading the output directory after the job believes the earlier ``HANG``.
"""

from __future__ import annotations

import os
import time
from typing import Any, Dict, List, Optional

from hangdoc.ranges import describe_ranks


def remember(dog: Any, report: Any, text_path: Optional[str]) -> None:
    """What the stall report said, for its retraction (called by the rank that wrote it)."""
    findings = list(getattr(report, "findings", []) or [])
    head = findings[0] if findings else None
    dog.reported = {
        "kind": head.kind if head else None,
        "summary": head.summary if head else "",
        "ranks": sorted({c.rank for c in head.culprits if c.rank is not None}) if head else [],
        "at": time.time(),
        "text_path": text_path,
    }


def retraction(reported: Dict[str, Any], waited: float) -> Any:
    """The ``no-hang`` finding that retracts ``reported`` after ``waited`` seconds of stall.

    >>> f = retraction({"kind": "collective-wait", "summary": "ranks 1-3 wait in all_reduce #5 for rank 0",
    ...                 "ranks": [0], "at": 0.0}, 20.25)
    >>> f.kind, f.summary
    ('no-hang', 'resumed after 20.2s: a slow step on rank 0, no hang')
    """
    from hangdoc.model import Finding

    ranks: List[int] = reported.get("ranks") or []
    on = f" on {describe_ranks(ranks)}" if ranks else ""
    when = time.strftime("%H:%M:%S", time.localtime(reported.get("at") or 0))
    return Finding(
        kind="no-hang",
        summary=f"resumed after {waited:.1f}s: a slow step{on}, no hang",
        evidence=[f"retracted: the stall reported at {when} said [{reported.get('kind')}] {reported.get('summary')}",
                  f"progress came back after {waited:.1f}s without progress: the job was slow, not stuck"],
        advice=["If such pauses are expected (checkpoints, evaluation), raise --hang-timeout above them, or use "
                "--hang-timeout auto, which learns the job's own pauses."],
        confidence=0.9,
    )


def retract(dog: Any, waited: float, say: Any) -> None:
    """Print the retraction and rewrite the report files, if this rank wrote the stall's report."""
    reported = getattr(dog, "reported", None)
    if not reported:
        return
    dog.reported = None
    finding = retraction(reported, waited)
    say(f"hangdoc: RESUMED: {finding.summary}\nhangdoc:   {finding.evidence[0]}")
    text_path = reported.get("text_path")
    if not text_path:
        return
    from hangdoc.model import Job, Report
    from hangdoc.renderers import render
    from hangdoc.runtime.dump_files import write_file as _write_file

    report = Report(job=Job())
    report.findings = [finding]
    out_dir = os.path.dirname(text_path)
    try:
        _write_file(out_dir, text_path, render(report, "text"))
        _write_file(out_dir, os.path.join(out_dir, "report.json"), render(report, "json"))
    except Exception as e:  # the log line above is the retraction that matters most
        say(f"hangdoc watchdog: retraction not written: {type(e).__name__}: {e}")
