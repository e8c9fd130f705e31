"""A self-contained HTML report: verdict first, then the merged tree drawn as a picture.

One file with inline CSS, a few lines of inline JS and an inline SVG computed here, so that it opens
from a cluster's shared filesystem with no network. The picture is drawn from groups, never from
processes (see :mod:`hangdoc.renderers.treeview`), so 131,072 processes give a file of about the
same size as 16.

Everything that came from a dump (frame names, files, hosts, messages) goes through :func:`esc`,
and a Content-Security-Policy allows only the page's own script, by hash: an escaping slip would
still not run anything.

    >>> from hangdoc.model import Finding, Frame, Group, Process, Report, Job
    >>> p = Process(host="n1", pid=7, rank=0)
    >>> g = Group(stack=(Frame("<script>x</script>", "a.py", 1),), members=[p])
    >>> page = render(Report(job=Job(processes=[p]), groups=[g]), None)
    >>> "<script>x</script>" in page, "&lt;script&gt;x&lt;/script&gt;" in page
    (False, True)
"""

from __future__ import annotations

import base64
import hashlib
from collections import defaultdict
from typing import Dict, List, Optional, Sequence, Set, Tuple

from hangdoc.model import STATUS_OK, Culprit, Finding, Frame, Process, Report
from hangdoc.ranges import compress_hosts, compress_ranks, describe_ranks
from hangdoc.renderers import treeview
from hangdoc.renderers.text import candidates_label, evidence_shown
from hangdoc.renderers.html_picture import TreePicture
from hangdoc.renderers.html_text import clip, esc, inline, num as _num, plural as _plural
from hangdoc.renderers.treeview import View

#: how much of a long list the page shows before saying "… N more".
MAX_TEXT = 600
MAX_ROWS = 300
MAX_ERRORS = 500
MAX_CULPRITS = 40
MAX_THREAD_ROWS = 30

# Characters that are not allowed in XML (so not in inline SVG either) or that cannot be encoded.
def confidence_note(f: Finding) -> Tuple[str, str]:
    """(a word for the finding's confidence, a tooltip saying what the number means and where it comes from).

    >>> confidence_note(Finding("collective-mismatch", "s", confidence=0.95))[0]
    'certain'
    """
    c = f.confidence
    word = "certain" if c >= 0.9 else "likely" if c >= 0.7 else "plausible" if c >= 0.5 else "a guess"
    tip = (f"confidence {c:.2f} ({word}): how sure the rule that made this finding is, from 0 to 1; findings are "
           "ordered by it and the first is the headline. 0.85-0.95: a divergence, cycle or missing rank read from "
           "the collective records (what each rank issued, in order): exact. At most 0.8: inferred from stacks "
           "(where each rank waits, not which call), or records showing ranks behind without saying why. "
           "Below 0.5: the evidence cannot decide, and every candidate is named.")
    return word, tip


def pids_by_host(processes: Sequence[Process], hosts: int = 6) -> str:
    """``pids 10-12 on n1; pid 7 on n2``: processes without a rank, named the only way they can be.

    >>> pids_by_host([Process(host="n1", pid=11), Process(host="n1", pid=10), Process(host="n2", pid=7)])
    'pids 10-11 on n1; pid 7 on n2'
    """
    by_host: Dict[str, List[int]] = defaultdict(list)
    for p in processes:
        if p.pid is not None:
            by_host[p.host or "?"].append(p.pid)
    parts = []
    for host in sorted(by_host)[:hosts]:
        pids = by_host[host]
        parts.append(f"pid{'s' if len(pids) > 1 else ''} {clip(compress_ranks(pids), 200)} on {host}")
    if len(by_host) > hosts:
        parts.append(f"… {len(by_host) - hosts} more hosts")
    return "; ".join(parts)


def table(headers: Sequence[str], rows: Sequence[str], total: int, more: str) -> List[str]:
    """A table of already-rendered ``<tr>`` rows, and a note when ``total`` exceeds the rows shown."""
    out = ["<table><tr>" + "".join(f"<th>{h}</th>" for h in headers) + "</tr>"]
    out.extend(rows)
    out.append("</table>")
    if total > len(rows):
        out.append(f'<p class="note">… {_plural(total - len(rows), more)} (see <code>--format json</code>).</p>')
    return out


