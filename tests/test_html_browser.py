"""The HTML report in a real browser: Debian's headless Chromium.

Checks what a person would see: the verdict, the culprit and the tree are rendered and visible, a
folded frame unfolds on click (so the page's own script runs under its CSP), and script-looking
text from a dump (frames, file names, host names, through the real readers and CLI) stays text.
Saves a screenshot of the BLOOM-style 384-process report (tests/fixtures/bloom/make_bloom.py at
TP=4 PP=12 DP=8 → ``hangdoc aggregate --format html``); set ``HANGDOC_ARTIFACTS=DIR`` to keep it.

Chromium is driven two ways: its command line (``--dump-dom``, ``--screenshot``) and, for
questions about layout and clicks, the DevTools protocol over ``--remote-debugging-pipe`` (no
network port, no third-party client).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hangdoc.atomic import write_atomic
from hangdoc.renderers import RenderOptions, render, treeview

from tests.procs import ROOT, run
from test_html_render import PAYLOADS, bloom_report

CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no Chromium on PATH (Debian: apt-get install -y chromium; .ci/run installs it when it can)"
)

FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--hide-scrollbars", "--force-device-scale-factor=1",
]
TIMEOUT = 60


def chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """Chromium's command line, in its own session, killed whatever happens."""
    done = run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", *args], timeout=TIMEOUT)
    assert not done.timed_out, "Chromium took over %d s" % TIMEOUT
    return done


