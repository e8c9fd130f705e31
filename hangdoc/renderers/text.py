"""The default renderer: a compact, terminal-friendly report a person reads in one minute.

Findings first (``findings[0]`` is the headline), then the groups with counts and compressed rank
and host sets, missing ranks, the merged tree of main threads with rank sets where it branches
(library plumbing folded unless ``show_plumbing``), the other threads, and the sources' parse errors.
Colour only when ``options.color`` (the CLI sets it when stdout is a terminal).

    >>> from hangdoc.model import Frame, Job, Process, Thread
    >>> from hangdoc.analysis.grouping import build_report
    >>> from hangdoc.renderers import RenderOptions
    >>> t = Thread("1", "MainThread", (Frame("main", "train.py", 3),), is_main=True)
    >>> report = build_report(Job(processes=[Process(host="n1", pid=7, rank=0, threads=[t])]))
    >>> print(render(report, RenderOptions()).splitlines()[0])
    hangdoc: 1 process (rank 0 on host n1) from 0 sources, 1 group
"""

from __future__ import annotations

import re
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from hangdoc.model import ROLE_RANK, ROLE_UNKNOWN, STATUS_OK, Finding, Frame, Group, Process, Report, TreeNode
from hangdoc.ranges import compress_hosts, compress_ranks
from hangdoc.textsafe import visible

#: groups (and tree branches) shown when ``options.max_groups`` is None.
DEFAULT_MAX_GROUPS = 20
#: parse errors listed per report before "... and N more".
MAX_ERRORS = 20
MAX_CULPRITS = 8
#: processes without a rank are named by pid when there are at most this many of them.
MAX_PIDS = 8
#: a rank or host set longer than this is cut in the middle (``--format json`` has it whole).
MAX_SET_CHARS = 72


def render(report: Report, options) -> str:
    # Each element of lines() is one line: a newline inside one came from the input (a call site,
    # a frame name) and would print a line that looks like hangdoc's own (a forged headline), so
    # it is shown as \n, with the other control characters and the bidi overrides (textsafe.visible).
    text = "\n".join(printable(visible(line)) for line in TextReport(report, options).lines())
    if options.color:
        text = _MARK_RE.sub(_code_of, text)
    return text + "\n"


# Control characters from the input (an escape sequence in a file name, a thread name with a
# carriage return) must not reach the terminal as such: they are shown as \x1b, \r. Colour codes
# are placed as private-use marks while the text is cleaned, then turned into escape sequences (a
# mark in the input can only become one of these colour codes).
_CONTROL_RE = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f]")
_MARK0 = 0xE000
_MARK_RE = re.compile("[\ue000-\ue0ff]")


def _code_of(m: "re.Match[str]") -> str:
    """The colour code of a mark; a private-use character of the input beyond the codes (a fuzzed
    function name held U+E008) is shown escaped, as text."""
    i = ord(m.group(0)) - _MARK0
    return _CODES[i] if i < len(_CODES) else "\\u%04x" % ord(m.group(0))


def printable(s: str) -> str:
    r"""``s`` with control characters (all but newline) shown as escapes.

        >>> printable("train\x1b[2J.py\tline\r")
        'train\\x1b[2J.py\\tline\\r'
    """
    return _CONTROL_RE.sub(lambda m: m.group(0).encode("unicode_escape").decode("ascii"), s)


# -- shared by the text and markdown renderers -------------------------------------------------


