"""The DOT tree rendered to SVG by the system's Graphviz ``dot`` (hangdoc bundles no layout engine).

    hangdoc aggregate dumps/ --format svg -o tree.svg

Without ``dot`` on PATH this raises :class:`GraphvizMissing`, which the CLI prints as one line;
the HTML report draws the same tree without Graphviz.
"""

from __future__ import annotations

import shutil
import subprocess
from typing import Optional

from hangdoc.cli import UsageError
from hangdoc.model import Report

#: seconds; the drawn tree is capped, so dot takes well under a second on it.
TIMEOUT = 60.0


class GraphvizMissing(UsageError):
    """``dot`` is not installed (a usage error: exit status 2, one line)."""


class GraphvizFailed(UsageError):
    """``dot`` ran but did not produce SVG."""


def find_dot() -> Optional[str]:
    return shutil.which("dot")


def render(report: Report, options) -> str:
    """SVG text from ``dot -Tsvg``; raises :class:`GraphvizMissing` when there is no ``dot``."""
    from hangdoc.renderers import dot

    exe = find_dot()
    if exe is None:
        raise GraphvizMissing("--format svg needs Graphviz's `dot`; install graphviz or use --format html/dot")
    source = dot.render(report, options)
    try:
        done = subprocess.run(
            [exe, "-Tsvg"],
            input=source.encode("utf-8"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            timeout=TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise GraphvizFailed(f"`dot -Tsvg` took over {TIMEOUT:.0f} s; use --format html or --max-groups")
    except OSError as e:
        raise GraphvizFailed(f"cannot run {exe}: {e.strerror or e}")
    if done.returncode != 0 or not done.stdout:
        why = done.stderr.decode("utf-8", "replace").strip().splitlines()
        raise GraphvizFailed(f"`dot -Tsvg` failed (exit {done.returncode}): {why[0] if why else 'no output'}")
    return done.stdout.decode("utf-8", "replace")
