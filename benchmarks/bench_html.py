"""The HTML report at 384 and 131,072 processes: file size, Python render time, Chromium load time.

    python benchmarks/bench_html.py                         # bloom and gen sets, 384 and 131072
    python benchmarks/bench_html.py --sizes 384 --repeat 5 --screenshot docs/img/report-bloom384.png

Dump sets (generated once, cached under ``--root``):

* ``bloom``: the BLOOM-176B evaluation hang (``tests/fixtures/bloom/make_bloom.py``) at TP=4 PP=12
  DP=8 (384 processes, 48 nodes) and TP=8 PP=16 DP=1024 (131,072 processes, 16,384 nodes);
  py-spy text without ranks, as srun leaves it.
* ``gen``: ``benchmarks/gen_dumps.py`` (real captured py-spy blocks, a rank map, an unresponsive
  and a missing rank).
* ``distinct`` (only when asked, ``--sets distinct``): the worst case for the picture, every process
  on its own line (n groups of one), built from model objects.

For each set it reads and analyses once, then times, side by side on the same Report: the html
renderer against the text renderer (the baseline), and in Chromium (headless, DevTools over a
pipe) loading the HTML report against loading the text report as a .txt file. Best of
``--repeat``; ratios printed, nothing asserted.
"""

from __future__ import annotations

import argparse
import base64
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, os.pardir))
sys.path[:0] = [ROOT, HERE, os.path.join(ROOT, "tests")]

BLOOM_SHAPES = {384: (4, 12, 8), 131072: (8, 16, 1024)}


def bloom_set(n: int, root: str) -> Tuple[str, Optional[str]]:
    tp, pp, dp = BLOOM_SHAPES[n]
    out = os.path.join(root, f"bloom-{n}")
    stamp = os.path.join(out, ".generated")
    if not os.path.exists(stamp):
        subprocess.run([sys.executable, os.path.join(ROOT, "tests/fixtures/bloom/make_bloom.py"), out,
                        "--tp", str(tp), "--pp", str(pp), "--dp", str(dp)], check=True, stdout=subprocess.DEVNULL)
        open(stamp, "w").close()
    return out, None


def gen_set(n: int, root: str) -> Tuple[str, Optional[str]]:
    import gen_dumps

    out = gen_dumps.ensure(n, root)
    return out, os.path.join(out, "rank-map.json")


def distinct_job(n: int):
    """The worst case for the picture: every process on its own line, so n groups of one."""
    from hangdoc.model import Frame, Job, Process, Thread

    trunk = (Frame("<module>", "train.py", 90), Frame("main", "train.py", 80), Frame("train", "train.py", 40))
    procs = [Process(host=f"node{r // 8 + 1:05d}", pid=1000 + r % 8, rank=r,
                     threads=[Thread("1", "MainThread", trunk + (Frame("step", "train.py", r),), is_main=True)]) for r in range(n)]
    return Job(processes=procs, world_size=n)


def best(fn: Callable[[], object], repeat: int) -> Tuple[float, object]:
    times, result = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t)
    return min(times), result


