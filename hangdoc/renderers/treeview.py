"""The merged tree as it is drawn: capped, compacted, with plumbing folded and culprits marked.

The HTML and DOT renderers draw the same picture, so the decisions about *what* to draw live here
and the renderers only decide *how*:

* only the ``max_groups`` largest groups are drawn (plus every group holding a culprit), so the
  picture is bounded by distinct stacks, never by the number of processes;
* a chain of single-child nodes becomes one box (a list of frames), as STAT's compacted view does;
* runs of library plumbing frames (``hangdoc.analysis.normalize.is_plumbing``) fold into one
  ``… N frames`` line, and so do the middles of very long boxes; the folded frames stay available
  for the renderer to show on demand.

Example::

    >>> from hangdoc.model import Frame, Group, Process, Report, TreeNode
    >>> a, b, c = Frame("<module>", "train.py", 9), Frame("step", "train.py", 5), Frame("load", "data.py", 2)
    >>> g1 = Group(stack=(a, b), members=[Process(rank=r) for r in range(3)])
    >>> g2 = Group(stack=(a, c), members=[Process(rank=3)])
    >>> n_b, n_c = TreeNode(b, [g1]), TreeNode(c, [g2])
    >>> tree = TreeNode(None, [g1, g2], [TreeNode(a, [g1, g2], [n_b, n_c])])
    >>> view = build_view(Report(job=None, groups=[g1, g2], tree=tree))
    >>> [line.text for line in view.root.children[0].lines]
    ['<module>  train.py:9']
    >>> [(c.who, c.count) for c in view.root.children[0].children]
    [('ranks 0-2', 3), ('rank 3', 1)]
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from hangdoc.model import Frame, Group, Process, Report, TreeNode
from hangdoc.ranges import compress_hosts, describe_ranks

#: drawn groups when RenderOptions.max_groups is None.
DEFAULT_MAX_GROUPS = 30
#: a box longer than this many lines keeps its head and tail and folds its middle.
MAX_LINES = 12
HEAD_LINES = 4


def plumbing_test() -> Callable[[Frame], bool]:
    """``normalize.is_plumbing`` when the readers' normaliser is present, else "nothing is plumbing"."""
    try:
        from hangdoc.analysis.normalize import is_plumbing
    except ImportError:
        return lambda frame: False
    return is_plumbing


def short_location(frame: Frame) -> str:
    """``file.py:12`` (the base name only: the full path is in the tooltip)."""
    if not frame.file:
        return ""
    base = os.path.basename(frame.file.replace("\\", "/")) or frame.file
    return f"{base}:{frame.line}" if frame.line is not None else base


@dataclass
class Line:
    """One line of a box: a frame, or a fold of several frames."""

    text: str
    #: the frames this line stands for (one, or the folded ones).
    frames: Tuple[Frame, ...]
    folded: bool = False
    plumbing: bool = False


@dataclass
class ViewNode:
    """A box of the drawn tree."""

    ident: int
    lines: List[Line]
    #: indices into ``report.groups`` of the drawn groups passing through this box.
    groups: List[int]
    #: indices of the drawn groups whose stack ends in this box.
    ends: List[int]
    count: int
    #: who took this branch: ``ranks 0-3``; hosts (and a pid) when the dumps do not name ranks.
    who: str
    culprit: bool
    children: List["ViewNode"] = field(default_factory=list)


@dataclass
class View:
    root: ViewNode
    #: indices into ``report.groups`` that are drawn, largest first.
    drawn: List[int]
    #: indices of groups holding a culprit.
    culprit_groups: Set[int]
    hidden_groups: int
    hidden_processes: int
    total_processes: int
    nodes: List[ViewNode]


def culprit_groups(report: Report) -> Set[int]:
    """Indices of the groups that hold a process named as a culprit by any finding."""
    wanted_ranks: Set[int] = set()
    wanted_procs: Set[Tuple[Optional[str], Optional[int]]] = set()
    for finding in report.findings:
        for c in finding.culprits:
            if c.rank is not None:
                wanted_ranks.add(c.rank)
            elif c.pid is not None:
                wanted_procs.add((c.host, c.pid))
    if not wanted_ranks and not wanted_procs:
        return set()
    found: Set[int] = set()
    for i, g in enumerate(report.groups):
        for p in g.members:
            if (p.rank is not None and p.rank in wanted_ranks) or (p.host, p.pid) in wanted_procs:
                found.add(i)
                break
    return found


def _tree_from_groups(groups: Sequence[Group]) -> TreeNode:
    """A merged prefix tree, for a Report whose ``tree`` was left empty (built by hand, say)."""
    root = TreeNode(frame=None, groups=list(groups))
    for g in groups:
        node = root
        for frame in g.stack:
            for child in node.children:
                if child.frame == frame:
                    break
            else:
                child = TreeNode(frame=frame)
                node.children.append(child)
            child.groups.append(g)
            node = child
    return root


