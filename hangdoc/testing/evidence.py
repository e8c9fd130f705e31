"""What a multi-rank test's rank processes leave behind, read for its failure: their output with
the test runner's frames cut out, the stacks of hung ranks (py-spy, else faulthandler from each
rank's guard thread), every rank's collective records, and the aggregator's verdict on a hang.

    >>> print(trim_output('''Thread 0x1 (most recent call first):
    ...   File "/x/_pytest/python.py", line 9 in pytest_pyfunc_call
    ...   File "/t/test_a.py", line 5 in test_a'''))
    Thread 0x1 (most recent call first):
      File "/t/test_a.py", line 5 in test_a
"""

from __future__ import annotations

import glob
import os
import re
import signal
import sys
import time
from typing import Any, Dict, List, Optional, Sequence


def take_hang_evidence(ranks, run_dir: str, world_size: int) -> Dict[str, Any]:
    """Stacks (py-spy, else faulthandler from the rank's guard thread) and records of the hung ranks."""
    from hangdoc.runtime.identity import short_hostname
    from hangdoc.tags import format_tag
    from hangdoc.testing.procs import pyspy_dump
    from hangdoc.atomic import write_atomic

    alive = ranks.alive()
    ranks.request_dump(alive)
    pids = {r: ranks.procs[r].pid for r in alive}
    spied = pyspy_dump(list(pids.values()))
    host = os.environ.get("HANGDOC_HOST") or short_hostname()
    for r, pid in pids.items():
        text = spied.get(pid)
        if text:
            tag = format_tag(host=host, pid=pid, rank=r, local_rank=r, world_size=world_size)
            write_atomic(os.path.join(run_dir, f"stacks-{host}-r{r}-{pid}.txt"), tag + "\n" + text)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if all(os.path.exists(os.path.join(run_dir, f"dumped-r{r}")) or ranks.procs[r].poll() is not None for r in alive):
            break
        time.sleep(0.05)
    return {"alive": alive, "pids": pids, "pyspy": sorted(r for r, pid in pids.items() if pid in spied)}


def crash_text(rank: int, rc: Optional[int], output: str) -> "tuple[str, str]":
    """(how the rank died, that and the end of its output)."""
    if rc is not None and rc < 0:
        try:
            how = f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            how = f"killed by signal {-rc}"
    else:
        how = f"exited with status {rc}"
    return how, f"rank {rank} {how} before reporting a result; its last output:\n{_tail(trim_output(output), 40) or '(none)'}"


def _tail(text: str, lines: int) -> str:
    parts = text.splitlines()
    if len(parts) <= lines:
        return text
    return f"[{len(parts) - lines} earlier lines left out]\n" + "\n".join(parts[-lines:])


#: frames of the test runner itself, below the test function: noise in a failure message.
_RUNNER_FRAME = re.compile(r"(_pytest|pluggy|pytest)[/\\]|<frozen runpy>|hangdoc[/\\]testing[/\\]")


def trim_output(text: str) -> str:
    """A rank's output with pytest's and pluggy's frames cut out of faulthandler tracebacks and
    py-spy dumps, and idle helper threads (the guard thread) left out: what is left is the user's code."""
    out: List[str] = []
    block: List[str] = []  # the current thread's lines, kept only if a frame is not threading plumbing

    def flush() -> None:
        frames = [ln for ln in block[1:] if ln.strip()]
        if frames and all("threading.py" in ln or "hangdoc-testing-guard" in ln for ln in frames):
            pass
        elif block and "hangdoc-testing-guard" not in block[0]:
            out.extend(block)
        block.clear()

    in_thread = False
    for line in text.rstrip().splitlines():
        stripped = line.strip()
        if stripped.startswith(("Thread ", "Current thread ")):
            flush()
            in_thread = True
            block.append(line)
            continue
        if stripped.startswith("Extension modules:") or (stripped.startswith("Process ") and "python" in stripped):
            continue
        if (stripped.startswith("File ") or stripped.endswith(")")) and _RUNNER_FRAME.search(stripped):
            continue
        if in_thread and (stripped.startswith("File ") or (stripped.endswith(")") and "(" in stripped and line.startswith(" "))):
            block.append(line)
            continue
        if in_thread:
            flush()
            in_thread = False
        out.append(line)
    flush()
    return "\n".join(out).rstrip()


def print_outputs(ranks, which: Sequence[int]) -> None:
    """Each rank's output, into the parent's captured stdout (shown with the failure, or live with -s);
    a crashed rank's output is in the failure text already."""
    for r in which:
        out = _tail(trim_output(ranks.output(r, limit=256_000)), 40)
        if out:
            sys.stdout.write(f"---- rank {r} output ----\n{out}\n")