_SCRIPT = """
(function () {
  function toggle(el) {
    var pop = document.getElementById(el.getAttribute('data-pop'));
    if (pop) { pop.classList.toggle('open'); el.setAttribute('aria-expanded', pop.classList.contains('open')); }
  }
  document.addEventListener('click', function (ev) {
    var el = ev.target.closest && ev.target.closest('[data-pop]');
    if (el) { toggle(el); }
  });
  document.addEventListener('keydown', function (ev) {
    var el = ev.target.closest && ev.target.closest('[data-pop]');
    if (el && (ev.key === 'Enter' || ev.key === ' ')) { ev.preventDefault(); toggle(el); }
  });
  var boxes = document.querySelectorAll('[data-groups]');
  function mark(g, on) {
    for (var i = 0; i < boxes.length; i++) {
      var gs = boxes[i].getAttribute('data-groups').split(' ');
      if (gs.indexOf(g) >= 0) { boxes[i].classList.toggle('hl', on); }
    }
  }
  // A tree wider than the page scrolls inside its box: start it scrolled so that the culprit's
  // deepest box (its branch and its group's badge) is in view, not off to the right.
  var sc = document.querySelector('#tree .scroll');
  var cs = sc ? sc.querySelectorAll('svg.tree .box.culprit') : [];
  if (cs.length) {
    var far = cs[0], farx = -1;
    for (var k = 0; k < cs.length; k++) {
      var b = cs[k].getBoundingClientRect();
      if (b.right > farx) { far = cs[k]; farx = b.right; }
    }
    var r = far.getBoundingClientRect(), c = sc.getBoundingClientRect();
    if (r.right > c.right - 12) { sc.scrollLeft += Math.min(r.right - c.right + 24, r.left - c.left - 24); }
    if (r.bottom > c.bottom - 12) { sc.scrollTop += Math.min(r.bottom - c.bottom + 24, r.top - c.top - 24); }
  }
  var rows = document.querySelectorAll('[data-group]');
  for (var i = 0; i < rows.length; i++) {
    rows[i].addEventListener('mouseenter', function () { mark(this.getAttribute('data-group'), true); });
    rows[i].addEventListener('mouseleave', function () { mark(this.getAttribute('data-group'), false); });
  }
})();
"""