class Sets:
    """Compressed rank/host sets of groups and of unions of groups, each computed once.

    Tree nodes along one path share their group set, so caching on the set keeps rendering linear
    in the number of distinct stacks even for 131,072 processes.
    """

    def __init__(self) -> None:
        self._cache: Dict[Tuple[int, ...], Tuple[str, str, int, int]] = {}
        self._raw: Dict[int, Tuple[List[int], set, int, List[int]]] = {}
        #: (compressed ranks that own unranked members, how many unranked members have one)
        self._parents: Dict[Tuple[int, ...], Tuple[str, int]] = {}
        self._pids: Dict[int, List[int]] = {}

    def _members(self, g: Group) -> Tuple[List[int], set, int, List[int]]:
        raw = self._raw.get(id(g))
        if raw is None:
            members = g.members
            ranks = [r for r in [p.rank for p in members] if r is not None]
            hosts = {p.host for p in members}
            hosts.discard(None)
            hosts.discard("")
            # DataLoader workers have no rank of their own; the rank that owns them names them
            parents = [p.parent_rank for p in members if p.rank is None and p.parent_rank is not None]
            if len(members) - len(ranks) <= MAX_PIDS:
                self._pids[id(g)] = [p.pid for p in members if p.rank is None and p.pid is not None]
            raw = self._raw[id(g)] = (ranks, hosts, len(members) - len(ranks), parents)
        return raw

    def of(self, groups: Sequence[Group]) -> Tuple[str, str, int, int]:
        """(compressed ranks, compressed hosts, processes without rank, number of processes)."""
        key = tuple(sorted(id(g) for g in groups))
        hit = self._cache.get(key)
        if hit is None:
            ranks: List[int] = []
            hosts: set = set()
            parents: List[int] = []
            unranked = n = 0
            for g in groups:
                r, h, u, pr = self._members(g)
                ranks.extend(r)
                hosts |= h
                unranked += u
                parents.extend(pr)
                n += g.count
            hit = self._cache[key] = (shorten(compress_ranks(ranks)), shorten(compress_hosts(hosts)), unranked, n)
            self._parents[key] = (compress_ranks(parents), len(parents))
        return hit

    def who(self, groups: Sequence[Group], members: Optional[Sequence[Process]] = None) -> str:
        """``ranks 0-3,5 on hosts node[1-2]``, ``rank 4 on host node1 pid 42``, ``no rank, on hosts n[1-9]``."""
        ranks, hosts, unranked, n = self.of(groups)
        parents, owned = self._parents[tuple(sorted(id(g) for g in groups))]
        if parents:
            # "children of rank 3" only when it is true of all of them
            of = f"{'ranks' if ',' in parents or '-' in parents else 'rank'} {parents}"
            if owned == unranked:
                parents = f"{'a child' if owned == 1 else 'children'} of {of}"
            else:
                parents = f"{owned} of them {'a child' if owned == 1 else 'children'} of {of}"
        parts: List[str] = []
        if ranks:
            parts.append(("ranks " if ("," in ranks or "-" in ranks) else "rank ") + ranks)
        pids: List[int] = []
        if unranked and unranked <= MAX_PIDS:
            for g in groups:
                pids.extend(self._pids.get(id(g), ()))
        if unranked and not ranks and len(pids) == unranked:
            # no rank to name them by: their pids are the next best handle (py-spy dump --pid)
            text = compress_ranks(pids)
            parts.append(("pids " if ("," in text or "-" in text) else "pid ") + text)
            if parents:
                parts[-1] += f" ({parents})"
        elif unranked:
            # the count is always printed just before: say only that there is no rank
            parts.append(f"and {unranked} without rank" if ranks else ("no rank," if hosts else "no rank"))
            if parents:
                parts[-1] += f" ({parents})"
        if hosts:
            parts.append(("on hosts " if ("," in hosts or "[" in hosts) else "on host ") + hosts)
        if members is not None and len(members) == 1 and members[0].pid is not None and members[0].rank is not None:
            parts.append(f"pid {members[0].pid}")
        return " ".join(parts) if parts else f"{n} processes"


def shorten(ranges: str, limit: int = MAX_SET_CHARS) -> str:
    """A compressed set cut in its middle for a terminal, ``…(+9)`` counting the ranges left out;
    JSON keeps it whole.

        >>> shorten("1-5,7-9,11,13,15,17,19,21,23,25,27,29", 24)
        '1-5,7-9,…(+9),29'
    """
    if len(ranges) <= limit:
        return ranges
    # split on commas outside host brackets
    parts, depth, cur = [], 0, []
    for ch in ranges:
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
            continue
        depth += ch == "["
        depth -= ch == "]"
        cur.append(ch)
    parts.append("".join(cur))
    for i, part in enumerate(parts):  # a hostlist's bracket: cut inside it
        if len(part) > limit and part.endswith("]") and "[" in part:
            prefix, inner = part[:-1].split("[", 1)
            parts[i] = f"{prefix}[{shorten(inner, max(limit - len(prefix) - 2, 16))}]"
    if len(parts) < 3:
        return ",".join(parts)
    head: List[str] = []
    used = len(parts[-1]) + 12
    for part in parts[:-1]:
        if head and used + len(part) + 1 > limit:
            break
        head.append(part)
        used += len(part) + 1
    hidden = len(parts) - 1 - len(head)
    if hidden <= 0:
        return ",".join(parts)
    return ",".join(head) + f",…(+{hidden})," + parts[-1]


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}es" if word.endswith(("s", "ch", "sh", "x")) else f"{n} {word}s"