def read_records(run_dir: str) -> Dict[int, List[Any]]:
    """rank -> its records, for every rank that left a records file (a crashed rank leaves none)."""
    import json

    from hangdoc.model import CollectiveRecord, Source

    try:
        from hangdoc.readers import records as reader
    except ImportError:
        reader = None  # type: ignore[assignment]
    by_rank: Dict[int, List[Any]] = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "collectives-*.jsonl"))):
        try:
            with open(path) as f:
                header = json.loads(f.readline() or "{}")
        except (OSError, ValueError):
            continue
        rank = header.get("rank")
        if not isinstance(rank, int):
            continue
        if reader is not None:
            recs = reader.read(path, Source(path))
        else:
            with open(path) as f:
                recs = [CollectiveRecord.from_json(d) for d in map(json.loads, f) if "op" in d]
        by_rank.setdefault(rank, []).extend(recs)
    return by_rank


def _strip_runner(job) -> None:
    """Leave pytest's own frames (everything outside the test function) and the guard thread out
    of the stacks, so the verdict's tree starts at the test."""

    def is_guard(t) -> bool:
        return (t.name or "") == "hangdoc-testing-guard" or any(
            f.function == "dump_for_parent" or f.file.replace("\\", "/").endswith("hangdoc/testing/procs.py")
            for f in t.frames)

    for proc in job.processes:
        proc.threads = [t for t in proc.threads if not is_guard(t)]
        if proc.threads and not any(t.is_main for t in proc.threads):
            # faulthandler marks the thread that dumped (the guard) as current: the test's is the main one
            test = [t for t in proc.threads if any(f.function == "pytest_pyfunc_call" for f in t.frames)]
            (test or proc.threads)[0].is_main = True
        for t in proc.threads:
            frames = t.frames
            cut = max((i for i, f in enumerate(frames) if f.function == "pytest_pyfunc_call"), default=-1)
            if cut >= 0:
                t.frames = tuple(frames[cut + 1:])


def hang_text(run_dir: str, hang: Dict[str, Any], ranks, fake: bool = False) -> str:
    """The aggregator's verdict on the hung ranks' stacks and every rank's records.

    ``fake``: the fake backend completes every call at once, peers or not; a call counts as
    completed only where every rank of its group issued it, later ones as issued (a rank that ran
    ahead then waits for the hung one instead of issuing "extra" calls)."""
    paths = sorted(glob.glob(os.path.join(run_dir, "collectives-*.jsonl")))
    raw: List[str] = []
    for r in hang["alive"]:
        pid = hang["pids"][r]
        spy = glob.glob(os.path.join(run_dir, f"stacks-*-r{r}-{pid}.txt"))
        fh = glob.glob(os.path.join(run_dir, f"faulthandler-*-r{r}-{pid}.txt"))
        chosen = spy or fh
        paths += chosen
        for p in chosen:
            try:
                with open(p) as f:
                    raw.append(f"---- rank {r} stacks ({'py-spy' if spy else 'faulthandler'}) ----\n" + trim_output(f.read()))
            except OSError:
                pass
    from hangdoc.ranges import describe_ranks

    spied = hang["pyspy"]
    others = [r for r in hang["alive"] if r not in spied]
    how = "; ".join(
        f"{describe_ranks(rs)} with {tool}" for rs, tool in ((spied, "py-spy"), (others, "faulthandler")) if rs
    )
    try:
        from hangdoc.analysis import analyse
        from hangdoc.readers import read_paths
        from hangdoc.renderers import render

        job = read_paths(paths)
        if fake:
            issued: Dict[str, Dict[int, int]] = {}
            for rec in job.records:
                per_rank = issued.setdefault(rec.group, {})
                per_rank[rec.rank] = max(per_rank.get(rec.rank, 0), rec.seq + 1)
            everyone = set(hang.get("pids", {})) | {rec.rank for rec in job.records}
            for rec in job.records:
                if rec.seq >= min(issued[rec.group].get(r, 0) for r in everyone):
                    rec.state, rec.time_completed = "issued", None
        _strip_runner(job)
        report = analyse(job)
        return f"hangdoc verdict (stacks of {how}):\n" + render(report, "text").rstrip()
    except Exception as e:  # the aggregator is optional here: fall back to the raw stacks
        why = f"(hangdoc aggregate unavailable: {type(e).__name__}: {e})"
        return why + "\n" + "\n".join(raw)
