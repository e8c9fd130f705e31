"""The JSON renderer: a stable, versioned schema (documented in docs/json.md).

    >>> import json as _json
    >>> from hangdoc.model import Frame, Job, Process, Thread
    >>> from hangdoc.analysis.grouping import build_report
    >>> from hangdoc.renderers import RenderOptions
    >>> t = Thread("1", "MainThread", (Frame("main", "train.py", 3),), is_main=True)
    >>> doc = _json.loads(render(build_report(Job(processes=[Process(host="n1", pid=7, rank=0, threads=[t])])), RenderOptions()))
    >>> doc["version"], doc["processes"], doc["groups"][0]["ranks"], doc["groups"][0]["members"]
    (1, 1, '0', [{'host': 'n1', 'pid': 7, 'rank': 0}])
"""

from __future__ import annotations

import json
from typing import Any, Dict, List

from hangdoc.model import ROLE_UNKNOWN, Frame, Group, Report, TreeNode
from hangdoc.ranges import compress_hosts, compress_ranks

#: bumped on any incompatible change; additions of keys do not bump it.
VERSION = 1
#: above this many processes the output is compact (the indenting encoder is pure Python and slow).
INDENT_UP_TO = 2000
#: and above this many characters of compact JSON
INDENT_UP_TO_CHARS = 1 << 20
#: log events listed (a log of 100,000 ranks' timeouts is summed up by the findings)
MAX_EVENTS = 10000


def render(report: Report, options) -> str:
    doc = to_json(report)
    if len(report.job.processes) > INDENT_UP_TO:
        return json.dumps(doc, separators=(",", ":"), ensure_ascii=False) + "\n"
    # compact first (the C encoder): a few processes can still make a big document (a runaway
    # stack of 20,000 frames kept: 0.4 s of indenting, found by the fuzz run), which stays compact
    compact = json.dumps(doc, separators=(",", ":"), ensure_ascii=False)
    if len(compact) > INDENT_UP_TO_CHARS:
        return compact + "\n"
    return json.dumps(doc, indent=2, ensure_ascii=False) + "\n"


def to_json(report: Report) -> Dict[str, Any]:
    """The report as plain JSON-able data (what :func:`render` serialises)."""
    job = report.job
    ids = {id(g): i for i, g in enumerate(report.groups, 1)}
    return {
        "version": VERSION,
        "granularity": report.granularity,
        "processes": len(job.processes),
        "world_size": job.world_size,
        "sources": [
            {
                "path": s.path,
                "processes": s.processes,
                "records": s.records,
                "events": s.events,
                "truncated": s.truncated,
                "formats": list(s.formats),
                "errors": [str(e) for e in s.errors],
            }
            for s in sorted(job.sources, key=lambda s: s.path)  # input order must not show
        ],
        "groups": [_group(g, i) for i, g in enumerate(report.groups, 1)],
        "tree": _tree(report.tree, ids),
        "findings": [f.to_json() for f in report.findings],
        "missing_ranks": compress_ranks(report.missing_ranks),
        "thread_groups": [_group(g, i, thread=True) for i, g in enumerate(report.thread_groups, 1)],
        "events": [e.to_json() for e in job.events[:MAX_EVENTS]],
    }


def _frame(f: Frame) -> Dict[str, Any]:
    return {"function": f.function, "file": f.file, "line": f.line, "native": f.native}


def _group(g: Group, gid: int, thread: bool = False) -> Dict[str, Any]:
    d: Dict[str, Any] = {
        "id": gid,
        "count": g.count,
        "ranks": compress_ranks(p.rank for p in g.members if p.rank is not None),
        "hosts": compress_hosts(p.host for p in g.members if p.host),
        "status": g.status,
        "roles": sorted({p.role for p in g.members if p.role not in (ROLE_UNKNOWN,)} or {ROLE_UNKNOWN}),
        "summary": g.summary,
        "members": [{"host": p.host, "pid": p.pid, "rank": p.rank} for p in g.members],
        "stack": [_frame(f) for f in g.stack],
    }
    if thread:
        d["threads"] = g.threads
        d["thread_names"] = list(g.thread_names)
    return d


def _tree(root: TreeNode, ids: Dict[int, int]) -> List[Dict[str, Any]]:
    """The merged tree as a flat list of nodes in depth-first order, parents before children.

    Each node is ``{id, parent, frames, count, groups}``: a chain of single-child nodes that the
    same processes pass through is one node with several ``frames`` (outermost first), so the list
    grows with branch points, and a flat list cannot overflow any JSON parser's nesting limit
    however deep the stacks are. The root has ``id`` 0, ``parent`` null and no frames.
    """
    out: List[Dict[str, Any]] = []
    work: List[Any] = [(root, None)]
    while work:
        n, parent = work.pop()
        frames = [] if n.frame is None else [_frame(n.frame)]
        node = n
        while n.frame is not None and len(node.children) == 1 and node.children[0].count == node.count:
            node = node.children[0]
            frames.append(_frame(node.frame))  # type: ignore[arg-type]
        nid = len(out)
        out.append({
            "id": nid,
            "parent": parent,
            "frames": frames,
            "count": n.count,
            "groups": sorted(ids[id(g)] for g in n.groups if id(g) in ids),
        })
        for c in reversed(node.children):
            work.append((c, nid))
    return out
