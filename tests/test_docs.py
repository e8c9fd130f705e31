"""Every command and snippet in the docs runs, so the docs cannot go stale.

Each fenced ```python, ```sh, ```bash and ```console block of README.md and docs/**/*.md runs here,
block after block in one temporary directory per page (the repository's top-level entries linked
into it, so ``tests/fixtures/...`` and ``examples/...`` resolve and what a command writes stays
there), with this checkout first on PYTHONPATH and the interpreter's ``bin`` first on PATH:

* ``python``: the block as a script; a block of ``>>>`` lines is a doctest (``...`` elides); a block
  whose first line is ``# NAME.py`` is written to ``NAME.py`` for the command after it to run;
* ``sh``/``bash``: the block under ``bash -e -o pipefail``;
* ``console``: each ``$ command`` (``\\``-continued) runs, stdout and stderr together, and its
  output must be the lines shown under it. A line ``...`` stands for any lines; ``<…>`` inside a
  line for any text (a pid, a temporary path, a time); this machine's host name reads as ``vm``.

An HTML comment on the line right before a fence says how else to treat a block:

* ``<!-- illustrative: why -->``: not run (a cluster command, a GPU job, a fragment of a larger
  program); the reason is required;
* ``<!-- slow -->``: run, with a longer time limit (a real job on gloo);
* ``<!-- file: NAME -->``: not run, written to ``NAME`` in the page's directory for later blocks.

An unmarked block of those languages must run; an unknown marker fails. A block of any other
language (none, ``text``, ``json``, ...) that holds a command (a ``$ `` line, or a line that starts
with ``hangdoc SUBCOMMAND``, ``torchrun`` or ``python``, after any ``VAR=value``) must be marked
illustrative, or be made a block that runs. New pages are picked up by the glob, so a page added
later is held to the same rules.
"""

from __future__ import annotations

import doctest
import glob
import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import pytest

from tests.procs import ROOT, run

RUN_LANGS = ("python", "sh", "bash", "console")
_SUBCOMMANDS = ("aggregate", "dump", "demo", "run")  # hangdoc.cli.SUBCOMMANDS, checked below
_ASSIGN = re.compile(r"""^(?:[A-Za-z_]\w*=(?:"[^"]*"|'[^']*'|\S*)\s+)+""")
_COMMAND = re.compile(r"^(?:hangdoc\s+(?:%s|-[\w-]+)(?:\s|$)|torchrun(?:\s|$)|python[\d.]*\s+\S)" % "|".join(_SUBCOMMANDS))
TIMEOUT = 60
SLOW_TIMEOUT = 180
_FENCE = re.compile(r"^( *)(`{3,})([\w+-]*)\s*$")
_MARK = re.compile(r"^\s*<!--\s*(.*?)\s*-->\s*$")
_MARKS = re.compile(r"^(illustrative:\s*\S.*|slow|file:\s*[\w./-]+)$")


@dataclass
class Block:
    page: str
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    mark: str  # "" when unmarked

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> List[str]:
    found = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
    return [os.path.relpath(p, ROOT) for p in found if os.path.isfile(p)]


def blocks(page: str) -> List[Block]:
    """The fenced blocks of one page, with their language and the marker right before them."""
    return _parse(page, Path(ROOT, page).read_text(encoding="utf-8"))