def _fold(frames: Sequence[Frame], is_plumbing: Callable[[Frame], bool], show_plumbing: bool, keep_last: bool = False) -> List[Line]:
    """Lines for a box; ``keep_last`` keeps the innermost frame in view (where a group is stuck)."""
    lines: List[Line] = []
    run: List[Frame] = []

    def flush() -> None:
        if len(run) >= 2:
            lines.append(Line(f"… {len(run)} library frames", tuple(run), folded=True, plumbing=True))
        else:
            lines.extend(Line(frame_text(f), (f,), plumbing=True) for f in run)
        run.clear()

    last = len(frames) - 1 if keep_last else -1
    for k, f in enumerate(frames):
        plumbing = not show_plumbing and is_plumbing(f)
        if plumbing and k != last:
            run.append(f)
            continue
        flush()
        lines.append(Line(frame_text(f), (f,), plumbing=plumbing))
    flush()
    if len(lines) > MAX_LINES:
        tail = MAX_LINES - HEAD_LINES - 1
        middle = lines[HEAD_LINES:-tail]
        hidden = tuple(f for line in middle for f in line.frames)
        lines = lines[:HEAD_LINES] + [Line(f"… {len(hidden)} frames", hidden, folded=True)] + lines[-tail:]
    return lines


def who(members: Sequence[Process]) -> str:
    """``ranks 0-3``, ``ranks 0-3 and 2 processes without rank``, ``hosts n[1-2]``, ``n1 pid 42``.

        >>> who([Process(rank=0), Process(rank=1), Process(host="n1", pid=7)])
        'ranks 0-1 and 1 process without rank'
        >>> who([Process(host="n1", pid=7)])
        'n1 pid 7'
    """
    ranks = [p.rank for p in members if p.rank is not None]
    rest = len(members) - len(ranks)
    if ranks:
        text = describe_ranks(ranks)
        if rest:
            text += f" and {rest} process{'' if rest == 1 else 'es'} without rank"
        return text
    if len(members) == 1:
        p = members[0]
        return " ".join(x for x in (p.host or "", f"pid {p.pid}" if p.pid is not None else "") if x)
    hosts = sorted({p.host for p in members if p.host})
    if not hosts:
        return ""
    return ("host " if len(hosts) == 1 else "hosts ") + compress_hosts(hosts)


def frame_text(frame: Frame) -> str:
    loc = short_location(frame)
    return f"{frame.function}  {loc}" if loc else frame.function


def build_view(report: Report, max_groups: Optional[int] = None, show_plumbing: bool = False) -> View:
    """Select, compact and fold ``report.tree`` for drawing (see the module docstring)."""
    limit = DEFAULT_MAX_GROUPS if max_groups is None else max(1, max_groups)
    is_plumbing = plumbing_test()
    guilty = culprit_groups(report)
    order = sorted(range(len(report.groups)), key=lambda i: -report.groups[i].count)
    drawn = sorted(set(order[:limit]) | guilty, key=lambda i: -report.groups[i].count)
    index_of: Dict[int, int] = {id(report.groups[i]): i for i in drawn}
    total = sum(g.count for g in report.groups)
    drawn_total = sum(report.groups[i].count for i in drawn)

    tree = report.tree
    if tree is None or (not tree.children and any(g.stack for g in report.groups)):
        tree = _tree_from_groups(report.groups)

    nodes: List[ViewNode] = []

    def kept(node: TreeNode) -> List[int]:
        return [index_of[id(g)] for g in node.groups if id(g) in index_of]

    def make(frames: List[Frame], groups: List[int], ends: List[int]) -> ViewNode:
        count = sum(report.groups[i].count for i in groups)
        v = ViewNode(
            ident=len(nodes),
            lines=_fold(frames, is_plumbing, show_plumbing, keep_last=bool(ends)),
            groups=groups,
            ends=ends,
            count=count,
            who=who([p for i in groups for p in report.groups[i].members]),
            culprit=any(i in guilty for i in groups),
        )
        nodes.append(v)
        return v

    root_groups = sorted(index_of.values(), key=lambda i: -report.groups[i].count)
    root = make([], root_groups, [i for i in root_groups if not report.groups[i].stack])
    # Iterative on purpose: a recursion hang has stacks deeper than Python's recursion limit.
    work: List[Tuple[TreeNode, ViewNode, int]] = [(tree, root, 0)]
    while work:
        node, parent_view, depth = work.pop()
        for child in node.children:
            groups = kept(child)
            if not groups:
                continue
            frames = [child.frame] if child.frame is not None else []
            d = depth + 1
            cur = child
            while True:
                ends = [i for i in groups if len(report.groups[i].stack) == d]
                nxt = [c for c in cur.children if kept(c)]
                if ends or len(nxt) != 1:
                    break
                cur = nxt[0]
                d += 1
                if cur.frame is not None:
                    frames.append(cur.frame)
            groups.sort(key=lambda i: -report.groups[i].count)
            v = make(frames, groups, ends)
            parent_view.children.append(v)
            work.append((cur, v, d))
    _sort_children(root, report)
    return View(
        root=root,
        drawn=drawn,
        culprit_groups=guilty,
        hidden_groups=len(report.groups) - len(drawn),
        hidden_processes=total - drawn_total,
        total_processes=total,
        nodes=nodes,
    )


def _sort_children(root: ViewNode, report: Report) -> None:
    # Largest branch first, then the order of first appearance, so the picture is stable.
    stack = [root]
    while stack:
        v = stack.pop()
        v.children.sort(key=lambda c: (-c.count, c.ident))
        stack.extend(v.children)


def walk(root: ViewNode) -> Iterable[ViewNode]:
    """Pre-order, without recursion."""
    stack = [root]
    while stack:
        v = stack.pop()
        yield v
        stack.extend(reversed(v.children))
