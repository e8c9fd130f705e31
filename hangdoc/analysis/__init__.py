"""The offline side's analysis: a :class:`~hangdoc.model.Job` in, a :class:`~hangdoc.model.Report` out.

Each stage is a function of the model; :func:`analyse` runs them in order: completion states
reconciled across sources (``refine.refine_states``), grouping and the merged tree
(``grouping``), then the rules (``diagnose``).
"""

from __future__ import annotations

from hangdoc.model import Job, Report


def analyse(job: Job, granularity: str = "function+line") -> Report:
    """Group, merge and diagnose ``job``.

    >>> from hangdoc.model import Job
    >>> analyse(Job()).findings[0].kind
    'no-hang'
    """
    from hangdoc.analysis.diagnose import diagnose
    from hangdoc.analysis.grouping import build_report
    from hangdoc.analysis.refine import refine_states

    refine_states(job.records)  # Flight Recorder's completion states refine hangdoc's
    report = build_report(job, granularity=granularity)
    report.findings = diagnose(report)
    return report
