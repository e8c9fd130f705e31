"""The offline side's analysis: a :class:`~hangdoc.model.Job` in, a :class:`~hangdoc.model.Report` out.

Each stage is a function of the model; :func:`analyse` runs them in order:
grouping and the merged tree (``grouping``), then the rules (``diagnose``).
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

    report = build_report(job, granularity=granularity)
    report.findings = diagnose(report)
    return report