def roles(g: Group) -> str:
    """``dataloader-worker`` when the group is not made of plain ranks."""
    seen = sorted({p.role for p in g.members if p.role not in (ROLE_RANK, ROLE_UNKNOWN)})
    return ",".join(seen)


def is_plumbing_fn() -> Callable[[Frame], bool]:
    from hangdoc.analysis.grouping import _load_is_plumbing

    pred = _load_is_plumbing()

    def safe(f: Frame) -> bool:
        try:
            return bool(pred(f))
        except Exception:
            return False

    return safe


def candidates_label(candidates: Sequence[object]) -> str:
    """The label of a finding's candidates: one of several, or a lone suspect the evidence does not prove."""
    if len(candidates) == 1:
        return "candidate (a suspect the evidence does not prove)"
    return "candidates (one of them; the evidence cannot say which)"


def describe_culprits(culprits) -> str:
    if not culprits:
        return ""
    if len(culprits) <= MAX_CULPRITS:
        out = []
        for c in culprits:
            who = f"rank {c.rank}" if c.rank is not None else "process"
            where = " ".join(x for x in (c.host or "", f"pid {c.pid}" if c.pid is not None else "") if x)
            out.append(f"{who} ({where})" if where else who)
        return ", ".join(out)
    ranks = compress_ranks(c.rank for c in culprits if c.rank is not None)
    hosts = compress_hosts(c.host for c in culprits if c.host)
    s = f"{len(culprits)} processes"
    if ranks:
        s += f": ranks {ranks}"
    if hosts:
        s += f" on hosts {hosts}"
    return s


#: evidence lines of the headline a terse report shows (``-v`` shows all, JSON has all).
TERSE_EVIDENCE = 3


def evidence_shown(f: Finding, verbose: bool) -> Tuple[List[str], List[str], int]:
    """(evidence lines to show, detail lines to show, how many lines are left out): terse, the
    lines that prove the verdict, at most :data:`TERSE_EVIDENCE`; ``verbose``, every line.

        >>> f = Finding("collective-mismatch", "s", evidence=["a", "b", "c", "d"], detail=["why"])
        >>> evidence_shown(f, False), evidence_shown(f, True)
        ((['a', 'b', 'c'], [], 2), (['a', 'b', 'c', 'd'], ['why'], 0))
    """
    if verbose:
        return list(f.evidence), list(f.detail), 0
    shown = list(f.evidence[:TERSE_EVIDENCE])
    return shown, [], len(f.evidence) + len(f.detail) - len(shown)


def tree_lines(
    report: Report,
    sets: Sets,
    shown: Dict[int, int],
    show_plumbing: bool,
    paint: Callable[[str, str], str] = lambda s, style: s,
) -> Tuple[List[str], int]:
    """The merged tree as lines, and how many plumbing frames were folded.

    A chain of single-child nodes prints at one indent; a branch indents its children and draws
    ``├─``/``└─``. Each branch's first line carries its rank set; leaves carry their group numbers.
    Only nodes reached by a shown group are drawn (``shown``: id(group) -> its number).
    """
    plumbing = is_plumbing_fn()
    cache: Dict[Frame, bool] = {}

    def folded(f: Frame) -> bool:
        v = cache.get(f)
        if v is None:
            v = cache[f] = (not show_plumbing) and plumbing(f)
        return v

    lines: List[str] = []
    folded_count = 0
    total = report.tree.count

    def visible(n: TreeNode) -> List[TreeNode]:
        return [c for c in n.children if any(id(g) in shown for g in c.groups)]

    # work items: (node, its depth, indent, branch marker); a chain of single children is one item.
    work: List[Tuple[TreeNode, int, str, str]] = []
    root_kids = visible(report.tree)
    hidden_root = len(report.tree.children) - len(root_kids)
    for i in range(len(root_kids) - 1, -1, -1):
        # several outermost frames (different scripts, launchers, workers): draw them as branches too
        marker = "" if len(root_kids) == 1 else ("└─ " if i == len(root_kids) - 1 and not hidden_root else "├─ ")
        work.append((root_kids[i], 1, "", marker))
    while work:
        node, depth, indent, marker = work.pop()
        first = True
        while True:
            f = node.frame
            kids = visible(node)
            hidden = len(node.children) - len(kids)
            ends_here = [g for g in node.groups if id(g) in shown and len(g.stack) == depth]
            continues = len(kids) == 1 and not hidden and not ends_here
            if continues and f is not None and folded(f):
                folded_count += 1
            else:
                label = f.label() if f is not None else "(no frame)"
                style = "plumbing" if (f is not None and plumbing(f)) else ("native" if f is not None and f.native else "frame")
                notes: List[str] = []
                if first:
                    notes.append(paint(f"[{node.count}/{total}: {sets.who(node.groups)}]", "ranks"))
                if ends_here:
                    notes.append(paint(" ".join(f"#{k}" for k in sorted(shown[id(g)] for g in ends_here)), "group"))
                text = (marker if first else _cont(marker)) + paint(label, style)
                lines.append(indent + text + ("  " + "  ".join(notes) if notes else ""))
                first = False
            if continues:
                node = kids[0]
                depth += 1
                continue
            child_indent = indent + _cont(marker)
            for i in range(len(kids) - 1, -1, -1):
                work.append((kids[i], depth + 1, child_indent, "└─ " if (i == len(kids) - 1 and not hidden) else "├─ "))
            if hidden:
                # drawn after the shown branches: pushed first so it pops last
                work.insert(len(work) - len(kids), (None, 0, child_indent, f"└─ … {plural(hidden, 'more branch')} not shown"))  # type: ignore[arg-type]
            break
        while work and work[-1][0] is None:
            _, _, ind, msg = work.pop()
            lines.append(ind + paint(msg, "dim"))
    if hidden_root:
        lines.append(paint(f"… {plural(hidden_root, 'more root')} not shown", "dim"))
    return lines, folded_count


