"""The HTML report: structure, caps at scale, and escaping of everything that came from a dump.

Reports are built by the real grouping (``build_report``) from model objects; the browser checks
are in test_html_browser.py.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hangdoc.analysis.grouping import build_report
from hangdoc.model import Culprit, Finding, Frame, Job, ParseError, Process, Source, Thread
from hangdoc.renderers import RenderOptions, render, treeview
from hangdoc.renderers import html as html_renderer, html_text

C10D = "torch/distributed/distributed_c10d.py"
ENGINE = "deepspeed/runtime/pipe/engine.py"
TRUNK = (
    Frame("<module>", "pretrain_gpt.py", 322),
    Frame("main", "pretrain_gpt.py", 318),
    Frame("pretrain", "megatron/training.py", 190),
    Frame("train", "megatron/training.py", 980),
    Frame("train_step", "megatron/training.py", 543),
    Frame("train_batch", ENGINE, 346),
    Frame("_exec_schedule", ENGINE, 1374),
)
ALL_REDUCE = TRUNK + (
    Frame("_exec_reduce_tied_grads", ENGINE, 283),
    Frame("allreduce_tied_weight_gradients", "deepspeed/runtime/pipe/module.py", 424),
    Frame("wrapper", "torch/distributed/c10d_logger.py", 79),
    Frame("all_reduce", C10D, 2501),
)
BROADCAST = TRUNK + (
    Frame("_exec_optimizer_step", ENGINE, 1180),
    Frame("_bcast_pipe_scalar", ENGINE, 563),
    Frame("wrapper", "torch/distributed/c10d_logger.py", 79),
    Frame("broadcast", C10D, 2201),
)
DATALOADER = TRUNK + (
    Frame("_exec_load_micro_batch", ENGINE, 780),
    Frame("_next_batch", ENGINE, 650),
    Frame("__next__", "torch/utils/data/dataloader.py", 631),
    Frame("_next_data", "torch/utils/data/dataloader.py", 1329),
    Frame("_get_data", "torch/utils/data/dataloader.py", 1295),
    Frame("get", "multiprocessing/queues.py", 113),
    Frame("wait", "multiprocessing/connection.py", 931),
)

PAYLOADS = (
    "<script>document.title='PWNED'</script>",
    '<img src=x onerror="document.title=\'PWNED\'">',
    "\"'><svg onload=alert(1)>",
)


def host_of(rank: int, per_host: int = 8) -> str:
    return f"iam{rank // per_host + 1:02d}"


def bloom_report(n: int = 384, culprit: int = 243, payload: bool = False):
    """BLOOM-style: n ranks, 8 per host; one rank in its DataLoader, a few in broadcast, the rest in all_reduce."""
    procs = []
    for r in range(n):
        stack = DATALOADER if r == culprit else BROADCAST if r % 128 == 0 else ALL_REDUCE
        if payload and r == 5:
            stack = TRUNK + tuple(Frame(p, p, 1) for p in PAYLOADS)
        host = PAYLOADS[1] if payload and r == 6 else host_of(r)
        procs.append(
            Process(host=host, pid=10000 + r, rank=r, role="rank", source=f"dumps/{host_of(r)}-{r}.txt", source_line=1,
                    threads=[Thread("1", "MainThread", stack, is_main=True)])
        )
    sources = [Source(path=p.source, processes=1, formats=["py-spy"]) for p in procs]
    sources[7].errors.append(ParseError(sources[7].path, 14, PAYLOADS[0] if payload else "unrecognised line"))
    report = build_report(Job(processes=procs, sources=sources, world_size=n))
    report.findings = [
        Finding(
            "dataloader-stall",
            f"rank {culprit} waits for its DataLoader; the other {n - 1} ranks wait for it in collectives"
            + (PAYLOADS[0] if payload else ""),
            culprits=[Culprit(host_of(culprit), 10000 + culprit, culprit)],
            evidence=[f"rank {culprit}: wait ← _next_batch (engine.py:650)"] + (list(PAYLOADS) if payload else []),
            advice=["Dump the DataLoader workers of that rank: hangdoc dump --pid PID"],
            confidence=0.9,
        ),
        Finding("collective-wait", f"{n - 1} ranks wait in collectives", confidence=0.4),
    ]
    return report


class Tags(HTMLParser):
    """Every start tag with its attributes, and every text chunk, as a browser's tokenizer sees them."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tags = []
        self.text = []
        self.script = []
        self._in_script = False

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        self._in_script = tag == "script"

    def handle_startendtag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_endtag(self, tag):
        self._in_script = False

    def handle_data(self, data):
        (self.script if self._in_script else self.text).append(data)


