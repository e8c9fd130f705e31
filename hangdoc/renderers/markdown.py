"""The Markdown renderer: for pasting into an issue or a pull request.

Headline finding, a table of groups, the merged tree in a code block, parse errors.

    >>> from hangdoc.model import Frame, Job, Process, Thread
    >>> from hangdoc.analysis.grouping import build_report
    >>> from hangdoc.renderers import RenderOptions
    >>> t = Thread("1", "MainThread", (Frame("main", "train.py", 3),), is_main=True)
    >>> print(render(build_report(Job(processes=[Process(host="n1", pid=7, rank=0, threads=[t])])), RenderOptions()).splitlines()[0])
    # hangdoc report: 1 process, 1 group
"""

from __future__ import annotations

from typing import List

from hangdoc.model import STATUS_OK, Report
from hangdoc.ranges import compress_ranks
from hangdoc.renderers.text import (DEFAULT_MAX_GROUPS, MAX_ERRORS, Sets, candidates_label, describe_culprits, evidence_shown, plural, printable,
                                    roles, tree_lines)
from hangdoc.textsafe import visible


def render(report: Report, options) -> str:
    r = report
    sets = Sets()
    max_groups = options.max_groups if options.max_groups is not None else DEFAULT_MAX_GROUPS
    out: List[str] = [f"# hangdoc report: {plural(len(r.job.processes), 'process')}, {plural(len(r.groups), 'group')}", ""]
    if r.groups:
        out += [f"{_md(sets.who(r.groups))}, from {plural(len(r.job.sources), 'source')}.", ""]
    if r.findings:
        head = r.findings[0]
        out += [f"## Verdict: `{head.kind}`", "", f"**{_md(head.summary)}**", ""]
        if head.culprits:
            out += [f"- culprits: {_md(describe_culprits(head.culprits))}"]
        if head.candidates:
            out += [f"- {candidates_label(head.candidates)}: {_md(describe_culprits(head.candidates))}"]
        shown, detail, hidden = evidence_shown(head, getattr(options, "verbose", False))
        out += [f"- evidence: {_md(e)}" for e in shown]
        out += [f"- detail: {_md(e)}" for e in detail]
        if hidden:
            out.append(f"- ({plural(hidden, 'more evidence line')}: `hangdoc aggregate -v` or `--format json` has them)")
        out += [f"- advice: {_md(a)}" for a in head.advice]
        out.append("")
        if len(r.findings) > 1:
            out += ["Other findings:", ""]
            for f in r.findings[1:]:
                c = describe_culprits(f.culprits)
                out.append(f"- `{f.kind}`: {_md(f.summary)}" + (f" ({_md(c)})" if c else ""))
            out.append("")
    if r.groups:
        out += [f"## Groups (main-thread stacks, {r.granularity})", "", "| # | processes | who | where |", "|---:|---:|---|---|"]
        for i, g in enumerate(r.groups[:max_groups], 1):
            who = sets.who([g], g.members)
            extra = ", ".join(x for x in (roles(g), g.status if g.status != STATUS_OK else "") if x)
            out.append(f"| {i} | {g.count} | {_md(who)}{' (' + _md(extra) + ')' if extra else ''} | `{_code(g.summary)}` |")
        rest = r.groups[max_groups:]
        if rest:
            out.append(f"| … | {sum(g.count for g in rest)} | {plural(len(rest), 'more group')} | |")
        out.append("")
    if r.missing_ranks:
        out += [f"**Missing ranks** (no dump, no records; world size {r.job.world_size}): `{compress_ranks(r.missing_ranks)}`", ""]
    if r.tree.children:
        shown = {id(g): i for i, g in enumerate(r.groups[:max_groups], 1)}
        lines, folded = tree_lines(r, sets, shown, options.show_plumbing)
        note = f" ({plural(folded, 'plumbing frame')} folded)" if folded else ""
        out += [f"## Merged tree{note}", "", "```"] + [_fence(s) for s in lines] + ["```", ""]
    if r.thread_groups:
        out += ["## Other threads", ""]
        for g in r.thread_groups[:max_groups]:
            out.append(f"- {plural(g.threads, 'thread')} in {plural(g.count, 'process')} ({_md(sets.who([g], g.members))}): `{_code(g.summary)}`")
        out.append("")
    errors = [e for s in sorted(r.job.sources, key=lambda s: s.path) for e in s.errors]
    out += ["## Sources", "", f"{plural(len(r.job.sources), 'file')}, {plural(len(errors), 'parse error')}.", ""]
    for e in errors[:MAX_ERRORS]:
        out.append(f"- `{_code(str(e))}`")
    if len(errors) > MAX_ERRORS:
        out.append(f"- … {len(errors) - MAX_ERRORS} more")
    return "\n".join(out).rstrip("\n") + "\n"


def _md(s: str) -> str:
    r"""Escape what Markdown would turn into markup (tables, emphasis, HTML), and control characters.

        >>> print(_md("rank *3* <b>|x\x1b"))
        rank \*3\* \<b\>\|x\\x1b
    """
    s = _one_line(s)
    for ch in "\\`*_[]<>|":  # '#' only matters at a line's start, where these never are
        s = s.replace(ch, "\\" + ch)
    return s


def _one_line(s: str) -> str:
    # visible: the newline as \n, and bidi overrides shown (U+202E would reorder the line)
    return visible(printable(s))


def _code(s: str) -> str:
    return _one_line(s).replace("`", "'").replace("|", "\\|")


def _fence(s: str) -> str:
    return _one_line(s).replace("```", "'''")
