"""Re-run the offline hangdoc columns of a bug-matrix run on its saved evidence, with today's code.

    python benchmarks/bug_matrix_reaggregate.py benchmarks/results/2026-11-25-bug-matrix

``bug_matrix.py`` keeps every scenario's evidence (the job's output directory ``hangdoc-out/``,
its console ``hangdoc.log``, the plain py-spy dumps and their rank map). Reading them again is
cheap, while running the jobs again takes most of an hour: this prints, for the same evidence,
the verdicts of ``hangdoc aggregate`` on the output directory (the matrix's ``aggregate``
column), on the output directory with the console log (what a user who also has the log gets),
and on the py-spy dumps (the ``pyspy`` column), each judged by ``matrix_judge`` against the
scenario's TRUTH, next to the verdicts the run recorded.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import matrix_judge  # noqa: E402


def truth(name: str) -> Dict[str, Any]:
    with open(os.path.join(ROOT, "examples", "bugs", f"{name}.py"), encoding="utf-8") as f:
        for node in ast.parse(f.read()).body:
            if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "TRUTH":
                return ast.literal_eval(node.value)
    raise ValueError(f"{name}: no TRUTH")


def aggregate(args: List[str]) -> Optional[Dict[str, Any]]:
    r = subprocess.run([sys.executable, "-m", "hangdoc", "aggregate", "--format", "json"] + args, capture_output=True,
                       text=True, timeout=300, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    if r.returncode != 0:
        return None
    return matrix_judge.from_report(json.loads(r.stdout))


def cell(t: Dict[str, Any], v: Optional[Dict[str, Any]]) -> str:
    j = matrix_judge.judge(t, v)
    if j == "RIGHT" or v is None:
        return j
    return f"{j}: {v.get('kind')} {v.get('culprits')}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results")
    a = ap.parse_args()
    cols = ("aggregate", "aggregate + log", "pyspy")
    print("| scenario | truth | " + " | ".join(cols) + " |")
    print("|---|---|" + "---|" * len(cols))
    right = [0] * len(cols)
    n = 0
    for name in sorted(os.listdir(a.results)):
        d = os.path.join(a.results, name)
        out = os.path.join(d, "hangdoc-out")
        if not os.path.isdir(out):
            continue
        t = truth(name)
        rank_map = os.path.join(d, "pyspy-rank-map.txt")
        verdicts = [aggregate([out]), aggregate([out, os.path.join(d, "hangdoc.log")]),
                    aggregate(["--rank-map", rank_map, os.path.join(d, "pyspy")]) if os.path.exists(rank_map) else None]
        cells = [cell(t, v) for v in verdicts]
        for i, c in enumerate(cells):
            right[i] += c == "RIGHT"
        n += 1
        print(f"| {name} | {t['kind']} {t['culprits']} | " + " | ".join(cells) + " |", flush=True)
    print("| **RIGHT** | | " + " | ".join(f"{r}/{n}" for r in right) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