def parse(page: str) -> Tags:
    t = Tags()
    t.feed(page)
    t.close()
    return t


# Every element the renderer writes; anything else would have come from a dump.
OUR_TAGS = {
    "html", "head", "meta", "title", "style", "body", "header", "h1", "h2", "h3", "div", "span", "a", "main",
    "section", "p", "ul", "ol", "li", "b", "i", "u", "code", "details", "summary", "table", "tr", "th", "td",
    "article", "footer", "script", "svg", "g", "rect", "text", "tspan", "path",
}


def assert_only_our_markup(page: str) -> Tags:
    t = parse(page)
    names = {tag for tag, _ in t.tags}
    assert names <= OUR_TAGS, names - OUR_TAGS
    assert [tag for tag, _ in t.tags].count("script") == 1
    assert "".join(t.script) == html_renderer._SCRIPT
    for tag, attrs in t.tags:
        assert not [a for a in attrs if a.startswith("on")], (tag, attrs)
        for a in ("href", "src", "xlink:href"):
            value = attrs.get(a)
            assert value is None or value.startswith("#"), (tag, a, value)
    return t


def test_verdict_first_culprit_linked_to_its_stack():
    report = bloom_report()
    page = render(report, "html", RenderOptions())
    assert page.index('id="verdict"') < page.index('id="tree"') < page.index('id="groups"') < page.index('id="hosts"') < page.index('id="sources"')
    verdict = page[page.index('id="verdict"'):page.index('id="tree"')]
    assert "rank 243 waits for its DataLoader" in verdict
    m = re.search(r'<a href="#group-(\d+)">rank 243 \(iam31 pid 10243\)</a>', verdict)
    assert m, verdict
    gi = int(m.group(1)) - 1
    assert report.groups[gi].ranks == [243]
    article = re.search(rf'<article class="group culprit" id="group-{gi + 1}".*?</article>', page, re.S).group(0)
    assert "_next_batch" in article and "culprit" in article


def test_tree_is_drawn_with_rank_ranges_and_the_culprit_path():
    page = render(bloom_report(), "html", RenderOptions())
    svg = page[page.index("<svg"):page.index("</svg>") + 6]
    root = ET.fromstring(svg)  # well-formed XML, not just tag soup
    ns = "{http://www.w3.org/2000/svg}"
    texts = ["".join(t.itertext()) for t in root.iter(ns + "text")]
    # the root has one child, so the picture starts at the trunk that every rank took
    assert "ranks 0-383" not in texts and "384 processes" not in texts
    assert "rank 243" in texts and "ranks 0,128,256" in texts
    assert texts[:2] == ["ranks 1-127,129-242,", "244-255,257-383"]  # wrapped at commas; whole in the tooltip
    assert "ranks 1-127,129-242,244-255,257-383 (380 processes)" in ["".join(t.itertext()) for t in root.iter(ns + "title")]
    culprit_boxes = [g for g in root.iter(ns + "g") if "culprit" in (g.get("class") or "").split() and "box" in g.get("class", "")]
    labels = [" ".join("".join(t.itertext()) for t in g.iter(ns + "text")) for g in culprit_boxes]
    assert len(culprit_boxes) == 2, labels  # the compacted trunk and the DataLoader branch
    assert any("_next_batch" in x for x in labels) and any("<module>" in x for x in labels)
    assert not any("all_reduce" in x for x in labels)
    # the trunk's seven frames, taken by every rank, are compacted into one box
    assert any("_exec_schedule" in x and "train_step" in x for x in labels)