def chromium_load(devtools, path: str, repeat: int) -> float:
    """Seconds from Page.navigate to the load event (layout of the inline SVG included)."""
    def goto(url: str) -> None:
        devtools.events.clear()
        devtools.call("Page.navigate", {"url": url})
        while not any(e.get("method") == "Page.loadEventFired" for e in devtools.events):
            devtools.events.append(devtools.receive())

    times = []
    for _ in range(repeat):
        goto("about:blank")
        t = time.perf_counter()
        goto("file://" + os.path.abspath(path))
        # force style and layout of the whole document, not just what the load event waited for
        devtools.js("document.body.getBoundingClientRect().height + document.querySelectorAll('*').length")
        times.append(time.perf_counter() - t)
    return min(times)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="384,131072")
    ap.add_argument("--sets", default="bloom,gen")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "hangdoc-bench-dumps"))
    ap.add_argument("--screenshot", metavar="PNG", help="save a 1400x1300 screenshot of the bloom 384 report")
    ap.add_argument("--keep", metavar="DIR", help="keep the rendered reports in DIR")
    a = ap.parse_args(argv)

    from hangdoc.analysis import analyse
    from hangdoc.readers import read_paths
    from hangdoc.cli.aggregate import read_rank_map
    from hangdoc.renderers import RenderOptions, render

    try:
        from test_html_browser import CHROMIUM, DevTools
    except Exception as e:  # pytest missing, say
        CHROMIUM, DevTools = None, None
        print(f"(no Chromium timings: {e})")
    tmp = tempfile.mkdtemp(prefix="hangdoc-bench-html-")
    devtools = None
    if CHROMIUM and DevTools:
        from pathlib import Path

        devtools = DevTools(Path(tmp), 1400, 1300)
        devtools.open("about:blank")
    makers = {"bloom": bloom_set, "gen": gen_set}
    rows: List[Dict[str, object]] = []
    try:
        for n in [int(x) for x in a.sizes.split(",")]:
            for name in a.sets.split(","):
                t = time.perf_counter()
                if name == "distinct":
                    job = distinct_job(n)
                else:
                    path, rank_map = makers[name](n, a.root)
                    job = read_paths([path], rank_map=read_rank_map(rank_map) if rank_map else None)
                report = analyse(job)
                read_s = time.perf_counter() - t
                opts = RenderOptions()
                html_s, page = best(lambda: render(report, "html", opts), a.repeat)
                text_s, text = best(lambda: render(report, "text", opts), a.repeat)
                dot_s, dot_text = best(lambda: render(report, "dot", opts), a.repeat)
                html_path = os.path.join(tmp, f"{name}-{n}.html")
                text_path = os.path.join(tmp, f"{name}-{n}.txt")
                with open(html_path, "w", encoding="utf-8") as f:
                    f.write(page)
                with open(text_path, "w", encoding="utf-8") as f:
                    f.write(text)
                row: Dict[str, object] = dict(
                    set=name, n=len(job.processes), groups=len(report.groups), read_s=read_s,
                    html_kb=len(page.encode()) / 1024, text_kb=len(text.encode()) / 1024, dot_kb=len(dot_text.encode()) / 1024,
                    html_s=html_s, text_s=text_s, dot_s=dot_s,
                )
                if shutil.which("dot"):
                    row["graphviz_s"], _ = best(lambda: subprocess.run(["dot", "-Tsvg"], input=dot_text.encode(), capture_output=True, check=True), 1)
                if devtools:
                    row["chromium_html_s"] = chromium_load(devtools, html_path, a.repeat)
                    row["chromium_text_s"] = chromium_load(devtools, text_path, a.repeat)
                    if a.screenshot and name == "bloom" and n == 384:
                        chromium_load(devtools, html_path, 1)
                        shot = devtools.call("Page.captureScreenshot", {"format": "png", "clip": {"x": 0, "y": 0, "width": 1400, "height": 1300, "scale": 1}})
                        from hangdoc.atomic import write_atomic

                        write_atomic(a.screenshot, base64.b64decode(shot["data"]))
                        print(f"screenshot: {a.screenshot}")
                if a.keep:
                    os.makedirs(a.keep, exist_ok=True)
                    shutil.copy(html_path, a.keep)
                rows.append(row)
                print_row(row)
    finally:
        if devtools:
            devtools.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def print_row(r: Dict[str, object]) -> None:
    line = (f"{r['set']:>5} {r['n']:>7,} processes {r['groups']:>3} groups | read+analyse {r['read_s']:6.2f} s | "
            f"html {r['html_kb']:7.1f} KB in {r['html_s'] * 1000:6.1f} ms (text {r['text_kb']:.1f} KB in {r['text_s'] * 1000:.1f} ms: "
            f"x{r['html_s'] / max(r['text_s'], 1e-9):.1f}) | dot {r['dot_kb']:.1f} KB {r['dot_s'] * 1000:.1f} ms")
    if "graphviz_s" in r:
        line += f", dot -Tsvg {r['graphviz_s'] * 1000:.0f} ms"
    if "chromium_html_s" in r:
        line += (f" | Chromium load html {r['chromium_html_s'] * 1000:.0f} ms vs txt {r['chromium_text_s'] * 1000:.0f} ms "
                 f"(x{r['chromium_html_s'] / max(r['chromium_text_s'], 1e-9):.1f})")
    print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
