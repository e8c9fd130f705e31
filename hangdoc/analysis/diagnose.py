"""Turn a grouped report into findings: run every rule, rank by confidence, headline first.

A rule is a function ``rule(report) -> Iterable[Finding]``; a new hang class is one new rule in
``RULES``. A rule that raises is reported as a finding-free failure on stderr, never a crash.
"""

from __future__ import annotations

import importlib
import sys
from typing import Callable, Iterable, List

from hangdoc.model import Finding, Report

Rule = Callable[[Report], Iterable[Finding]]

#: "module:function" of every rule, in no particular order (findings are sorted afterwards).
RULES: List[str] = [
    "hangdoc.analysis.stack_rules:findings",
    "hangdoc.analysis.record_rules:findings",
]


def _load(spec: str) -> Rule:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def diagnose(report: Report) -> List[Finding]:
    found: List[Finding] = []
    for spec in RULES:
        try:
            rule = _load(spec)
        except (ImportError, AttributeError):
            continue  # a rule module not present in this build
        try:
            found.extend(rule(report))
        except Exception as e:  # one broken rule must not hide the others' verdicts
            print(f"hangdoc: rule {spec} failed: {type(e).__name__}: {e}", file=sys.stderr)
    found = merge(found)
    if not found:
        found = [
            Finding(
                kind="no-hang",
                summary="no hang signature: every process is busy or progressing",
                advice=["If the job is stuck anyway, take dumps again a minute later and compare."],
                confidence=0.3,
            )
        ]
    return found


def merge(found: List[Finding]) -> List[Finding]:
    """Sort by confidence (stable), and drop a ``no-hang`` when any other finding exists."""
    real = [f for f in found if f.kind != "no-hang"]
    keep = real if real else found
    return sorted(keep, key=lambda f: -f.confidence)