def _parse(page: str, text: str) -> List[Block]:
    out: List[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.group(1), m.group(2), m.group(3).lower()
        j = i + 1
        while j < len(lines) and lines[j].strip() != fence:
            j += 1
        body = [x[len(indent):] if x.startswith(indent) else x.lstrip() for x in lines[i + 1:j]]
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        mark = ""
        if k >= 0:
            mm = _MARK.match(lines[k])
            if mm:
                mark = mm.group(1)
        out.append(Block(page, i + 1, lang, "\n".join(body) + "\n", mark))
        i = j + 1
    return out


def _env(tmp: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.update(NO_COLOR="1", TERM="dumb", COLUMNS="100", HANGDOC_DOCS_TEST="1", HOME=str(tmp / "home"))
    # the fixtures' dumps name scripts under the directory they were captured in: whether it exists on
    # the machine running the docs must not change what the pages show (hangdoc.analysis.source_waits)
    env["HANGDOC_SOURCE_ROOTS"] = "0"
    for k in ("HANGDOC_OUT", "PYTEST_CURRENT_TEST", "PYTEST_XDIST_WORKER", "PYTEST_ADDOPTS", "PYTEST_XDIST_TESTRUNUID"):
        env.pop(k, None)
    return env


def _workdir(tmp: Path) -> Path:
    work = tmp / "work"
    work.mkdir()
    (tmp / "home").mkdir()
    for name in os.listdir(ROOT):
        if name.startswith(".") or name in ("hangdoc-out", "pyproject.toml"):  # no suite addopts for a page's pytest
            continue
        os.symlink(os.path.join(ROOT, name), work / name)
    return work


def _run(cmd: List[str], block: Block, work: Path, env: dict) -> subprocess.CompletedProcess:
    limit = SLOW_TIMEOUT if block.mark == "slow" else TIMEOUT
    done = run(cmd, timeout=limit, cwd=str(work), env=env, stdin=subprocess.DEVNULL)
    assert not done.timed_out, f"{block.where}: still running after {limit} s (mark it <!-- slow --> or make it shorter)"
    return done


def _console(block: Block) -> List[Tuple[str, List[str]]]:
    """(command, expected output lines) pairs of a console block; a command goes on after a trailing ``\\``."""
    out: List[Tuple[str, List[str]]] = []
    continued = False
    for line in block.text.splitlines():
        if continued:
            out[-1] = (out[-1][0] + "\n" + line, out[-1][1])
        elif line.startswith("$ "):
            out.append((line[2:], []))
        else:
            assert out, f"{block.where}: a console block starts with a `$ ` command line"
            out[-1][1].append(line)
            continue
        continued = line.endswith("\\")
    return out


# The pages show runs on a machine named "vm": this machine's name reads as that.
_HOST = None if socket.gethostname().split(".")[0] in ("", "vm") else \
    re.compile(r"(?<![\w.-])" + re.escape(socket.gethostname().split(".")[0]) + r"(?![\w-])")


def _line_re(expected: str) -> "re.Pattern[str]":
    return re.compile("".join(".*?" if part == "<…>" else re.escape(part) for part in re.split(r"(<…>)", expected)) + r"\Z")


def matches(expected: List[str], actual: List[str]) -> bool:
    """Whether ``actual`` is ``expected``, where a ``...`` line stands for any lines and ``<…>`` for
    any text within a line."""
    exp = [x.rstrip() for x in expected]
    act = [x.rstrip() for x in actual]
    while exp and not exp[-1]:
        exp.pop()
    while act and not act[-1]:
        act.pop()
    memo: dict = {}

    def at(i: int, j: int) -> bool:
        key = (i, j)
        if key not in memo:
            if i == len(exp):
                memo[key] = j == len(act)
            elif exp[i] == "...":
                memo[key] = any(at(i + 1, k) for k in range(j, len(act) + 1))
            else:
                memo[key] = j < len(act) and bool(_line_re(exp[i]).match(act[j])) and at(i + 1, j + 1)
        return memo[key]

    return at(0, 0)


_NAMED = re.compile(r"^# ([\w-]+\.py)\n")


def run_block(block: Block, work: Path, env: dict) -> None:
    if block.mark.startswith("file:"):
        (work / block.mark.split(":", 1)[1].strip()).write_text(block.text)
        return
    named = _NAMED.match(block.text) if block.lang == "python" else None
    if named:  # "# example.py" on its first line: the file a later command runs
        (work / named.group(1)).write_text(block.text)
        return
    if block.lang == "python":
        if block.text.lstrip().startswith(">>>"):
            script = ("import doctest, sys\n"
                      f"t = doctest.DocTestParser().get_doctest({block.text!r}, {{}}, {block.where!r}, {block.page!r}, {block.line})\n"
                      "r = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)\n"
                      "r.run(t)\nsys.exit(1 if r.failures else 0)\n")
            done = _run([sys.executable, "-c", script], block, work, env)
        else:
            path = work / f"_doc_block_{block.line}.py"
            path.write_text(block.text)
            done = _run([sys.executable, str(path)], block, work, env)
        assert done.returncode == 0, f"{block.where}: python block failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return
    if block.lang in ("sh", "bash"):
        done = _run(["bash", "-e", "-o", "pipefail", "-c", block.text], block, work, env)
        assert done.returncode == 0, f"{block.where}: {block.lang} block failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return
    assert block.lang == "console"
    for cmd, expected in _console(block):
        done = _run(["bash", "-o", "pipefail", "-c", "exec 2>&1\n" + cmd], block, work, env)
        actual = [_HOST.sub("vm", x) for x in done.stdout.splitlines()] if _HOST else done.stdout.splitlines()
        assert matches(expected, actual), (
            f"{block.where}: `{cmd}` printed something else than the page shows.\n--- page\n" + "\n".join(expected)
            + "\n--- real run\n" + "\n".join(actual)
        )


def command_lines(text: str) -> List[str]:
    """The lines of a block that a reader would type: ``$ ...``, or ``hangdoc SUBCOMMAND``,
    ``torchrun`` or ``python ...`` at the start of a line, after any ``VAR=value`` assignments.

        >>> command_lines("$ ls\\nHANGDOC='--record' torchrun -m x\\nhangdoc-out/\\nhangdoc aggregate: error\\n")
        ['$ ls', "HANGDOC='--record' torchrun -m x"]
    """
    out = []
    for line in text.splitlines():
        bare = line.strip()
        if bare.startswith("$ ") or _COMMAND.match(_ASSIGN.sub("", bare)):
            out.append(bare)
    return out


def _runnable(page: str) -> List[Block]:
    return [b for b in blocks(page) if b.lang in RUN_LANGS]


def test_every_runnable_block_is_marked_or_run():
    bad = [f"{b.where}: unknown marker <!-- {b.mark} -->" for p in pages() for b in _runnable(p) if b.mark and not _MARKS.match(b.mark)]
    assert not bad, "\n".join(bad) + "\nknown: <!-- illustrative: why -->, <!-- slow -->, <!-- file: NAME -->"
    assert len(pages()) >= 10


def test_every_block_with_a_command_runs_or_is_illustrative():
    bad = [f"{b.where}: ```{b.lang} block with a command ({command_lines(b.text)[0]!r}): make it a ```bash or "
           "```console block that runs, or mark it <!-- illustrative: why -->"
           for p in pages() for b in blocks(p)
           if b.lang not in RUN_LANGS and not b.mark.startswith("illustrative") and command_lines(b.text)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("page", [p for p in pages() if any(not b.mark.startswith("illustrative") for b in _runnable(p))])
def test_page_blocks_run(page, tmp_path):
    work = _workdir(tmp_path)
    env = _env(tmp_path)
    for block in _runnable(page):
        if block.mark.startswith("illustrative") or not _MARKS.match(block.mark or "slow"):
            continue
        run_block(block, work, env)


def test_the_harness_reads_marks_and_compares_like_a_reader_would(tmp_path):
    page = "a\n<!-- slow -->\n```bash\necho hi\n```\n  ```python\n  print(1)\n  ```\n<!-- illustrative: x -->\n\n```console\n$ x\n```\n"
    got = [(b.line, b.lang, b.text, b.mark) for b in _parse("p.md", page)]
    assert got == [(3, "bash", "echo hi\n", "slow"), (6, "python", "print(1)\n", ""), (11, "console", "$ x\n", "illustrative: x")]
    assert _console(Block("p.md", 1, "console", "$ a \\\n  b\nout\n$ c\n", "")) == [("a \\\n  b", ["out"]), ("c", [])]
    assert matches(["a", "...", "z <…> end"], ["a", "b", "c", "z 12 end"])
    assert matches(["a", "..."], ["a"]) and not matches(["a", "b"], ["a", "c"]) and not matches(["a"], ["a", "b"])
    assert not matches(["advice: Look at skip_broadcast.py:26"], ["advice: Look at skip_broadcast.py:21"])
    # a command in a block that is neither run nor marked illustrative is found, whatever its language
    from hangdoc.cli import SUBCOMMANDS

    assert set(_SUBCOMMANDS) == set(SUBCOMMANDS)
    unmarked = "```\n$ hangdoc aggregate x\n```\n```text\nhangdoc-out/  (a tree)\nhangdoc aggregate: error: no input\n```\n" \
               "```json\n{\"python\": 3}\n```\n<!-- illustrative: GPUs -->\n```\ntorchrun --nproc-per-node 8 train.py\n```\n" \
               "```text\n  OUT=/tmp/x python3 bench.py --cpu 1\n```\n"
    flagged = [(b.line, command_lines(b.text)) for b in _parse("p.md", unmarked) if command_lines(b.text) and not b.mark]
    assert flagged == [(1, ["$ hangdoc aggregate x"]), (15, ["OUT=/tmp/x python3 bench.py --cpu 1"])]
    for bad in ("illustrative", "illustrative:", "slo", "file:"):  # a reason is required; typos are caught
        assert not _MARKS.match(bad)
    # a stale console block fails with both texts shown
    work = _workdir(tmp_path)
    stale = Block("p.md", 1, "console", "$ echo 2\n3\n", "")
    with pytest.raises(AssertionError, match="printed something else"):
        run_block(stale, work, _env(tmp_path))
    run_block(Block("p.md", 1, "console", "$ echo 2; echo oops >&2\n2\noops\n", ""), work, _env(tmp_path))