_CSS = """
:root { --ink:#102a43; --muted:#627d98; --line:#bcccdc; --bg:#f0f4f8; --bad:#c62828; --badbg:#fdecea; --ok:#2e7d32; }
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", "DejaVu Sans", sans-serif; color: var(--ink); margin: 0; background: #fff; }
header { background: #102a43; color: #fff; padding: 14px 24px; }
header h1 { margin: 0; font-size: 20px; font-weight: 600; }
header .stats { color: #bcccdc; margin-top: 4px; }
main { padding: 8px 24px 40px; max-width: 1600px; }
h2 { font-size: 17px; margin: 28px 0 8px; border-bottom: 1px solid var(--line); padding-bottom: 4px; }
code, .mono { font-family: "DejaVu Sans Mono", Menlo, Consolas, monospace; font-size: 12.5px; }
.kind { display: inline-block; font: 600 12px/1 "DejaVu Sans Mono", Menlo, monospace; padding: 4px 7px; border-radius: 4px; background: #334e68; color: #fff; vertical-align: middle; }
.verdict { border: 2px solid var(--bad); background: var(--badbg); border-radius: 8px; padding: 14px 18px; margin-top: 16px; }
.verdict.calm { border-color: var(--ok); background: #edf7ee; }
.verdict .summary { font-size: 19px; font-weight: 600; margin: 6px 0; }
.verdict .kind { background: var(--bad); }
.verdict.calm .kind { background: var(--ok); }
.finding { border: 1px solid var(--line); border-radius: 6px; padding: 8px 14px; margin-top: 10px; }
.finding .summary { font-weight: 600; }
.conf { color: var(--muted); font-size: 12px; margin-left: 6px; cursor: help; text-decoration: underline dotted; }
li.more { list-style: none; margin-left: -16px; }
.culprits a, a.g { color: var(--bad); font-weight: 600; }
ul.ev, ul.adv { margin: 4px 0; padding-left: 20px; font-size: 13px; }
.cols { display: grid; grid-template-columns: repeat(auto-fit, minmax(420px, 1fr)); gap: 0 28px; }
.label { color: var(--muted); font-size: 12px; text-transform: uppercase; letter-spacing: .04em; margin-top: 6px; }
.scroll { overflow: auto; border: 1px solid var(--line); border-radius: 6px; background: var(--bg); max-height: 85vh; }
.note { color: var(--muted); }
table { border-collapse: collapse; margin-top: 6px; }
th, td { text-align: left; padding: 3px 10px; border-bottom: 1px solid #e4e7eb; vertical-align: top; }
th { color: var(--muted); font-weight: 600; font-size: 12px; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
article.group { border: 1px solid var(--line); border-radius: 6px; margin-top: 10px; padding: 6px 14px; }
article.group.culprit { border: 2px solid var(--bad); }
article.group:target { box-shadow: 0 0 0 3px #f0b429; }
article.group h3 { font-size: 15px; margin: 4px 0; }
ol.stack { margin: 4px 0; padding-left: 36px; }
ol.stack li.plumbing, ol.stack details { color: var(--muted); }
ol.stack .loc { color: var(--muted); }
details > summary { cursor: pointer; color: #486581; }
.errors li { font-family: "DejaVu Sans Mono", Menlo, monospace; font-size: 12.5px; }
svg.tree { display: block; }
svg.tree text { font-family: "DejaVu Sans Mono", Menlo, Consolas, monospace; font-size: 12px; fill: #102a43; }
svg.tree .fn { font-weight: 600; }
svg.tree .loc { fill: #627d98; font-weight: 400; }
svg.tree .plumb { fill: #829ab1; }
svg.tree .fold { fill: #486581; font-style: italic; text-decoration: underline dotted; cursor: pointer; }
svg.tree .box rect.frame { fill: #fff; stroke: #9fb3c8; stroke-width: 1.2; }
svg.tree .box.culprit rect.frame { fill: #fdecea; stroke: #c62828; stroke-width: 2.2; }
svg.tree .box.hl rect.frame { stroke: #f0b429; stroke-width: 3; }
svg.tree .box.root rect.frame { fill: #334e68; stroke: #334e68; }
svg.tree .box.root text { fill: #fff; font-family: system-ui, "DejaVu Sans", sans-serif; font-weight: 600; }
svg.tree path.edge { fill: none; stroke: #9fb3c8; }
svg.tree path.edge.culprit { stroke: #c62828; }
svg.tree text.el { font-family: system-ui, "DejaVu Sans", sans-serif; font-size: 11.5px; fill: #334e68; }
svg.tree text.el.culprit { fill: #b71c1c; font-weight: 700; }
svg.tree .badge rect { fill: #486581; }
svg.tree .badge.culprit rect { fill: #c62828; }
svg.tree .badge text { fill: #fff; font-family: system-ui, "DejaVu Sans", sans-serif; font-size: 11.5px; font-weight: 600; }
svg.tree .pop { display: none; }
svg.tree .pop.open { display: inline; }
svg.tree .pop rect { fill: #fffbea; stroke: #f0b429; }
svg.tree .pop text { font-size: 11.5px; }
.legend span { margin-right: 18px; }
.sw { display: inline-block; width: 12px; height: 12px; border-radius: 2px; vertical-align: -1px; margin-right: 4px; border: 1px solid #9fb3c8; }
footer { color: var(--muted); font-size: 12px; padding: 10px 24px 30px; }
"""


def render(report: Report, options) -> str:
    """The whole page as a string; write it with ``hangdoc.atomic.write_atomic``."""
    from hangdoc.renderers import RenderOptions

    options = options or RenderOptions()
    view = treeview.build_view(report, options.max_groups, options.show_plumbing)
    page = _Page(report, view, verbose=getattr(options, "verbose", False))
    return page.render()