def aggregate(paths, out: Path, *extra: str) -> subprocess.CompletedProcess:
    """The real CLI: readers → analysis → the html renderer."""
    done = run([sys.executable, "-m", "hangdoc", "aggregate", *map(str, paths), "-o", str(out), *extra], timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return done


def hostile_dumps(tmp_path: Path) -> Path:
    """The 2-node BLOOM dumps, one of them renamed and edited so that a frame, its file and the
    host name (taken from the file name) are markup."""
    src = Path(ROOT, "tests/fixtures/bloom/2-nodes")
    out = tmp_path / "dumps"
    out.mkdir()
    for f in sorted(src.glob("trace-*.out")):
        text = f.read_text()
        name = f.name
        if f.name.endswith("iam49.out"):
            frame = f"    {PAYLOADS[0]} ({PAYLOADS[1]}.py:7)\n"
            before = text
            text = text.replace("    all_reduce (torch/distributed/distributed_c10d.py:1316)\n", frame, 1)
            assert text != before
            name = "trace-<img src=x onerror=document.title='PWNED'>.out"
        (out / name).write_text(text)
    return out


def bloom_384(tmp_path: Path) -> Path:
    dumps = tmp_path / "bloom384"
    done = run([sys.executable, str(Path(ROOT, "tests/fixtures/bloom/make_bloom.py")), str(dumps), "--tp", "4", "--pp", "12", "--dp", "8"],
               timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    page = tmp_path / "report-bloom384.html"
    aggregate([dumps], page)
    return page


class DevTools:
    """The DevTools protocol over --remote-debugging-pipe: JSON messages ending in NUL on fds 3/4."""

    def __init__(self, tmp_path: Path, width: int = 1400, height: int = 1000):
        to_browser_r, to_browser_w = os.pipe()
        from_browser_r, from_browser_w = os.pipe()
        # Move the child's ends above 4 so that placing them on 3 and 4 cannot clobber each other.
        child_r = fcntl.fcntl(to_browser_r, fcntl.F_DUPFD, 10)
        child_w = fcntl.fcntl(from_browser_w, fcntl.F_DUPFD, 10)
        os.close(to_browser_r)
        os.close(from_browser_w)

        def on_fds_3_and_4():
            os.dup2(child_r, 3)
            os.dup2(child_w, 4)

        self.proc = subprocess.Popen(
            [CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile-cdp'}", "--remote-debugging-pipe",
             f"--window-size={width},{height}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=on_fds_3_and_4, pass_fds=(3, 4), start_new_session=True,
        )
        os.close(child_r)
        os.close(child_w)
        self.w, self.r = to_browser_w, from_browser_r
        self.buf = b""
        self.next_id = 0
        self.events: list = []
        self.session = None
        self.width, self.height = width, height

    def call(self, method: str, params: dict | None = None, session: bool = True) -> dict:
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params or {}}
        if session and self.session:
            msg["sessionId"] = self.session
        os.write(self.w, json.dumps(msg).encode() + b"\0")
        while True:
            m = self.receive()
            if m.get("id") == self.next_id:
                if "error" in m:
                    raise RuntimeError(f"{method}: {m['error']}")
                return m["result"]
            self.events.append(m)

    def receive(self) -> dict:
        deadline = time.monotonic() + TIMEOUT
        while b"\0" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.r], [], [], left)[0]:
                raise TimeoutError("Chromium did not answer within %d s" % TIMEOUT)
            chunk = os.read(self.r, 1 << 20)
            if not chunk:
                raise EOFError("Chromium closed the DevTools pipe")
            self.buf += chunk
        raw, self.buf = self.buf.split(b"\0", 1)
        return json.loads(raw)

    def open(self, url: str) -> None:
        target = self.call("Target.createTarget", {"url": "about:blank"}, session=False)["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True}, session=False)["sessionId"]
        self.call("Page.enable")
        self.call("Emulation.setDeviceMetricsOverride", {"width": self.width, "height": self.height, "deviceScaleFactor": 1, "mobile": False})
        self.call("Page.navigate", {"url": url})
        while not any(e.get("method") == "Page.loadEventFired" for e in self.events):
            self.events.append(self.receive())

    def js(self, expression: str):
        r = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in r:
            raise AssertionError(f"{expression}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def close(self) -> None:
        for fd in (self.w, self.r):
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


@pytest.fixture
def devtools(tmp_path):
    d = DevTools(tmp_path)
    try:
        yield d
    finally:
        d.close()


def fold_torch(monkeypatch):
    # Fold torch/multiprocessing frames even before the readers' normaliser says what plumbing is.
    monkeypatch.setattr(treeview, "plumbing_test", lambda: (lambda f: f.file.startswith(("torch/", "multiprocessing/"))))


def write_report(tmp_path: Path, payload: bool) -> Path:
    path = tmp_path / "report.html"
    write_atomic(str(path), render(bloom_report(payload=payload), "html", RenderOptions()))
    return path


def png_size(data: bytes):
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_dump_dom_shows_the_verdict_and_tree_and_runs_no_dump_script(tmp_path):
    page = tmp_path / "report.html"
    aggregate([hostile_dumps(tmp_path)], page)
    done = chromium(tmp_path, "--dump-dom", page.as_uri())
    dom = done.stdout
    assert "</html>" in dom, done.stderr[-2000:]
    title = re.search(r"<title>(.*?)</title>", dom, re.S).group(1)
    assert title != "PWNED" and title.startswith("hangdoc report: ")
    assert 'id="verdict"' in dom and '<svg class="tree"' in dom
    assert "dataloader-stall" in dom
    culprit = re.search(r'<div class="culprits">\s*<a href="#group-(\d+)">[^<]*pid (\d+)\)</a>', dom)
    assert culprit, dom[:3000]
    assert f'id="group-{culprit.group(1)}"' in dom
    # the payloads are in the document as text, not as elements
    assert "&lt;script&gt;document.title='PWNED'&lt;/script&gt;" in dom
    assert "&lt;img src=x onerror=" in dom
    assert "<img" not in dom
    assert dom.count("<script") == 1


def test_visible_clickable_and_safe_in_a_live_page(tmp_path, devtools, monkeypatch):
    fold_torch(monkeypatch)
    page = write_report(tmp_path, payload=True)
    devtools.open(page.as_uri())
    assert devtools.js("document.title").startswith("hangdoc report: rank 243")

    def box(selector):
        return devtools.js(
            f"(function(){{var e=document.querySelector({json.dumps(selector)}); if(!e) return null;"
            "var r=e.getBoundingClientRect(), s=getComputedStyle(e);"
            "return {x:r.x, y:r.y, w:r.width, h:r.height, shown: s.display!=='none' && s.visibility!=='hidden'};})()"
        )

    verdict = box("#verdict .verdict")
    assert verdict and verdict["shown"] and verdict["y"] < 200 and verdict["h"] > 50  # the first thing on screen
    tree = box("svg.tree")
    assert tree and tree["shown"] and tree["w"] > 600 and tree["h"] > 200
    culprit = box("svg.tree a.badge.culprit")
    assert culprit and culprit["shown"] and culprit["w"] > 100
    assert devtools.js("document.querySelector('svg.tree a.badge.culprit').textContent").startswith("G")
    # a folded run of library frames unfolds on click: the page's script ran under its CSP
    pop = devtools.js("document.querySelector('.foldline').getAttribute('data-pop')")
    assert devtools.js(f"getComputedStyle(document.getElementById('{pop}')).display") == "none"
    devtools.js("document.querySelector('.foldline').dispatchEvent(new MouseEvent('click', {bubbles: true}))")
    assert devtools.js(f"getComputedStyle(document.getElementById('{pop}')).display") != "none"
    assert devtools.js(f"document.getElementById('{pop}').getBoundingClientRect().height") > 20
    # hovering a group's stack highlights its path in the tree
    devtools.js("document.querySelector('article.group.culprit').dispatchEvent(new MouseEvent('mouseenter'))")
    assert devtools.js("document.querySelectorAll('svg.tree .box.hl').length") == 2  # the trunk and the branch
    # the payloads are text nodes; none became an element or ran
    texts = devtools.js("Array.from(document.querySelectorAll('code')).map(function(e){return e.textContent})")
    for p in PAYLOADS:
        assert p in texts
    assert devtools.js("document.querySelectorAll('img, iframe, object, embed').length") == 0
    assert devtools.js("document.scripts.length") == 1


def test_screenshot_of_the_bloom_384_report(tmp_path, devtools):
    page = bloom_384(tmp_path)
    assert page.stat().st_size < 200_000
    devtools.open(page.as_uri())
    assert devtools.js("document.querySelector('#verdict .kind').textContent") == "dataloader-stall"
    # the whole tree fits the 1400 px page at a glance, the culprit's stack included
    tree = devtools.js("(function(){var r=document.querySelector('svg.tree').getBoundingClientRect();return [r.width, r.bottom]})()")
    assert tree[0] <= 1400 and tree[1] <= 1300
    culprit = devtools.js("(function(){var r=document.querySelector('svg.tree a.badge.culprit').getBoundingClientRect();return [r.right, r.bottom]})()")
    assert culprit[0] <= 1400 and culprit[1] <= 1300
    import base64

    shot = devtools.call("Page.captureScreenshot", {"format": "png", "clip": {"x": 0, "y": 0, "width": 1400, "height": 1300, "scale": 1}})
    data = base64.b64decode(shot["data"])
    assert png_size(data) == (1400, 1300)
    assert len(data) > 30_000  # a drawn page, not a blank one
    out = tmp_path / "report-bloom384.png"
    out.write_bytes(data)
    keep = os.environ.get("HANGDOC_ARTIFACTS")
    if keep:
        os.makedirs(keep, exist_ok=True)
        shutil.copy(out, os.path.join(keep, out.name))
        shutil.copy(page, os.path.join(keep, page.name))
    # and Chromium's own command-line screenshot (what docs/report.md shows) works too
    done = chromium(tmp_path, f"--screenshot={tmp_path / 'cli.png'}", "--window-size=1200,900", page.as_uri())
    assert png_size((tmp_path / "cli.png").read_bytes()) == (1200, 900), done.stderr[-2000:]


def deep_report():
    """A tree five boxes deep (each branch point starts a new column), the culprit on the deepest
    branch: drawn wider than a 1,400 px page, the culprit at its far right."""
    from hangdoc.analysis.grouping import build_report
    from hangdoc.model import Culprit, Finding, Frame, Job, Process, Thread

    def fr(name, line):
        return Frame(name, "pipeline_engine_with_a_long_module_name.py", line)

    trunk = (fr("<module>", 1), fr("main", 10), fr("train", 20))
    stacks = {
        (0, 1, 2, 3): trunk + (fr("step", 30), Frame("all_reduce", "torch/distributed/distributed_c10d.py", 2000)),
        (4, 5): trunk + (fr("pipeline_stage_forward_and_backward", 40), fr("send_activations", 50)),
        (6,): trunk + (fr("pipeline_stage_forward_and_backward", 40), fr("recv_gradients", 60), fr("wait_recv", 61)),
        (7,): trunk + (fr("pipeline_stage_forward_and_backward", 40), fr("recv_gradients", 60), fr("drain_queue", 70),
                       fr("broadcast_the_last_microbatch_from_the_culprit_rank", 71),
                       Frame("broadcast", "torch/distributed/distributed_c10d.py", 2100)),
        (8,): trunk + (fr("pipeline_stage_forward_and_backward", 40), fr("recv_gradients", 60), fr("drain_queue", 70),
                       fr("reduce_scatter_the_optimizer_state_of_this_stage", 80),
                       Frame("reduce_scatter", "torch/distributed/distributed_c10d.py", 2200)),
    }
    procs = [Process(host="node1", pid=100 + r, rank=r, role="rank", threads=[Thread("1", "MainThread", stack, is_main=True)])
             for ranks, stack in stacks.items() for r in ranks]
    report = build_report(Job(processes=procs, world_size=len(procs)))
    report.findings = [Finding("collective-mismatch", "rank 7 called broadcast where the others called `reduce_scatter`",
                               [Culprit("node1", 107, 7)], ["rank 7: broadcast at `drain_queue`"], confidence=0.8)]
    return report


def test_culprit_branch_in_view_without_scrolling_at_1400(tmp_path):
    """The culprit's deepest box (and its group badge) is on screen at 1400x900 as the page opens,
    though the tree is wider than the page; a clipped frame name has its whole name as a tooltip;
    backticks are code; the confidence says what it means."""
    page = tmp_path / "deep.html"
    write_atomic(str(page), render(deep_report(), "html", RenderOptions()))
    d = DevTools(tmp_path, 1400, 900)
    try:
        d.open(page.as_uri())
        width = d.js("document.querySelector('svg.tree').getBoundingClientRect().width")
        assert width > 1400, "the tree must be wider than the page for this test to mean anything"
        rect = d.js(
            "(function(){var bs=document.querySelectorAll('svg.tree .box.culprit'), best=null;"
            "for (var i=0;i<bs.length;i++){var r=bs[i].getBoundingClientRect(); if(!best||r.right>best.right) best=r;}"
            "return {left:best.left, right:best.right, top:best.top, bottom:best.bottom};})()"
        )
        badge = d.js("(function(){var r=document.querySelector('svg.tree a.badge.culprit').getBoundingClientRect();"
                     "return {left:r.left, right:r.right, top:r.top, bottom:r.bottom};})()")
        for r in (rect, badge):
            assert 0 <= r["left"] and r["right"] <= 1400 and 0 <= r["top"] and r["bottom"] <= 900, r
        assert d.js("window.scrollX") == 0 and d.js("window.scrollY") == 0  # the page itself did not move
        assert d.js("document.querySelector('#verdict .verdict').getBoundingClientRect().top") < 200
        shot = d.call("Page.captureScreenshot", {"format": "png"})
        import base64

        data = base64.b64decode(shot["data"])
        assert png_size(data) == (1400, 900)
        keep = os.environ.get("HANGDOC_ARTIFACTS")
        if keep:
            os.makedirs(keep, exist_ok=True)
            Path(keep, "report-deep-1400.png").write_bytes(data)
        # every frame name cut with an ellipsis carries its whole label as a tooltip
        cut = d.js("Array.from(document.querySelectorAll('svg.tree text')).filter(function(t){"
                   "return t.querySelector('tspan.fn') && t.querySelector('tspan.fn').textContent.indexOf('…')>=0})"
                   ".map(function(t){var s=t.querySelector('title'); return [t.querySelector('tspan.fn').textContent,"
                   " s ? s.textContent : '']})")
        assert len(cut) >= 2, cut  # the long names were cut...
        for shown, title in cut:  # ...and each shows its whole label on hover
            assert title.startswith(shown.rstrip("…")) and len(title) > len(shown), (shown, title)
        assert d.js("document.querySelector('#verdict .summary code').textContent") == "reduce_scatter"
        conf = d.js("document.querySelector('#verdict .conf').getAttribute('title')")
        assert "from 0 to 1" in conf and "collective records" in conf and "stacks" in conf
    finally:
        d.close()