def test_every_group_end_links_to_its_stack():
    report = bloom_report()
    page = render(report, "html", RenderOptions())
    ends = set(re.findall(r'<a href="#group-(\d+)" class="badge', page))
    assert ends == {str(i + 1) for i in range(len(report.groups))}
    for i in ends:
        assert f'id="group-{i}"' in page


def test_plumbing_folds_into_one_line_that_unfolds(monkeypatch):
    monkeypatch.setattr(treeview, "plumbing_test", lambda: (lambda f: f.file.startswith(("torch/", "multiprocessing/"))))
    page = render(bloom_report(), "html", RenderOptions())
    svg = page[page.index("<svg"):page.index("</svg>")]
    m = re.search(r'<g class="foldline" data-pop="(pop-[\d-]+)"[^>]*><title>([^<]*)</title><text[^>]*>… (\d) library frames</text>', svg)
    assert m, svg
    pop, hidden, n = m.groups()
    assert f'<g class="pop" id="{pop}"' in svg
    assert int(n) == len(hidden.splitlines()) >= 2
    # in the per-group stacks the same frames sit in a <details>
    assert "<summary>… 5 library frames</summary>" in page  # the DataLoader's torch + multiprocessing frames
    shown = render(bloom_report(), "html", RenderOptions(show_plumbing=True))
    assert "library frames</text>" not in shown[shown.index("<svg"):shown.index("</svg>")]


def test_many_groups_are_capped_and_summarised():
    procs = []
    for r in range(2000):
        frames = TRUNK + (Frame(f"step_{r % 400}", "train.py", r % 400),)
        procs.append(Process(host=host_of(r), pid=r, rank=r, threads=[Thread("1", "MainThread", frames, is_main=True)]))
    report = build_report(Job(processes=procs, world_size=2000))
    report.findings = [Finding("collective-wait", "x", culprits=[Culprit(host_of(1999), 1999, 1999)])]
    page = render(report, "html", RenderOptions(max_groups=10))
    svg = page[page.index("<svg"):page.index("</svg>")]
    badges = re.findall(r'class="badge', svg)
    culprit_group = next(i for i, g in enumerate(report.groups) if 1999 in g.ranks)
    assert len(badges) == 11  # the ten largest and the culprit's
    assert f'href="#group-{culprit_group + 1}" class="badge culprit"' in svg
    assert "389 smaller groups (1,945 processes) not drawn" in page
    assert page.count("<article") == 11
    assert re.search(r'<tr id="group-\d+" data-group="\d+"><td>G\d+</td><td class="n">5</td>', page)
    assert page.count('<tr id="group-') == 300  # the table is capped too
    assert "89 more groups" in page


def test_hosts_fold_when_alike_and_the_odd_host_stands_out():
    page = render(bloom_report(), "html", RenderOptions())
    hosts = page[page.index('id="hosts"'):page.index('id="sources"')]
    rows = re.findall(r"<tr[^>]*><td class=\"mono\">([^<]*)</td>", hosts)
    assert rows[0] == "iam31"  # the culprit's host first
    assert rows == ["iam31", "iam[01,17,33]", "iam[02-16,18-30,32,34-48]"]


def test_deep_recursion_does_not_recurse():
    deep = TRUNK + tuple(Frame("recurse", "model.py", 10) for _ in range(5000))
    procs = [Process(host="n1", pid=1, rank=0, threads=[Thread("1", "MainThread", deep, is_main=True)]),
             Process(host="n1", pid=2, rank=1, threads=[Thread("1", "MainThread", TRUNK, is_main=True)])]
    page = render(build_report(Job(processes=procs)), "html", RenderOptions())
    assert "… 4989 frames" in page  # 5000 recursive frames: 4 shown, 4989 folded, 7 shown
    assert len(page) < 2_000_000


def test_no_network_and_a_strict_csp():
    page = render(bloom_report(), "html", RenderOptions())
    assert re.findall(r"https?://[^\"' ]+", page) == ["http://www.w3.org/2000/svg"]
    t = assert_only_our_markup(page)
    csp = next(a["content"] for tag, a in t.tags if tag == "meta" and a.get("http-equiv") == "Content-Security-Policy")
    assert "default-src 'none'" in csp and "script-src 'sha256-" in csp


