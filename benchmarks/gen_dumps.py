"""Generate an N-rank dump set from real captured py-spy dumps, the way srun leaves it on a cluster.

    python benchmarks/gen_dumps.py 384 /tmp/dumps-384

writes ``trace-nodeNNNN.out`` files (``--per-node`` processes each, back to back, as
``srun --output=trace-%N.out ... py-spy dump`` writes them) and ``rank-map.json``
(``{"host:pid": rank}``, one entry per rank, including the one rank that has no dump).

The process blocks are real ``py-spy dump`` output taken from ``tests/fixtures/dumps/*/plain``
(and ``with-workers``), with only the pid rewritten. The layout mirrors a hung job:

* almost every rank waits in the same collective (the majority block of ``skip_broadcast``);
* rank 0 is the culprit, in the other collective (the minority block);
* a few outlier ranks carry the stacks of other captured scenarios (if any are present);
* one rank's dump is py-spy's own failure output (captured here by running py-spy on a process
  that is not Python), so it shows up as unresponsive;
* the last rank has no dump at all (it is only in the rank map): a missing rank.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time
from typing import Dict, List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, os.pardir, "tests", "fixtures", "dumps")

_PROCESS = re.compile(r"^Process (\d+): ", re.M)

#: py-spy's failure output when the target is not a Python process (py-spy 0.4), used only if
#: py-spy cannot be run here to capture it afresh.
_PYSPY_ERROR = """Error: Failed to find python version from target process

Stack backtrace:
   0: anyhow::error::<impl anyhow::Error>::msg
   1: py_spy::python_process_info::get_python_version
   2: py_spy::python_spy::PythonSpy::new
   3: py_spy::dump::write_traces
   4: py_spy::dump::print_traces
   5: py_spy::run_spy_command
   6: py_spy::main
   7: std::sys::backtrace::__rust_begin_short_backtrace
   8: std::rt::lang_start::{{closure}}
   9: std::rt::lang_start_internal
  10: main
"""


def split_blocks(text: str) -> List[Tuple[int, str]]:
    """``(pid, block)`` for each ``Process PID:`` block of a plain py-spy dump file."""
    starts = [(m.start(), int(m.group(1))) for m in _PROCESS.finditer(text)]
    out = []
    for i, (pos, pid) in enumerate(starts):
        end = starts[i + 1][0] if i + 1 < len(starts) else len(text)
        out.append((pid, text[pos:end].rstrip("\n") + "\n"))
    return out


def main_stack(block: str) -> str:
    """The MainThread's frames of a block, as text (what decides the group)."""
    m = re.search(r'^Thread \S+ \(\w[\w+]*\): "MainThread"\n((?:    .*\n?)*)', block, re.M)
    return m.group(1) if m else block


def templates(fixtures: str = FIXTURES) -> Tuple[str, str, List[str]]:
    """(majority block, culprit block, outlier blocks), pids replaced by ``{pid}``."""
    base = sorted(glob.glob(os.path.join(fixtures, "skip_broadcast", "plain", "*.out")))
    if not base:
        raise SystemExit(f"no captured dumps under {fixtures}/skip_broadcast/plain")
    blocks = [b for path in base for b in split_blocks(open(path, encoding="utf-8", errors="replace").read())]
    by_stack: Dict[str, List[Tuple[int, str]]] = collections.defaultdict(list)
    for pid, block in blocks:
        by_stack[main_stack(block)].append((pid, block))
    ranked = sorted(by_stack.values(), key=lambda v: (-len(v), v[0][0]))
    majority = _template(*ranked[0][0])
    culprit = _template(*ranked[-1][0]) if len(ranked) > 1 else majority
    seen = set(by_stack)
    outliers: List[str] = []
    for path in sorted(glob.glob(os.path.join(fixtures, "*", "plain", "*.out")) + glob.glob(os.path.join(fixtures, "*", "with-workers", "*.out"))):
        for pid, block in split_blocks(open(path, encoding="utf-8", errors="replace").read()):
            s = main_stack(block)
            # ranks only: a DataLoader worker's block names its parent and would not take a rank
            if s not in seen and "\nParent Process " not in block:
                seen.add(s)
                outliers.append(_template(pid, block))
    return majority, culprit, outliers


