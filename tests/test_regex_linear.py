"""Every regex that sees input runs in linear time: 1 MB adversarial lines, each within a bound.

The patterns are collected from the modules (every compiled pattern at module level of the
offline side and the shared modules), so a new pattern is tested without being listed here. Each
runs, the way the code runs it (``search``, which for a ``^`` pattern is ``match``), on lines made
of the runs that make backtracking patterns quadratic: long runs of spaces, digits, letters,
quotes, brackets and separators, after the starts that real lines have. Before the fix the
elastic-failure pattern ``(.*?)\\s*$`` took minutes on a padded line and the host-list pattern
``^(.*?)(\\d+)$`` 25 s on a 60 KB name; a linear pattern takes milliseconds.
"""

from __future__ import annotations

import importlib
import re
import time

import pkgutil

import hangdoc.analysis
import hangdoc.readers
import hangdoc.renderers

# every module of the offline side (a new format's, rule's or renderer's patterns are checked
# without being listed here), and the shared modules
MODULES = sorted(f"{pkg.__name__}.{m.name}" for pkg in (hangdoc.readers, hangdoc.analysis, hangdoc.renderers)
                 for m in pkgutil.iter_modules(pkg.__path__)) + [
    "hangdoc.ranges", "hangdoc.tags", "hangdoc.cmdline", "hangdoc.textsafe",
]
SIZE = 1 << 20
#: seconds for one search on a 1 MB line: a linear pattern takes milliseconds, a quadratic one
#: minutes (the bound leaves room for a loaded machine)
BOUND = 2.0
# Starts of real lines (what gets a backtracking pattern past its anchor) and the runs that follow.
STARTS = ["", "  host      : ", "  rank      : 1 (local_rank: ", "  File \"", "    (Python) File \"", "Thread 1 (",
          "Thread 0x7f (most recent call first):", "#1 0x7f in f () at ", "[rank1]:", "[n1:1] ", "Process 1: ",
          "trace-", "stacks-", "rank", "gpu", "/lib/python3.11/", "Pid(", "'src': ", "gloo::", "ProcessGroup", "\x1b[", "\x1b]",
          "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=", "[PG ID 0 PG GUID 0(", "[Rank ",
          "Rank 1 is running collective: CollectiveFingerPrint(", "frame #0: ", "Not all ranks joining collective",
          "=== Rank ", "Fatal Python error: ", "terminated with exception: ", "  traceback : ", "[1]:",
          "Timed out waiting ", "Connection closed by peer [", "last enqueued NCCL work: ", "ESC[", "(Worker pid=",
          "trainer-1  | ", "node7: ", "r12i0n8:3: ", "2024-01-01T00:00:00", "[2024-01-01 00:00:00", "> ",
          "failed (exitcode: ", "Signal 6 (SIGABRT) received by PID ", "#2 train from ", "Exception raised from ",
          "Ranks 1, ", "Error when verifying shape tensors for collective "]
RUNS = [" ", "1", "a", "\"", ":", "(", "[", "-", ".", "/", "\t", "x at ", ", line 1", "rank1", "\x1b[1", "_"]
#: one line per start: each run repeated over 1/16 of a megabyte, one after the other (a pattern
#: quadratic in any of the runs takes minutes on 64 KB of it)
BODY = "".join(run * ((SIZE // len(RUNS)) // len(run)) for run in RUNS)
LINES = [(start, start + BODY + "\x01y") for start in STARTS]
ALL_STARTS = "".join(STARTS) + BODY + "\x01y"


def patterns():
    """``(where, pattern, how it is used)`` for every pattern."""
    seen = {}
    for name in MODULES:
        mod = importlib.import_module(name)
        for attr, value in vars(mod).items():
            if isinstance(value, re.Pattern) and isinstance(value.pattern, str):
                seen.setdefault((value.pattern, "search"), f"{name}.{attr}")
    from hangdoc.analysis import signature_table as signatures

    for i, row in enumerate(signatures._TABLE):  # function names are fullmatch-ed, paths searched
        seen.setdefault((row[2].pattern, "fullmatch"), f"hangdoc.analysis.signature_table._TABLE[{i}].function")
        if row[3] is not None:
            seen.setdefault((row[3].pattern, "search"), f"hangdoc.analysis.signature_table._TABLE[{i}].path")
    return sorted((where, pat, how) for (pat, how), where in seen.items())


def test_the_collection_holds_the_patterns_that_were_quadratic():
    found = {where for where, _, _ in patterns()}
    assert {"hangdoc.readers.elastic_log._FIELD_RE", "hangdoc.readers.gdb._PY_FILE_RE", "hangdoc.textsafe._ANSI_RE",
            "hangdoc.readers.prefix._BRACKET_RANK_RE", "hangdoc.readers.nccl_log._TIMEOUT_RE"} <= found
    assert len(found) > 30


def test_every_pattern_is_linear_on_1mb_adversarial_lines():
    slow = []
    for where, pattern, how in patterns():
        run = getattr(re.compile(pattern), how)
        # an anchored pattern gets past its anchor only after the right start: one line per start;
        # an unanchored one is tried at every position anyway: one line with every start in it
        anchored = how != "search" or pattern.startswith("^")
        for start, line in LINES if anchored else [("every start", ALL_STARTS)]:
            t = time.perf_counter()
            run(line)
            dt = time.perf_counter() - t
            if dt > BOUND:
                slow.append(f"{where} ({pattern[:60]!r}, {how}) took {dt:.2f} s after {start!r}")
    assert not slow, "\n".join(slow)


def test_the_old_patterns_were_quadratic_and_the_new_code_is_not():
    """The two patterns the issue names, on 5 KB inputs, against the code that replaced them."""
    from hangdoc.ranges import compress_hosts
    from hangdoc.readers import read_text

    old_elastic = re.compile(r"^  (host|rank|exitcode)\s+: (.*?)\s*$")
    old_host = re.compile(r"^(.*?)(\d+)$")
    padded = "  host      : n1" + " " * 5_000 + "x"
    name = "n" + "1" * 5_000 + "x"
    t = time.perf_counter()
    old_elastic.match(padded)
    old_host.match(name)
    old = time.perf_counter() - t
    t = time.perf_counter()
    read_text(padded * 1 + "\n")
    compress_hosts([name, "n1", "n2"])
    new = time.perf_counter() - t
    assert new < old / 5, (old, new)