def test_payloads_render_as_text():
    page = render(bloom_report(payload=True), "html", RenderOptions())
    t = assert_only_our_markup(page)
    text = "".join(t.text)
    for p in PAYLOADS:
        assert p in text  # shown, as text
    assert "<script>document.title" not in page and "<img" not in page


names = st.text(st.characters(codec="utf-8"), min_size=1, max_size=30)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(function=names, file=names, host=names, summary=names, line=st.none() | st.integers(0, 10**9))
def test_arbitrary_dump_strings_never_become_markup(function, file, host, summary, line):
    hostile = Frame(function, file, line)
    procs = [
        Process(host=host, pid=1, rank=0, threads=[Thread("1", "MainThread", TRUNK + (hostile,), is_main=True),
                                                   Thread("2", summary, (hostile,))]),
        Process(host="n2", pid=2, rank=1, threads=[Thread("1", "MainThread", ALL_REDUCE, is_main=True)]),
    ]
    report = build_report(Job(processes=procs, sources=[Source(file, 2, errors=[ParseError(file, 3, summary)])], world_size=2))
    report.findings = [Finding("collective-wait", summary, culprits=[Culprit(host, 1, 0)], evidence=[function], advice=[file])]
    page = render(report, "html", RenderOptions())
    t = assert_only_our_markup(page)
    clean = html_text._CONTROL.sub("\ufffd", function)
    assert clean in t.text  # the stack list shows the name whole, as one text node
    svg = page[page.index("<svg"):page.index("</svg>") + 6]
    ET.fromstring(svg)


def test_root_is_drawn_when_stacks_differ_from_the_first_frame():
    procs = [Process(host="n1", pid=r, rank=r, threads=[Thread("1", "MainThread", ALL_REDUCE, is_main=True)]) for r in range(3)]
    procs.append(Process(host="n2", pid=9, rank=3, status="unresponsive", status_detail="Error: Failed to get stack traces"))
    report = build_report(Job(processes=procs, world_size=4))
    page = render(report, "html", RenderOptions())
    svg = ET.fromstring(page[page.index("<svg"):page.index("</svg>") + 6])
    ns = "{http://www.w3.org/2000/svg}"
    root = next(g for g in svg.iter(ns + "g") if "root" in (g.get("class") or ""))
    texts = [t.text for t in root.iter(ns + "text")]
    assert texts[:2] == ["4 processes", "2 groups"]
    assert any("G2 · 1 process" in (t or "") for t in texts)  # the unresponsive group ends at the root
    assert "unresponsive: Error: Failed to get stack traces" in page


def test_real_dumps_other_threads_and_processes_without_rank():
    import os

    from hangdoc.analysis import analyse
    from hangdoc.readers import read_paths

    report = analyse(read_paths([os.path.join(os.path.dirname(__file__), "fixtures/bloom/2-nodes")]))
    page = render(report, "html", RenderOptions())
    t = assert_only_our_markup(page)
    threads = page[page.index('id="threads"'):page.index('id="hosts"')]
    assert '<td class="n">16</td><td class="n">16</td><td class="mono">Thread-1</td>' in threads  # the pin-memory threads
    assert "no ranks in the dumps" in page
    # processes without a rank are named by pid and host, on the edges and in the groups
    assert re.search(r'<text class="el culprit" x="\d+" y="[\d.]+">jean-zay-iam48</text><text class="el culprit" x="\d+" y="[\d.]+">pid 688514</text>', page)
    assert re.search(r"pids? [\d,-]+ on jean-zay-iam4[89]", "".join(t.text))


def test_no_hang_is_calm_and_an_empty_job_still_renders():
    from hangdoc.analysis import analyse

    page = render(analyse(Job()), "html", RenderOptions())
    assert '<div class="verdict calm">' in page and ">no-hang</span>" in page
    assert_only_our_markup(page)
    ET.fromstring(page[page.index("<svg"):page.index("</svg>") + 6])