def _sha256(text: str) -> str:
    return base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode("ascii")


class _Page:
    def __init__(self, report: Report, view: View, verbose: bool = False):
        self.report = report
        self.view = view
        self.verbose = verbose
        self.groups = report.groups
        self.total = sum(g.count for g in self.groups)
        self._culprit_index: Optional[Dict[Tuple, int]] = None

    # -- pieces -----------------------------------------------------------------------------

    def glink(self, i: int, text: Optional[str] = None) -> str:
        return f'<a class="g" href="#group-{i + 1}">{esc(text or f"G{i + 1}")}</a>'

    def group_of(self, c: Culprit) -> Optional[int]:
        """The group holding a culprit: by rank, else by host and pid (one pass, however many culprits)."""
        if self._culprit_index is None:
            index: Dict[Tuple, int] = {}
            for i, g in enumerate(self.groups):
                for p in g.members:
                    index.setdefault(("rank", p.rank) if p.rank is not None else ("pid", p.host, p.pid), i)
                    index.setdefault(("pid", p.host, p.pid), i)
            self._culprit_index = index
        key = ("rank", c.rank) if c.rank is not None else ("pid", c.host, c.pid)
        return self._culprit_index.get(key)

    def culprit_html(self, c: Culprit) -> str:
        who = Process(host=c.host, pid=c.pid, rank=c.rank).describe()
        i = self.group_of(c)
        if i is None:
            return f"<span>{esc(who)}</span>"
        return f'<a href="#group-{i + 1}">{esc(who)}</a> <span class="note">→ stack G{i + 1}</span>'

    def finding_html(self, f: Finding, headline: bool) -> str:
        verbose = self.verbose
        out: List[str] = []
        calm = f.kind == "no-hang"
        cls = ("verdict calm" if calm else "verdict") if headline else "finding"
        out.append(f'<div class="{cls}">')
        word, tip = confidence_note(f)
        out.append(f'<span class="kind">{esc(f.kind)}</span>'
                   f'<span class="conf" title="{esc(tip)}">confidence {f.confidence:.2f}: {word}</span>')
        out.append(f'<div class="summary">{inline(f.summary)}</div>')
        if f.culprits:
            ranks = [c.rank for c in f.culprits if c.rank is not None]
            shown = f.culprits[:MAX_CULPRITS]
            out.append('<div class="label">culprits</div><div class="culprits">')
            out.append(", ".join(self.culprit_html(c) for c in shown))
            if len(f.culprits) > len(shown):
                rest = f" (all ranks: {esc(clip(compress_ranks(ranks), MAX_TEXT))})" if ranks else ""
                out.append(f' <span class="note">and {_num(len(f.culprits) - len(shown))} more{rest}</span>')
            out.append("</div>")
        if f.candidates:
            out.append(f'<div class="label">{candidates_label(f.candidates)}</div><div>')
            out.append(", ".join(self.culprit_html(c) for c in f.candidates[:MAX_CULPRITS]))
            out.append("</div>")
        if not (f.evidence or f.advice or f.detail):
            out.append("</div>")
            return "\n".join(out)
        # Only the headline shows its reasons open; the others keep the tree near the top. The
        # headline shows the lines that prove it; the rest (-v in text) are one click away.
        out.append('<div class="cols">' if headline else '<details><summary>evidence and what to do</summary><div class="cols">')
        shown = evidence_shown(f, False)[0] if headline else list(f.evidence)
        rest = list(f.evidence[len(shown):]) + list(f.detail)  # shown is a prefix of the evidence
        for title, items, cls2 in (("evidence", shown, "ev"), ("what to do", f.advice, "adv")):
            if items or (cls2 == "ev" and rest):
                out.append(f'<div><div class="label">{title}</div><ul class="{cls2}">')
                out.extend(f"<li>{inline(clip(x, 2000))}</li>" for x in items[:50])
                if len(items) > 50:
                    out.append(f'<li class="note">… {_num(len(items) - 50)} more</li>')
                if cls2 == "ev" and rest:
                    out.append(f'<li class="more"><details{" open" if verbose else ""}><summary>{_plural(len(rest), "more line")} '
                               'of evidence</summary><ul class="ev">')
                    out.extend(f"<li>{inline(clip(x, 2000))}</li>" for x in rest[:50])
                    if len(rest) > 50:
                        out.append(f'<li class="note">… {_num(len(rest) - 50)} more (see <code>--format json</code>)</li>')
                    out.append("</ul></details></li>")
                out.append("</ul></div>")
        out.append("</div></div>" if headline else "</div></details></div>")
        return "\n".join(out)

    def header(self) -> str:
        r = self.report
        procs = r.job.processes if r.job is not None else []
        n_proc = len(procs) or self.total
        ranks = {p.rank for p in procs if p.rank is not None}
        hosts = {p.host for p in procs if p.host}
        sources = r.job.sources if r.job is not None else []
        n_err = sum(len(s.errors) for s in sources)
        bits = [_plural(n_proc, "process"), _plural(len(ranks), "rank") if ranks else "no ranks in the dumps",
                _plural(len(hosts), "host"), _plural(len(self.groups), "group")]
        if r.job is not None and r.job.world_size:
            bits.append(f"world size {_num(r.job.world_size)}")
        bits.append(_plural(len(sources), "source"))
        if n_err:
            bits.append(f'<a href="#sources" style="color:#ffb3b3">{_plural(n_err, "parse error")}</a>')
        return (
            '<header><h1>hangdoc report</h1>'
            f'<div class="stats">{" · ".join(bits)}</div></header>'
        )

    def verdict(self) -> str:
        out = ['<section id="verdict">']
        findings = self.report.findings
        if not findings:
            out.append('<div class="verdict calm"><div class="summary">No findings: the report was not diagnosed.</div></div>')
        else:
            out.append(self.finding_html(findings[0], headline=True))
        if self.report.missing_ranks:
            m = self.report.missing_ranks
            out.append(f'<p><b>Missing ranks</b> ({_num(len(m))}): <span class="mono">{esc(clip(compress_ranks(m), MAX_TEXT))}</span> '
                       '<span class="note">— the world size implies them but no source mentions them.</span></p>')
        if len(findings) > 1:
            out.append(f"<h2>Other findings ({len(findings) - 1})</h2>")
            out.extend(self.finding_html(f, headline=False) for f in findings[1:])
        out.append("</section>")
        return "\n".join(out)

    def tree(self) -> str:
        v = self.view
        out = ['<section id="tree"><h2>Merged call tree</h2>']
        out.append(
            '<p class="legend note"><span>Boxes: frames, outermost on the left; edges: the ranks that took that branch.</span>'
            '<span><i class="sw" style="background:#fdecea;border-color:#c62828"></i>culprit path</span>'
            '<span><i class="sw" style="background:#486581"></i>group end: click to see its stack</span>'
            '<span><u>… N frames</u>: folded library frames, click to unfold</span></p>'
        )
        out.append('<div class="scroll">')
        out.append(TreePicture(self.report, v).svg())
        out.append("</div>")
        if v.hidden_groups:
            out.append(
                f'<p class="note">{_plural(v.hidden_groups, "smaller group")} ({_plural(v.hidden_processes, "process")}) '
                f'not drawn; they are listed under <a href="#other-groups">other groups</a>.</p>'
            )
        out.append("</section>")
        return "\n".join(out)

    def stack_html(self, stack: Sequence[Frame]) -> str:
        is_plumbing = treeview.plumbing_test()
        out = ['<ol class="stack" reversed>']
        run: List[Frame] = []

        def li(f: Frame, cls: str = "") -> str:
            loc = f.file + (f":{f.line}" if f.line is not None else "")
            attr = f' class="{cls}"' if cls else ""
            return f'<li{attr}><code>{esc(f.function)}</code> <span class="loc mono">{esc(loc)}</span></li>'

        def flush() -> None:
            if len(run) >= 2:
                out.append(f"<li class=\"plumbing\"><details><summary>… {len(run)} library frames</summary><ol class=\"stack\">")
                out.extend(li(f, "plumbing") for f in run)
                out.append("</ol></details></li>")
            else:
                out.extend(li(f, "plumbing") for f in run)
            run.clear()

        # Innermost first, like py-spy: where the process is stuck reads first.
        for f in reversed(stack):
            if is_plumbing(f):
                run.append(f)
                continue
            flush()
            out.append(li(f))
        flush()
        out.append("</ol>")
        return "\n".join(out)

    def group_section(self) -> str:
        v = self.view
        out = [f'<section id="groups"><h2>Groups ({_num(len(self.groups))})</h2>',
               '<p class="note">A group is the processes whose main thread has the same stack; stacks innermost first.</p>']
        for i in v.drawn:
            g = self.groups[i]
            culprit = i in v.culprit_groups
            hosts = compress_hosts(p.host for p in g.members if p.host)
            head = [f"G{i + 1}", _plural(g.count, "process")] + ([g.status] if g.status != STATUS_OK else [])
            if g.ranks:
                head.append(clip(describe_ranks(g.ranks), MAX_TEXT))
            out.append(f'<article class="group{" culprit" if culprit else ""}" id="group-{i + 1}" data-group="{i}">')
            out.append(f"<h3>{esc(' · '.join(head))}{' <span class=kind style=background:#c62828>culprit</span>' if culprit else ''}</h3>")
            if hosts:
                out.append(f'<div class="note">hosts <span class="mono">{esc(clip(hosts, MAX_TEXT))}</span></div>')
            unranked = [p for p in g.members if p.rank is None]
            if unranked:
                out.append(f'<div class="note">{esc(pids_by_host(unranked))}</div>')
            if g.summary:
                out.append(f"<div><b>{esc(g.summary)}</b></div>")
            out.append(self.stack_html(g.stack) if g.stack else '<p class="note">no stack (the process could not be dumped)</p>')
            out.append("</article>")
        drawn = set(v.drawn)
        rest = sorted((i for i in range(len(self.groups)) if i not in drawn), key=lambda i: -self.groups[i].count)
        if rest:
            rows = []
            for i in rest[:MAX_ROWS]:
                g = self.groups[i]
                summary = g.summary or (g.stack[-1].label() if g.stack else "")
                rows.append(
                    f'<tr id="group-{i + 1}" data-group="{i}"><td>G{i + 1}</td><td class="n">{_num(g.count)}</td>'
                    f'<td class="mono">{esc(clip(compress_ranks(g.ranks), 200))}</td><td>{esc(clip(summary, 300))}</td></tr>'
                )
            out.append(f'<h3 id="other-groups">Other groups ({_num(len(rest))})</h3>')
            out.extend(table(("group", "processes", "ranks", "summary"), rows, len(rest), "more group"))
        out.append("</section>")
        return "\n".join(out)

    def thread_section(self) -> str:
        tgs = self.report.thread_groups
        if not tgs:
            return ""
        rows = []
        for g in tgs[:MAX_THREAD_ROWS]:
            names = ", ".join(g.thread_names[:5]) + (f" +{len(g.thread_names) - 5}" if len(g.thread_names) > 5 else "")
            where = g.summary or (g.stack[-1].label() if g.stack else "")
            rows.append(
                f'<tr><td class="n">{_num(g.threads or g.count)}</td><td class="n">{_num(g.count)}</td>'
                f'<td class="mono">{esc(clip(names, 200))}</td><td>{esc(clip(where, 300))}</td></tr>'
            )
        return "\n".join(
            [f'<section id="threads"><h2>Other threads ({_plural(len(tgs), "group")})</h2>',
             '<p class="note">Threads other than the main thread, grouped by stack like the processes.</p>']
            + table(("threads", "processes", "names", "where"), rows, len(tgs), "more group")
            + ["</section>"]
        )

    def host_section(self) -> str:
        # Hosts with the same processes-per-host and the same groups fold into one row, so 16,384
        # identical nodes are one line and the odd host stands out. One pass over the groups'
        # members: every process is in exactly one group.
        count: Dict[str, int] = defaultdict(int)
        host_groups: Dict[str, Set[int]] = defaultdict(set)
        host_ranks: Dict[str, List[int]] = defaultdict(list)
        for i, g in enumerate(self.groups):
            for p in g.members:
                h = p.host or ""
                count[h] += 1
                host_groups[h].add(i)
                if p.rank is not None:
                    host_ranks[h].append(p.rank)
        rows: Dict[Tuple[int, Tuple[int, ...]], List[str]] = defaultdict(list)
        for host, n in count.items():
            gs = host_groups[host]
            rows[(n, tuple(gs) if len(gs) == 1 else tuple(sorted(gs)))].append(host)
        ordered = sorted(rows.items(), key=lambda kv: (not any(g in self.view.culprit_groups for g in kv[0][1]), min(kv[1])))
        trs = []
        for (n, gs), hosts in ordered[:MAX_ROWS]:
            named = [h for h in hosts if h]
            label = compress_hosts(named) if named else ""
            if len(named) < len(hosts):
                label = (label + ", " if label else "") + "(unknown host)"
            ranks = [r for h in hosts for r in host_ranks[h]]
            glinks = " ".join(self.glink(g) for g in gs[:30]) + (f" +{len(gs) - 30}" if len(gs) > 30 else "")
            cls = ' style="background:#fdecea"' if any(g in self.view.culprit_groups for g in gs) else ""
            trs.append(
                f'<tr{cls}><td class="mono">{esc(clip(label, 300))}</td><td class="n">{_num(len(hosts))}</td><td class="n">{_num(n)}</td>'
                f'<td class="mono">{esc(clip(compress_ranks(ranks), 300))}</td><td>{glinks}</td></tr>'
            )
        return "\n".join(
            [f'<section id="hosts"><h2>Hosts ({_num(len(count))})</h2>']
            + table(("hosts", "count", "processes each", "ranks", "groups"), trs, len(ordered), "more row")
            + ["</section>"]
        )

    def source_section(self) -> str:
        sources = self.report.job.sources if self.report.job is not None else []
        out = [f'<section id="sources"><h2>Sources ({_num(len(sources))})</h2>']
        ordered = sorted(sources, key=lambda s: (not s.errors, s.path))
        trs = [
            f'<tr><td class="mono">{esc(clip(s.path, 300))}</td><td>{esc(", ".join(s.formats))}</td>'
            f'<td class="n">{_num(s.processes)}</td><td class="n">{_num(s.records)}</td><td class="n">{_num(len(s.errors))}</td></tr>'
            for s in ordered[:MAX_ROWS]
        ]
        out.extend(table(("file", "formats", "processes", "records", "parse errors"), trs, len(ordered), "more source"))
        errors = [e for s in ordered for e in s.errors]
        if errors:
            out.append(f"<h3>Parse errors ({_num(len(errors))})</h3><ul class=\"errors\">")
            out.extend(f"<li>{esc(clip(str(e), 1000))}</li>" for e in errors[:MAX_ERRORS])
            out.append("</ul>")
            if len(errors) > MAX_ERRORS:
                out.append(f'<p class="note">… {_num(len(errors) - MAX_ERRORS)} more.</p>')
        out.append("</section>")
        return "\n".join(out)

    def render(self) -> str:
        from hangdoc import __version__

        script = _SCRIPT
        csp = f"default-src 'none'; style-src 'unsafe-inline'; img-src data:; script-src 'sha256-{_sha256(script)}'"
        title = "hangdoc report"
        if self.report.findings:
            title += ": " + clip(self.report.findings[0].summary, 120)
        body = [
            "<!DOCTYPE html>",
            '<html lang="en"><head><meta charset="utf-8">',
            f'<meta http-equiv="Content-Security-Policy" content="{esc(csp)}">',
            '<meta name="viewport" content="width=device-width, initial-scale=1">',
            f"<title>{esc(title)}</title>",
            f"<style>{_CSS}</style></head><body>",
            self.header(),
            "<main>",
            self.verdict(),
            self.tree(),
            self.group_section(),
            self.thread_section(),
            self.host_section(),
            self.source_section(),
            "</main>",
            f'<footer>hangdoc {esc(__version__)} · frames compared by {esc(self.report.granularity)}</footer>',
            f"<script>{script}</script>",
            "</body></html>",
        ]
        return "\n".join(body) + "\n"
