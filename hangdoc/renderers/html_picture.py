"""The merged tree of the HTML report drawn as SVG: one column per box depth, left to right.

Laid out from a :class:`~hangdoc.renderers.treeview.View` (groups, never processes), so the
picture's size does not grow with the number of processes.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from hangdoc.model import Report
from hangdoc.renderers import treeview
from hangdoc.renderers.html_text import clip, esc, plural as _plural, wrap
from hangdoc.renderers.treeview import Line, View, ViewNode

# Sizes of the drawn tree, in px. Frames are in a monospace font so that widths can be computed
# here: DejaVu Sans Mono / Menlo / Consolas all advance 0.6 em.
FONT = 12
CHAR_W = FONT * 0.61
BOX_W = 280
ROOT_W = 150
BOX_CHARS = int((BOX_W - 16) / CHAR_W)
LINE_H = 16
PAD = 7
BADGE_H = 20
GAP = 200  # between columns: room for the edge labels
EDGE_CHARS = 22
VGAP = 16
MARGIN = 12
POP_MAX_LINES = 60
POP_CHARS = 90

class TreePicture:
    """Lays out a :class:`View` left to right (one column per box depth) and writes it as SVG."""

    def __init__(self, report: Report, view: View):
        self.report = report
        self.view = view
        self.pos: Dict[int, Tuple[float, float, float]] = {}  # ident -> x, y, height
        self.band: Dict[int, Tuple[float, float]] = {}  # ident -> top, height of its subtree's band
        self.pops: List[str] = []
        self.max_bottom = 0.0
        self.max_right = 0.0
        self.content_bottom = 0.0
        # A root with one child says only what the header says: start the picture at the trunk.
        root = view.root
        self.top = root.children[0] if len(root.children) == 1 and not root.ends else root

    def width(self, v: ViewNode) -> float:
        return ROOT_W if v is self.view.root else BOX_W

    def height(self, v: ViewNode) -> float:
        lines = len(self.lines_of(v))
        return 2 * PAD + LINE_H * lines + BADGE_H * min(len(v.ends), 8) + (4 if v.ends else 0)

    def lines_of(self, v: ViewNode) -> List[Line]:
        if v is self.view.root:
            n = len(self.view.drawn) + self.view.hidden_groups
            return [Line(f"{_plural(self.view.total_processes, 'process')}", ()), Line(_plural(n, "group"), ())]
        return v.lines

    def layout(self) -> None:
        root = self.top
        band: Dict[int, float] = {}
        order = list(treeview.walk(root))
        for v in reversed(order):  # children before parents
            kids = sum(band[c.ident] for c in v.children) + VGAP * max(0, len(v.children) - 1)
            band[v.ident] = max(self.height(v), kids)
        # place top-down
        todo: List[Tuple[ViewNode, float, int]] = [(root, MARGIN, 0)]
        while todo:
            v, top, depth = todo.pop()
            h = self.height(v)
            kids = sum(band[c.ident] for c in v.children) + VGAP * max(0, len(v.children) - 1)
            y = top + (band[v.ident] - kids) / 2
            centers = []
            for c in v.children:
                todo.append((c, y, depth + 1))
                centers.append(y + band[c.ident] / 2)
                y += band[c.ident] + VGAP
            cy = (centers[0] + centers[-1]) / 2 if centers else top + band[v.ident] / 2
            ytop = max(top, min(cy - h / 2, top + band[v.ident] - h))
            x = MARGIN if depth == 0 else MARGIN + self.width(root) + GAP + (depth - 1) * (BOX_W + GAP)
            self.pos[v.ident] = (x, ytop, h)
            self.band[v.ident] = (top, band[v.ident])
            self.max_bottom = max(self.max_bottom, ytop + h)
            self.max_right = max(self.max_right, x + self.width(v))
        # children were placed at their band centre only approximately; re-centre parents on the
        # children's actual boxes so that edges leave and arrive mid-box.
        for v in reversed(order):
            if v.children:
                x, y, h = self.pos[v.ident]
                first, last = self.pos[v.children[0].ident], self.pos[v.children[-1].ident]
                cy = (first[1] + first[2] / 2 + last[1] + last[2] / 2) / 2
                top, size = self.band[v.ident]
                self.pos[v.ident] = (x, max(top, min(cy - h / 2, top + size - h)), h)

    def frame_line(self, line: Line, x: float, y: float, pop_id: Optional[str]) -> str:
        if line.folded:
            names = "\n".join(f.label() for f in line.frames[:POP_MAX_LINES])
            return (
                f'<g class="foldline" data-pop="{pop_id}" tabindex="0" role="button" aria-expanded="false">'
                f"<title>{esc(names)}</title>"
                f'<text x="{x:.0f}" y="{y:.0f}" class="fold">{esc(clip(line.text, BOX_CHARS))}</text></g>'
            )
        if not line.frames:
            return f'<text x="{x:.0f}" y="{y:.0f}">{esc(clip(line.text, BOX_CHARS))}</text>'
        f = line.frames[0]
        loc = treeview.short_location(f)
        loc = loc if len(loc) <= 24 else "…" + loc[-23:]
        room = BOX_CHARS - (len(loc) + 2 if loc else 0)
        fn = clip(f.function, max(8, room))
        cls = "fn plumb" if line.plumbing else "fn"
        loc_part = f'<tspan class="loc">  {esc(loc)}</tspan>' if loc else ""
        return (
            f'<text x="{x:.0f}" y="{y:.0f}"><title>{esc(f.label())}</title>'
            f'<tspan class="{cls}">{esc(fn)}</tspan>{loc_part}</text>'
        )

    def popup(self, pop_id: str, line: Line, x: float, y: float) -> str:
        frames = line.frames[:POP_MAX_LINES]
        rows = [clip(f.label(), POP_CHARS) for f in frames]
        if len(line.frames) > POP_MAX_LINES:
            rows.append(f"… {len(line.frames) - POP_MAX_LINES} more")
        width = min(POP_CHARS, max((len(r) for r in rows), default=10)) * CHAR_W * 0.96 + 20
        height = len(rows) * 15 + 14
        # Open upwards near the bottom, so the picture does not grow for a popup.
        y = max(MARGIN, min(y, self.content_bottom - height))
        self.max_bottom = max(self.max_bottom, y + height)
        self.max_right = max(self.max_right, x + width)
        full = [f.label() for f in frames] + [""]
        text = "".join(f'<text x="{x + 10:.0f}" y="{y + 19 + 15 * k:.0f}">'
                       + (f"<title>{esc(full[k])}</title>" if r != full[k] and full[k] else "") + f"{esc(r)}</text>"
                       for k, r in enumerate(rows))
        return (
            f'<g class="pop" id="{pop_id}" data-pop="{pop_id}">'
            f'<rect x="{x:.0f}" y="{y:.0f}" width="{width:.0f}" height="{height:.0f}" rx="4"/>{text}</g>'
        )

    def box(self, v: ViewNode) -> str:
        x, y, h = self.pos[v.ident]
        cls = "box"
        if v is self.view.root:
            cls += " root"
        if v.culprit:
            cls += " culprit"
        groups = " ".join(str(i) for i in v.groups[:200])
        out = [f'<g class="{cls}" id="node-{v.ident}" data-groups="{groups}">',
               f'<rect class="frame" x="{x:.0f}" y="{y:.0f}" width="{self.width(v):.0f}" height="{h:.0f}" rx="5"/>']
        ty = y + PAD + 12
        for k, line in enumerate(self.lines_of(v)):
            pop_id = None
            if line.folded:
                pop_id = f"pop-{v.ident}-{k}"
                self.pops.append(self.popup(pop_id, line, x + 30, ty + 4))
            out.append(self.frame_line(line, x + 8, ty, pop_id))
            ty += LINE_H
        if v.ends:
            ty += 2
            for i in v.ends[:8]:
                g = self.report.groups[i]
                culprit = i in self.view.culprit_groups
                label = f"G{i + 1} · {_plural(g.count, 'process')}" + (" · culprit" if culprit else "") + "  ▸ stack"
                out.append(
                    f'<a href="#group-{i + 1}" class="badge{" culprit" if culprit else ""}">'
                    f'<rect x="{x + 6:.0f}" y="{ty - 2:.0f}" width="{BOX_W - 12}" height="{BADGE_H - 3}" rx="3"/>'
                    f'<text x="{x + 12:.0f}" y="{ty + 11:.0f}">{esc(label)}</text></a>'
                )
                ty += BADGE_H
            if len(v.ends) > 8:
                out.append(f'<text x="{x + 12:.0f}" y="{ty + 11:.0f}">+{len(v.ends) - 8} more groups</text>')
        out.append("</g>")
        return "".join(out)

    def edge(self, parent: ViewNode, child: ViewNode) -> str:
        px, py, ph = self.pos[parent.ident]
        cx, cy_top, ch = self.pos[child.ident]
        x0, y0 = px + self.width(parent), py + ph / 2
        y1 = cy_top + ch / 2
        bend = x0 + 40
        total = max(1, self.view.total_processes)
        width = 1.3 + 5.0 * (child.count / total)
        cls = "edge culprit" if child.culprit else "edge"
        path = (
            f'<path class="{cls}" style="stroke-width:{width:.1f}" '
            f'd="M{x0:.0f},{y0:.1f} C{x0 + 30:.0f},{y0:.1f} {bend - 16:.0f},{y1:.1f} {bend:.0f},{y1:.1f} L{cx:.0f},{y1:.1f}"/>'
        )
        top = child.who
        full = f"{top} ({_plural(child.count, 'process')})" if top else _plural(child.count, "process")
        lcls = "el culprit" if child.culprit else "el"
        lx = bend + 6
        label = [f'<g><title>{esc(full)}</title>']
        # a host list reads as one without saying so; the space goes to the list itself
        short = top.split(" ", 1)[1] if top.startswith(("hosts ", "host ")) else top
        if len(short) > EDGE_CHARS and " pid " in short:  # "host pid N": the host on one line, the pid below
            host, pid = short.rsplit(" pid ", 1)
            rows = [clip(host, EDGE_CHARS), clip("pid " + pid, EDGE_CHARS)]
        else:
            rows = wrap(short, EDGE_CHARS, 2) if short else []
        for k, row in enumerate(rows):
            y = y1 - 6 - 14 * (len(rows) - 1 - k)
            label.append(f'<text class="{lcls}" x="{lx:.0f}" y="{y:.1f}">{esc(row)}</text>')
        label.append(f'<text class="{lcls}" x="{lx:.0f}" y="{y1 + 15:.1f}">{esc(_plural(child.count, "process"))}</text></g>')
        return path + "".join(label)

    def svg(self) -> str:
        self.layout()
        self.content_bottom = self.max_bottom
        parts: List[str] = []
        for v in treeview.walk(self.top):
            for c in v.children:
                parts.append(self.edge(v, c))
        for v in treeview.walk(self.top):
            parts.append(self.box(v))
        width = self.max_right + MARGIN
        height = self.max_bottom + MARGIN
        return (
            # Shrinks to fit the page down to 70 % (still legible), then scrolls.
            f'<svg class="tree" xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
            f'style="max-width:100%;min-width:{0.7 * width:.0f}px;height:auto" '
            f'viewBox="0 0 {width:.0f} {height:.0f}" role="img" aria-label="merged call tree">'
            + "".join(parts)
            + "".join(self.pops)
            + "</svg>"
        )