def _template(pid: int, block: str) -> str:
    block = block.replace("{", "{{").replace("}", "}}")
    return re.sub(rf"\b{pid}\b", "{pid}", block)


def pyspy_error() -> str:
    """py-spy's real failure output, captured by dumping a process that is not Python."""
    if shutil.which("py-spy"):
        p = subprocess.Popen(["sleep", "30"], start_new_session=True)
        try:
            r = subprocess.run(["py-spy", "dump", "--pid", str(p.pid)], capture_output=True, text=True, timeout=20)
            out = (r.stdout + r.stderr).strip()
            if out.startswith("Error"):
                return out + "\n"
        except (OSError, subprocess.SubprocessError):
            pass
        finally:
            p.kill()
            p.wait()
    return _PYSPY_ERROR


def generate(n: int, out: str, per_node: int = 8, fixtures: str = FIXTURES) -> Dict[str, int]:
    """Write the dump set for ``n`` ranks into ``out``; returns counts of what was written."""
    majority, culprit, outliers = templates(fixtures)
    error = pyspy_error()
    os.makedirs(out, exist_ok=True)
    for old in glob.glob(os.path.join(out, "trace-*.out")):
        os.unlink(old)
    nodes = (n + per_node - 1) // per_node
    width = max(4, len(str(nodes)))
    # a few outliers spread over the job, deterministic
    n_out = min(len(outliers) * 2, max(3, n // 4096)) if outliers else 0
    outlier_ranks = {(k + 1) * n // (n_out + 1): outliers[k % len(outliers)] for k in range(n_out)}
    unresponsive_rank = n // 2 + 1
    missing_rank = n - 1
    rank_map: Dict[str, int] = {}
    counts = collections.Counter()
    for node in range(nodes):
        host = f"node{node + 1:0{width}d}"
        parts: List[str] = []
        for local in range(per_node):
            rank = node * per_node + local
            if rank >= n:
                break
            pid = 20000 + local * 7 + (node % 97)  # pids repeat across hosts, as on a real cluster
            rank_map[f"{host}:{pid}"] = rank
            if rank == missing_rank:
                counts["missing"] += 1
                continue
            if rank == unresponsive_rank:
                parts.append(error)
                counts["unresponsive"] += 1
                continue
            if rank == 0:
                tmpl = culprit
                counts["culprit"] += 1
            elif rank in outlier_ranks:
                tmpl = outlier_ranks[rank]
                counts["outlier"] += 1
            else:
                tmpl = majority
                counts["majority"] += 1
            parts.append(tmpl.format(pid=pid))
        with open(os.path.join(out, f"trace-{host}.out"), "w", encoding="utf-8") as f:
            f.write("".join(parts))
    with open(os.path.join(out, "rank-map.json"), "w", encoding="utf-8") as f:
        json.dump(rank_map, f)
    counts["files"] = nodes
    return dict(counts)


def ensure(n: int, root: str, per_node: int = 8) -> str:
    """The dump set for ``n`` ranks under ``root``, generated once and reused while the fixtures stay the same."""
    out = os.path.join(root, f"ranks-{n}")
    stamp = os.path.join(out, ".generated")
    key = _fixture_key() + f" per_node={per_node}"
    if os.path.exists(stamp) and open(stamp).read() == key:
        return out
    t = time.perf_counter()
    counts = generate(n, out, per_node)
    print(f"generated {n} ranks in {time.perf_counter() - t:.1f} s: {counts}", file=sys.stderr)
    with open(stamp, "w") as f:
        f.write(key)
    return out


def _fixture_key() -> str:
    paths = sorted(glob.glob(os.path.join(FIXTURES, "*", "plain", "*.out")) + glob.glob(os.path.join(FIXTURES, "*", "with-workers", "*.out")))
    return ";".join(f"{os.path.relpath(p, FIXTURES)}:{os.path.getsize(p)}:{int(os.path.getmtime(p))}" for p in paths)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("n", type=int)
    ap.add_argument("out")
    ap.add_argument("--per-node", type=int, default=8)
    a = ap.parse_args()
    print(generate(a.n, a.out, a.per_node))
