"""Graphviz DOT of the merged tree, in the spirit of STAT's call-prefix trees.

Nodes are boxes of frames (outermost at the top, chains of single-child frames compacted into one
box, library plumbing folded into ``… N library frames``), edges carry the ranks that took the
branch and how many processes they are, and the culprit's path is drawn in red. The tree is the
same one the HTML report draws (:mod:`hangdoc.renderers.treeview`), so it stays small at any scale.

    hangdoc aggregate dumps/ --format dot -o tree.dot && dot -Tsvg tree.dot -o tree.svg

    >>> from hangdoc.model import Frame, Group, Process, Report, Job
    >>> g = Group(stack=(Frame('say "hi"', "a.py", 1),), members=[Process(rank=0)])
    >>> print(render(Report(job=Job(), groups=[g]), None).splitlines()[-2])
      n1 [label="say \\"hi\\"  a.py:1\\lG1 · 1 process\\l"];
"""

from __future__ import annotations

import re
from typing import List

from hangdoc.model import Report
from hangdoc.renderers import treeview
from hangdoc.renderers.treeview import ViewNode

CULPRIT = "#c62828"
_CONTROL = re.compile("[\x00-\x1f\x7f\ud800-\udfff]")
MAX_LABEL = 200


def quote(text: str) -> str:
    """A DOT double-quoted string whose text Graphviz shows verbatim.

    Backslashes and quotes are escaped for DOT, ``&`` for Graphviz's entity decoding in labels,
    control characters (newlines included) are replaced: line breaks are ours to place.

        >>> quote('a"b\\\\c&d')
        '"a\\\\"b\\\\\\\\c&amp;d"'
    """
    text = _CONTROL.sub("\ufffd", text)
    text = text.replace("\\", "\\\\").replace('"', '\\"').replace("&", "&amp;")
    return f'"{text}"'


def _lines_label(lines: List[str]) -> str:
    parts = []
    for line in lines:
        parts.append(quote(line)[1:-1] + "\\l")
    return '"' + "".join(parts) + '"'


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 'es' if word.endswith('s') else 's'}"


def _clip(text: str, limit: int = MAX_LABEL) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def render(report: Report, options) -> str:
    """The DOT text (``digraph hangdoc { ... }``)."""
    from hangdoc.renderers import RenderOptions

    options = options or RenderOptions()
    view = treeview.build_view(report, options.max_groups, options.show_plumbing)
    out = [
        "digraph hangdoc {",
        '  graph [rankdir=TB, nodesep=0.25, ranksep=0.45, fontname="Helvetica"];',
        '  node [shape=box, style="rounded,filled", fillcolor="#ffffff", color="#9fb3c8", fontname="Courier", fontsize=10];',
        '  edge [color="#829ab1", fontname="Helvetica", fontsize=9, arrowsize=0.6];',
    ]
    total = max(1, view.total_processes)
    for v in treeview.walk(view.root):
        out.append(_node(report, view, v))
        for c in v.children:
            who = c.who
            count = _plural(c.count, "process")
            label = _lines_label([_clip(who), count] if who else [count])
            attrs = [f"label={label}", f"penwidth={1 + 4 * c.count / total:.2f}"]
            if c.culprit:
                attrs += [f'color="{CULPRIT}"', f'fontcolor="{CULPRIT}"']
            out.append(f"  n{v.ident} -> n{c.ident} [{', '.join(attrs)}];")
    if view.hidden_groups:
        out.append(
            f'  hidden [shape=note, fontname="Helvetica", label={quote(f"{view.hidden_groups} smaller groups ({view.hidden_processes} processes) not drawn")}];'
        )
    out.append("}")
    return "\n".join(out) + "\n"


def _node(report: Report, view: treeview.View, v: ViewNode) -> str:
    if v is view.root:
        n = len(view.drawn) + view.hidden_groups
        label = _lines_label([_plural(view.total_processes, "process"), _plural(n, "group")])
        return f'  n{v.ident} [label={label}, fillcolor="#334e68", fontcolor="#ffffff", color="#334e68", fontname="Helvetica"];'
    lines = [_clip(line.text) for line in v.lines]
    for i in v.ends:
        g = report.groups[i]
        tag = " · culprit" if i in view.culprit_groups else ""
        lines.append(f"G{i + 1} · {_plural(g.count, 'process')}{tag}")
    attrs = [f"label={_lines_label(lines)}"]
    if v.culprit:
        attrs += [f'color="{CULPRIT}"', 'fillcolor="#fdecea"', "penwidth=2"]
    return f"  n{v.ident} [{', '.join(attrs)}];"