def _cont(marker: str) -> str:
    if not marker:
        return ""
    return "   " if marker.startswith("└") else "│  "


# -- the text report ----------------------------------------------------------------------------

_RESET = "\033[0m"
_STYLES = {
    "title": "\033[1m",
    "headline": "\033[1;31m",
    "kind": "\033[1;33m",
    "ranks": "\033[36m",
    "group": "\033[35m",
    "plumbing": "\033[2m",
    "native": "\033[2m",
    "dim": "\033[2m",
    "error": "\033[31m",
    "frame": "",
    "summary": "\033[1m",
}
_CODES = [_RESET] + sorted({c for c in _STYLES.values() if c})


class TextReport:
    def __init__(self, report: Report, options) -> None:
        self.r = report
        self.o = options
        self.sets = Sets()
        self.max_groups = options.max_groups if options.max_groups is not None else DEFAULT_MAX_GROUPS

    def paint(self, s: str, style: str) -> str:
        code = _STYLES.get(style, "")
        if not (self.o.color and code and s):
            return s
        return f"{chr(_MARK0 + _CODES.index(code))}{s}{chr(_MARK0 + _CODES.index(_RESET))}"

    def lines(self) -> List[str]:
        out: List[str] = []
        out.append(self.title())
        out += self.findings()
        out += self.groups()
        out += self.missing()
        out += self.tree()
        out += self.threads()
        out += self.sources()
        return out

    def title(self) -> str:
        r = self.r
        n = len(r.job.processes)
        text = f"hangdoc: {plural(n, 'process')}"
        if n:
            text += f" ({self.sets.who(r.groups)})"
        if r.job.records:
            ranks = compress_ranks(rec.rank for rec in r.job.records)
            text += f", {plural(len(r.job.records), 'record')} ({'ranks' if ',' in ranks or '-' in ranks else 'rank'} {shorten(ranks)})"
        text += f" from {plural(len(r.job.sources), 'source')}, {plural(len(r.groups), 'group')}"
        return self.paint(text, "title")

    def findings(self) -> List[str]:
        out: List[str] = []
        if not self.r.findings:
            return out
        out.append("")
        for i, f in enumerate(self.r.findings):
            out += self.finding(f, headline=(i == 0))
        return out

    def finding(self, f: Finding, headline: bool) -> List[str]:
        head = f"{f.kind}: {f.summary}"
        out = [self.paint(("» " if headline else "  ") + head, "headline" if headline else "kind")]
        culprits = describe_culprits(f.culprits)
        if culprits:
            out.append(f"    culprits: {culprits}")
        if f.candidates:
            out.append(f"    {candidates_label(f.candidates)}: {describe_culprits(f.candidates)}")
        if headline:
            shown, detail, hidden = evidence_shown(f, getattr(self.o, "verbose", False))
            out += [f"    evidence: {e}" for e in shown]
            out += [f"    detail: {e}" for e in detail]
            if hidden:
                out.append(self.paint(f"    (+{plural(hidden, 'more evidence line')}: -v shows them)", "dim"))
            for a in f.advice:
                out.append(f"    advice: {a}")
        return out

    def groups(self) -> List[str]:
        r = self.r
        if not r.groups:
            return []
        out = ["", self.paint(f"Groups (main-thread stacks, {r.granularity}, largest first)", "title")]
        width = len(str(r.groups[0].count))
        for i, g in enumerate(r.groups[: self.max_groups], 1):
            role = roles(g)
            status = "" if g.status == STATUS_OK else f" {g.status.upper()}"
            out.append(
                f"  {self.paint(f'#{i}'.rjust(len(str(min(len(r.groups), self.max_groups))) + 1), 'group')} {g.count:>{width}} × {self.paint(self.sets.who([g], g.members), 'ranks')}"
                + (f" ({role})" if role else "")
                + self.paint(status, "error")
            )
            out.append("     " + self.paint(g.summary, "summary"))
        rest = r.groups[self.max_groups:]
        if rest:
            out.append(self.paint(f"  … {plural(len(rest), 'more group')} ({plural(sum(g.count for g in rest), 'process')}) not shown", "dim"))
        return out

    def missing(self) -> List[str]:
        r = self.r
        if not r.missing_ranks:
            return []
        n = len(r.missing_ranks)
        return ["", self.paint(f"Missing: {'rank' if n == 1 else 'ranks'} {compress_ranks(r.missing_ranks)} ({n} of world size {r.job.world_size}: no dump, no records)", "error")]

    def tree(self) -> List[str]:
        r = self.r
        if not r.tree.children:
            return []
        shown = {id(g): i for i, g in enumerate(r.groups[: self.max_groups], 1)}
        lines, folded = tree_lines(r, self.sets, shown, self.o.show_plumbing, self.paint)
        note = f"; {plural(folded, 'plumbing frame')} folded, --show-plumbing shows them" if folded else ""
        return ["", self.paint(f"Merged tree (main threads, outermost first{note})", "title")] + ["  " + s for s in lines]

    def threads(self) -> List[str]:
        tg, own = _split_own_threads(self.r.thread_groups)
        if not tg and not own:
            return []
        out = ["", self.paint("Other threads (grouped by stack)", "title")]
        for i, g in enumerate(tg[: self.max_groups], 1):
            names = ", ".join(g.thread_names[:3]) + (", …" if len(g.thread_names) > 3 else "")
            out.append(
                f"  {self.paint(f't{i}', 'group')} {plural(g.threads, 'thread')} in {plural(g.count, 'process')}: "
                + self.paint(self.sets.who([g], g.members), "ranks")
                + (f" ({names})" if names else "")
            )
            out.append("     " + g.summary)
        if len(tg) > self.max_groups:
            out.append(self.paint(f"  … {plural(len(tg) - self.max_groups, 'more thread group')} not shown", "dim"))
        if own:
            n = sum(g.threads for g in own)
            where = sorted({g.summary for g in own})
            out.append(self.paint(f"  (hangdoc's own: {plural(n, 'thread')} not shown: "
                                  + "; ".join(where[:4]) + ("; …" if len(where) > 4 else "") + ")", "dim"))
        return out


    def sources(self) -> List[str]:
        srcs = sorted(self.r.job.sources, key=lambda s: s.path)  # input order must not show
        if not srcs:
            return []
        errors = [e for s in srcs for e in s.errors]
        records = sum(s.records for s in srcs)
        line = f"Sources: {plural(len(srcs), 'file')}, {plural(sum(s.processes for s in srcs), 'process')}"
        if records:
            line += f", {plural(records, 'record')}"
        line += f", {plural(len(errors), 'parse error')}"
        out = ["", self.paint(line, "title")]
        for e in errors[:MAX_ERRORS]:
            out.append("  " + self.paint(str(e), "error"))
        if len(errors) > MAX_ERRORS:
            out.append(self.paint(f"  … {len(errors) - MAX_ERRORS} more (--format json lists them all)", "dim"))
        return out


def _split_own_threads(groups):
    """(the user's thread groups, hangdoc's own: watchdog, output-prefix reader, detector)."""
    try:
        from hangdoc.analysis.normalize import is_hangdoc_thread
    except Exception:  # pragma: no cover - normalize absent from this build
        return list(groups), []
    theirs, own = [], []
    for g in groups:
        (own if is_hangdoc_thread(g.stack) else theirs).append(g)
    return theirs, own
