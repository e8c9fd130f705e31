"""Hostile inputs through the whole aggregate pipeline: read_paths, analyse and every renderer.

    nice python benchmarks/fuzz_aggregate.py                      # 100,000 inputs, seed 1
    python benchmarks/fuzz_aggregate.py --inputs 2000 --seed 7    # a quick run
    python benchmarks/fuzz_aggregate.py --replay DIR              # one saved failing input again

Each input is a directory of one to three files (and sometimes a FIFO or a link to /dev/zero),
given to :func:`hangdoc.readers.read_paths` either as the directory (a walk) or file by file (named),
then analysed and rendered as text, markdown, json, html and dot (svg is dot through the system's
Graphviz, not hangdoc's code). Inputs are made by

* mutations of the real fixtures in ``tests/fixtures`` (byte flips, line duplication and deletion,
  huge numbers, long lines, deep stacks, NUL runs and holes, ANSI colours, launcher prefixes,
  truncation, forged tag lines, two fixtures spliced), and
* a grammar of every format hangdoc reads (py-spy plain/json, faulthandler, traceback, gdb,
  pystack, hangdoc records, Flight Recorder JSON and pickles, hostile pickle opcodes) with hostile
  values in every field (numbers past 64 bits and past 4,300 digits, newlines and bidi controls in
  names, deep nesting, self-referencing pickles).

Everything runs in this process. Per input: CPU and wall time, the peak RSS so far
(``resource.getrusage``), and every ``--tracemalloc-every``-th input its Python allocation peak
(``tracemalloc``). Reported: internal errors (an exception out of the pipeline, and reader
exceptions the readers' own catch-alls turned into "could not read" parse errors, and rules that
raised, which the diagnosis reports and skips), inputs over
``--slow`` seconds, peak memory. The address space is capped (``--as-limit-mb``) so that a blow-up
is a MemoryError counted here, not a machine out of memory; a stuck input is cut by SIGALRM.
Exit status 1 when any criterion fails (internal errors, slow inputs, peak RSS over ``--max-rss-mb``).

The time limit (``--slow``, 2 s) is on **CPU time** (``time.process_time``: this process, all its
threads), not wall time. Wall time is what a user feels, but on the machine these runs are made on
(2 cores shared with other sessions, the fuzz run under ``nice -n 10``) wall time mostly measures
how long the scheduler kept hangdoc off a core: the same input took 1.8 s CPU and 7.0 s wall
there. The pipeline does no waiting of its own (inputs are local files, never a FIFO or a device;
a stuck input is the alarm's case), so on an idle core its wall time is its CPU time, and CPU time
counts every thread, which wall time would not. Wall time is still reported: the worst, and how
many inputs were over ``--slow`` by the wall clock (``inputs_over_slow_wall``), for a run on an
idle machine to read.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import pickle
import random
import resource
import shutil
import signal
import sys
import tempfile
import time
import tracemalloc
import traceback
from typing import Callable, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, os.pardir))
sys.path.insert(0, ROOT)

from hangdoc.analysis import analyse  # noqa: E402
from hangdoc.readers import read_paths  # noqa: E402
from hangdoc.renderers import RenderOptions, render  # noqa: E402

FORMATS = ("text", "markdown", "json", "html", "dot")
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
#: fixture bytes used per input at most (the larger fixtures are cut to this)
MAX_FIXTURE = 256 << 10
#: characters of one generated file at most: hostile, not merely big (a 300 MB file may take seconds)
MAX_INPUT = 8 << 20
#: parse-error messages that mean a reader raised and a catch-all caught it (a bug, counted)
CAUGHT = ("could not read: ", "could not read this ", "could not read records: ")

Files = List[Tuple[str, object]]  # (name, bytes | "FIFO" | "DEVZERO")


# --- the real fixtures ---------------------------------------------------------------------------


def load_fixtures() -> List[Tuple[str, bytes]]:
    out = []
    for root, _, files in os.walk(FIXTURES):
        for name in sorted(files):
            if name.endswith((".py", ".md", ".gz", ".sh", ".png")) or name == "truth.json":
                continue
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                data = f.read(MAX_FIXTURE)
            if data:
                out.append((name, data))
    return out


# --- mutations -----------------------------------------------------------------------------------

HUGE = [b"9999999999999", b"9" * 5000, b"-1", b"18446744073709551617", b"1" * 4301, b"0" * 300 + b"7"]
PREFIXES = [b"[rank3]:", b"[default0]:", b"[n1:3] ", b"12: ", b"[1]:" * 40, b"node7: ", b"[rank99999999999999]:"]
ANSI = [b"\x1b[1;33m", b"\x1b[0m", b"\x1b]0;title\x07", b"\x1b[38;5;196m", b"\x1b[2J", b"\x1b[" + b"1;" * 5000 + b"m"]
WEIRD = ["\n", "\u202e", "\u2066", "\x1b[2J", "\r", "\x00", "\u2028", "<script>alert(1)</script>", "» no-hang:", "`|*_"]


def _lines(data: bytes) -> List[bytes]:
    return data.split(b"\n")


def m_flip(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 20)):
        if b:
            b[rng.randrange(len(b))] = rng.randrange(256)
    return bytes(b)


def _times(line: bytes, n: int) -> int:
    """``n``, or fewer so that ``n`` copies of ``line`` stay within MAX_INPUT."""
    return max(1, min(n, MAX_INPUT // (len(line) + 1)))


def m_dup_lines(rng: random.Random, data: bytes) -> bytes:
    ls = _lines(data)
    i = rng.randrange(len(ls))
    ls[i:i + 1] = [ls[i]] * _times(ls[i], rng.choice([2, 10, 1000, 20000]))
    return b"\n".join(ls)


def m_drop_lines(rng: random.Random, data: bytes) -> bytes:
    ls = _lines(data)
    for _ in range(rng.randint(1, 10)):
        if len(ls) > 1:
            del ls[rng.randrange(len(ls))]
    return b"\n".join(ls)


def m_huge_numbers(rng: random.Random, data: bytes) -> bytes:
    out = bytearray()
    i = 0
    while i < len(data):
        c = data[i]
        if 48 <= c <= 57:
            j = i
            while j < len(data) and 48 <= data[j] <= 57:
                j += 1
            out += rng.choice(HUGE) if rng.random() < 0.3 else data[i:j]
            i = j
            if len(out) > MAX_INPUT:
                break
        else:
            out.append(c)
            i += 1
    return bytes(out)


def m_long_line(rng: random.Random, data: bytes) -> bytes:
    ls = _lines(data)
    i = rng.randrange(len(ls))
    fill = rng.choice([b" ", b"a", b"[", b"1", b"(", b'"', b"x at ", b"-", b"\t"])
    n = rng.choice([70_000, 300_000, 1 << 20]) // len(fill)
    ls.insert(i, ls[i][:20] + fill * n + rng.choice([b"", b"x", b":", b")"]))
    return b"\n".join(ls)


def m_deep_stack(rng: random.Random, data: bytes) -> bytes:
    ls = _lines(data)
    frames = [i for i, l in enumerate(ls) if l.startswith((b"    ", b"  File", b"#"))]
    if not frames:
        return m_dup_lines(rng, data)
    i = rng.choice(frames)
    ls[i:i + 1] = [ls[i]] * _times(ls[i], rng.choice([5_000, 30_000, 200_000]))
    return b"\n".join(ls)


def m_nul(rng: random.Random, data: bytes) -> bytes:
    i = rng.randrange(len(data) + 1)
    hole = b"\x00" * rng.choice([1, 3, 64, 4096, 70_000])
    if rng.random() < 0.3:
        return hole + data  # copytruncate: the hole is the head
    return data[:i] + hole + data[i:]


def m_ansi(rng: random.Random, data: bytes) -> bytes:
    ls = _lines(data)
    for _ in range(rng.randint(1, 30)):
        i = rng.randrange(len(ls))
        j = rng.randrange(len(ls[i]) + 1)
        ls[i] = ls[i][:j] + rng.choice(ANSI) + ls[i][j:]
    return b"\n".join(ls)


def m_prefix(rng: random.Random, data: bytes) -> bytes:
    p = rng.choice(PREFIXES)
    every = rng.random() < 0.5
    return b"\n".join((p + l) if every or rng.random() < 0.3 else l for l in _lines(data))


def m_truncate(rng: random.Random, data: bytes) -> bytes:
    return data[:rng.randrange(len(data) + 1)]


def m_tag(rng: random.Random, data: bytes) -> bytes:
    fields = {"host": rng.choice(["n1", "n" * 3000, "a\u202eb", "x`y"]), "pid": rng.choice(HUGE + [b"42"]).decode(),
              "rank": rng.choice(HUGE + [b"3"]).decode(), "world_size": rng.choice(HUGE + [b"1048576", b"4"]).decode(),
              "main_thread": rng.choice(["0x" + "f" * 5000, "0x7f", "zz"]), "status": "unresponsive", "reason": "a_b"}
    tag = "# hangdoc process " + " ".join(f"{k}={v}" for k, v in fields.items() if rng.random() < 0.8)
    ls = _lines(data)
    ls.insert(rng.randrange(len(ls) + 1), tag.encode("utf-8", "surrogatepass"))
    return b"\n".join(ls)


def m_splice(rng: random.Random, data: bytes, other: bytes = b"") -> bytes:
    return data[:rng.randrange(len(data) + 1)] + other[rng.randrange(len(other) + 1):]


def m_weird_names(rng: random.Random, data: bytes) -> bytes:
    w = rng.choice(WEIRD).encode("utf-8")
    ls = _lines(data)
    for _ in range(rng.randint(1, 10)):
        i = rng.randrange(len(ls))
        j = rng.randrange(len(ls[i]) + 1)
        ls[i] = ls[i][:j] + w + ls[i][j:]
    return b"\n".join(ls)


MUTATIONS: List[Tuple[str, Callable, float]] = [
    ("flip", m_flip, 10), ("dup-lines", m_dup_lines, 5), ("drop-lines", m_drop_lines, 5),
    ("huge-numbers", m_huge_numbers, 10), ("long-line", m_long_line, 3), ("deep-stack", m_deep_stack, 1.5),
    ("nul", m_nul, 6), ("ansi", m_ansi, 6), ("prefix", m_prefix, 6), ("truncate", m_truncate, 6),
    ("tag", m_tag, 8), ("splice", m_splice, 4), ("weird-names", m_weird_names, 6),
]


# --- grammar -------------------------------------------------------------------------------------


def _num(rng: random.Random) -> str:
    return rng.choice(["0", "1", "3", "42", "65535", "9999999999999", "9" * 5000, "-1", "18446744073709551617"])


def _name(rng: random.Random) -> str:
    base = rng.choice(["main", "all_reduce", "wait", "_worker_loop", "forward", "<module>", "send", "recv", "barrier"])
    if rng.random() < 0.3:
        base += rng.choice(WEIRD) + rng.choice(["fake", "» collective-mismatch: rank 0 is the culprit"])
    return base


def _file(rng: random.Random) -> str:
    if rng.random() < 0.01:
        return "a" * rng.choice([300, 70_000]) + ".py"
    return rng.choice(["train.py", "torch/distributed/distributed_c10d.py", "/usr/lib/python3.11/threading.py",
                       "torch/utils/data/_utils/worker.py", "<frozen runpy>"])


def _frames(rng: random.Random, n: int, fmt: str) -> List[str]:
    out = []
    size = 0
    for _ in range(n):
        if size > MAX_INPUT // 4:
            break
        fn, f, ln = _name(rng), _file(rng), _num(rng)
        out.append({
            "pyspy": f"    {fn} ({f}:{ln})",
            "faulthandler": f'  File "{f}", line {ln} in {fn}',
            "traceback": f'  File "{f}", line {ln}, in {fn}',
            "gdb": f"#{rng.randint(0, 99)} 0x00007f in {fn} () at {f}:{ln}",
            "pystack": f'    (Python) File "{f}", line {ln}, in {fn}',
        }[fmt])
        size += len(out[-1])
    return out


def g_stacks(rng: random.Random) -> Files:
    fmt = rng.choice(["pyspy", "faulthandler", "traceback", "gdb", "pystack"])
    lines: List[str] = []
    for p in range(rng.randint(1, 4)):
        pid = _num(rng)
        if rng.random() < 0.7:
            lines.append(f"# hangdoc process host=n{p} pid={pid} rank={_num(rng)} world_size={_num(rng)}")
        depth = rng.choice([1, 3, 10, 50, 12_000]) if rng.random() < 0.95 else 60_000
        if fmt == "pyspy":
            lines += [f"Process {pid}: python train.py", "Python v3.11.7 (/usr/bin/python3.11)", "",
                      f'Thread {pid} (idle): "MainThread"'] + _frames(rng, depth, fmt) + [""]
        elif fmt == "faulthandler":
            lines += ["Thread 0x00007f0000000001 (most recent call first):"] + _frames(rng, depth, fmt) + [""]
        elif fmt == "traceback":
            lines += ["Traceback (most recent call last):"] + _frames(rng, depth, fmt) + [f"RuntimeError: {_name(rng)}"]
        elif fmt == "gdb":
            lines += [f"Thread 1 (Thread 0x7f (LWP {pid})):"] + _frames(rng, depth, fmt) + [""]
        else:
            lines += [f"Traceback for thread {pid} (python) [] (most recent call last):"] + _frames(rng, depth, fmt) + [""]
    if rng.random() < 0.3:
        lines += ["  host      : " + "n1" + " " * rng.choice([1, 100_000]) + "x", f"  rank      : {_num(rng)} (local_rank: {_num(rng)})",
                  f"  exitcode  : 1 (pid: {_num(rng)})"]
    text = ("\n".join(lines) + rng.choice(["\n", ""]))[:MAX_INPUT]
    return [(rng.choice(["trace-n1.out", "stacks-n1-r0-42.txt", "stderr-rank3.log", "x.log"]),
             text.encode("utf-8", "surrogatepass"))]


def _jint(rng: random.Random):
    return rng.choice([0, 1, 3, -1, 2 ** 63, 10 ** 30, 1 << 20, True, None, "3", 1.5, [1]])


def g_records(rng: random.Random) -> Files:
    ws = rng.choice([4, 1 << 20, (1 << 20) + 1, 9999999999999, -1, "x", 0])
    lines = [json.dumps({"hangdoc": "collectives", "version": 1, "host": "n1", "rank": 0, "pid": 7, "world_size": ws})]
    for seq in range(rng.randint(0, 30)):
        d = {"rank": _jint(rng) if rng.random() < 0.2 else 0, "seq": _jint(rng) if rng.random() < 0.2 else seq,
             "op": rng.choice(["all_reduce", "broadcast", "send", "recv", "barrier", ""]),
             "group_ranks": rng.choice([[0, 1, 2, 3], [], [10 ** 30], list(range(5)), None]),
             "shapes": rng.choice([[[8]], [[2 ** 70]], [[-1]], [["x"]], None]),
             "call_site": "train.py:3:" + _name(rng), "state": rng.choice(["issued", "completed", "bogus"]),
             "time_issued": rng.choice([0.0, 1e300, 10 ** 400 if rng.random() < 0.5 else 1.0, None]),
             "peer": rng.choice([None, 1, 10 ** 9])}
        lines.append(json.dumps(d))
    if rng.random() < 0.2:
        lines.append("[" * rng.choice([100, 100_000]) + "]" * 3)
    if rng.random() < 0.1:
        lines.append("{" + '"a": 1,' * 150_000 + '"b": 2}')
    return [(f"collectives-n1-r0-{rng.randint(1, 99)}.jsonl", ("\n".join(lines) + "\n").encode())]


def _fr_dump(rng: random.Random) -> Dict:
    entries = []
    for i in range(rng.randint(0, 30)):
        entries.append({
            "record_id": i, "pg_id": 0, "process_group": rng.choice([("0", "default_pg"), ("1", "x"), (), "zz", None]),
            "collective_seq_id": _jint(rng) if rng.random() < 0.2 else i + 1, "p2p_seq_id": 0,
            "profiling_name": rng.choice(["nccl:all_reduce", "nccl:send 0->1", "gloo:broadcast", "nccl:recv 1<-" + "9" * 5000, 5]),
            "input_sizes": rng.choice([[[8]], [[2 ** 70]], "abc", [[1, "x"]], None]),
            "input_dtypes": ["Float"], "state": "completed",
            "time_created_ns": rng.choice([0, 10 ** 400, -5, 1.0, "x"]),
            "frames": rng.choice([[{"name": _name(rng), "filename": _file(rng), "line": 3}], "x", None, [1, 2]]),
        })
    if rng.random() < 0.2:
        entries.append(rng.choice([[], "x", 5, None]))
    return {"version": "2.10", "pg_config": {"0": {"name": "0", "desc": "default_pg",
                                                   "ranks": rng.choice(["[0, 1]", "[" + "9" * 5000 + "]", "[" * 5000, [0, 1], "x"])}},
            "entries": entries, "rank": rng.choice([None, 1, -1, 10 ** 30])}


def _hostile_pickle(rng: random.Random) -> bytes:
    kind = rng.randrange(6)
    if kind == 0:  # memo index near 2**31: the C unpickler would size an array by it
        return b"\x80\x04}\x94r\xff\xff\xff\x3f."
    if kind == 1:  # shared references: a few KB standing for 10^9 elements
        inner = list(range(2000))
        return pickle.dumps({"entries": [{"input_sizes": inner, "profiling_name": "nccl:x"}] * 2000}, protocol=4)
    if kind == 2:  # a list that contains itself
        a: List[object] = []
        a.append(a)
        return pickle.dumps({"entries": a}, protocol=2)
    if kind == 3:  # a global: must be refused, never run
        return b"\x80\x04\x95\x1a\x00\x00\x00\x00\x00\x00\x00\x8c\x02os\x94\x8c\x06system\x94\x93\x94\x8c\x04true\x94\x85\x94R\x94."
    if kind == 4:  # deep nesting
        return b"\x80\x04" + b"(" * 100_000 + b"l" * 100_000 + b"."
    return b"\x80\x04\x8a\xff" + b"\xff" * 255 + b"."  # a 2040-bit int


def g_flight_recorder(rng: random.Random) -> Files:
    name = rng.choice(["nccl_trace_rank_0", "fr_trace_rank_3", "nccl_trace_rank_" + "9" * 200])
    r = rng.random()
    if r < 0.4:
        return [(name, json.dumps(_fr_dump(rng)).encode())]
    if r < 0.7:
        try:
            data = pickle.dumps(_fr_dump(rng), protocol=rng.choice([2, 3, 4, 5]))
        except (OverflowError, ValueError):
            data = b"\x80\x04N."
        return [(name, data)]
    return [(name, _hostile_pickle(rng))]


def g_pyspy_json(rng: random.Random) -> Files:
    """py-spy's ``--json`` output. Built bounded: frames stop once the text would pass MAX_INPUT (the
    whole JSON of 3 x 12,000 frames with 70 KB names, built before the cut, made the harness's own
    peak RSS 420 MB)."""
    indent = rng.choice([None, 2])
    size = 0
    threads = []
    for t in range(rng.randint(1, 3)):
        depth = rng.choice([1, 5, 12_000])
        frames = []
        for _ in range(depth):
            frame = {"name": _name(rng), "filename": _file(rng), "line": _jint(rng),
                     "locals": rng.choice([None, [{"name": "rank", "repr": _num(rng)}], "x"])}
            size += len(json.dumps(frame, indent=indent)) + 8
            frames.append(frame)
            if size > MAX_INPUT:
                break
        threads.append({"pid": _jint(rng), "thread_id": _jint(rng), "thread_name": rng.choice(["MainThread", {"x": 1}, "a\nb"]),
                        "owns_gil": False, "active": rng.choice([True, False, None]), "frames": frames})
        if size > MAX_INPUT:
            break
    text = json.dumps(threads, indent=indent)[:MAX_INPUT]
    if rng.random() < 0.1:
        text = "[" + "[" * 50_000
    return [("pyspy-" + str(rng.randint(0, 9)) + ".out", text.encode())]


GRAMMARS: List[Tuple[str, Callable, float]] = [
    ("g-stacks", g_stacks, 10), ("g-records", g_records, 6), ("g-flight-recorder", g_flight_recorder, 6),
    ("g-pyspy-json", g_pyspy_json, 4),
]


def special_files(rng: random.Random) -> Files:
    return [(rng.choice(["trace-fifo.out", "stacks-n1-r0-1.txt", "x.out"]), "FIFO"),
            (rng.choice(["nccl_trace_rank_0", "collectives-n1-r0-1.jsonl", "trace-zero.out"]), "DEVZERO")]


# --- one input -----------------------------------------------------------------------------------


def make_input(rng: random.Random, fixtures: List[Tuple[str, bytes]]) -> Tuple[str, Files]:
    r = rng.random()
    if r < 0.03:
        name, data = rng.choice(fixtures)
        return "special", special_files(rng)[: rng.randint(1, 2)] + [(name, data)]
    if r < 0.35:
        names, fns, weights = zip(*GRAMMARS)
        i = rng.choices(range(len(names)), weights)[0]
        return names[i], fns[i](rng)
    names, fns, weights = zip(*MUTATIONS)
    files: Files = []
    used = []
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        name, data = rng.choice(fixtures)
        i = rng.choices(range(len(names)), weights)[0]
        if names[i] == "splice":
            data = m_splice(rng, data, rng.choice(fixtures)[1])
        else:
            data = fns[i](rng, data)
            if rng.random() < 0.2:  # a second mutation on top
                j = rng.choices(range(len(names)), weights)[0]
                data = fns[j](rng, data) if names[j] != "splice" else data
        used.append(names[i])
        data = data[:MAX_INPUT]
        files.append((f"{len(files)}-{name}" if rng.random() < 0.5 else name, data))
    return "+".join(sorted(set(used))), files


def write_input(d: str, files: Files) -> List[str]:
    paths = []
    for name, data in files:
        p = os.path.join(d, name)
        if os.path.lexists(p):
            continue
        if data == "FIFO":
            os.mkfifo(p)
        elif data == "DEVZERO":
            os.symlink("/dev/zero", p)
        else:
            with open(p, "wb") as f:
                f.write(data)  # type: ignore[arg-type]
        paths.append(p)
    return paths


def run_one(paths: List[str], walk_dir: Optional[str]) -> Tuple[int, int]:
    """The pipeline on one input: (reader exceptions and failed rules caught on the way, processes + records)."""
    job = read_paths([walk_dir] if walk_dir else paths)
    caught = sum(1 for e in job.errors if e.message.startswith(CAUGHT))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):  # diagnose prints "hangdoc: rule X failed: ..." for a rule that raised
        report = analyse(job)
    caught += err.getvalue().count("hangdoc: rule ")
    for fmt in FORMATS:
        render(report, fmt, RenderOptions())
    render(report, "text", RenderOptions(color=True))
    return caught, len(job.processes) + len(job.records)


def fresh() -> None:
    """Before an input, outside its timing: hangdoc's memo caches emptied and a full garbage
    collection, so that an input is timed as in a fresh ``hangdoc aggregate`` process. Without it
    a long run's own heap (the generator's leftovers, hangdoc's caches filled by thousands of
    inputs) made each collection an input triggered slower: replayed in fresh processes, the
    inputs a 100,000-input run timed at 2.0-2.9 s took 0.3-1.5 s."""
    for name, mod in list(sys.modules.items()):
        if not name.startswith("hangdoc"):
            continue
        for value in list(vars(mod).values()):
            clear = getattr(value, "cache_clear", None)
            if callable(clear) and getattr(value, "__module__", None) == name:
                clear()
    from hangdoc.analysis import signatures

    signatures._shape_cache.clear()
    gc.collect()


class Stuck(Exception):
    pass


def _alarm(signum, frame):
    raise Stuck("input still running after the alarm")


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--inputs", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--slow", type=float, default=2.0, help="seconds (CPU) an input may take")
    ap.add_argument("--max-rss-mb", type=float, default=300.0)
    ap.add_argument("--as-limit-mb", type=int, default=2048, help="address-space cap (a blow-up becomes a MemoryError)")
    ap.add_argument("--alarm", type=int, default=60, help="seconds after which a stuck input is cut")
    ap.add_argument("--tracemalloc-every", type=int, default=100)
    ap.add_argument("--save", default=None, help="directory where failing and slow inputs are kept")
    ap.add_argument("--json", default=None, help="write the figures here too")
    ap.add_argument("--progress", type=int, default=5000)
    ap.add_argument("--replay", default=None, help="run one saved input directory and print the traceback")
    ap.add_argument("--only", default=None, help="comma-separated input numbers of this seed: the others are generated (the "
                    "random sequence stays the same) but not run; to time again the slow inputs a run reported")
    args = ap.parse_args(argv)

    if args.replay:
        c0 = time.process_time()
        run_one([], args.replay)
        print(f"no error ({time.process_time() - c0:.3f} s CPU, in a fresh process)")
        return 0
    if args.as_limit_mb:
        resource.setrlimit(resource.RLIMIT_AS, (args.as_limit_mb << 20, resource.RLIM_INFINITY))
    signal.signal(signal.SIGALRM, _alarm)
    fixtures = load_fixtures()
    rng = random.Random(args.seed)
    tmp = tempfile.mkdtemp(prefix="hangdoc-fuzz-")
    internal: List[Dict[str, object]] = []
    caught_total = 0
    caught_inputs: List[Dict[str, object]] = []
    slow: List[Dict[str, object]] = []
    kinds: Dict[str, int] = {}
    worst_cpu = (0.0, "")
    worst_wall = 0.0
    slow_wall = 0
    py_peak = (0, "")
    cpu_sum = 0.0
    base_rss = last_rss = rss_mb()
    rss_jumps: List[Dict[str, object]] = []
    start = time.time()

    def snapshot(n: int) -> Dict[str, object]:
        return {
        "inputs": n, "seed": args.seed, "seconds": round(time.time() - start, 1),
        "mean_cpu_ms": round(1000 * cpu_sum / max(n, 1), 2),
        "internal_errors": len(internal), "reader_exceptions_caught": caught_total,
        "inputs_over_slow": len(slow), "slow_s": args.slow,
        "worst_cpu_s": round(worst_cpu[0], 3), "worst_cpu_kind": worst_cpu[1], "worst_wall_s": round(worst_wall, 3),
        "inputs_over_slow_wall": slow_wall,
        "peak_rss_mb": round(rss_mb(), 1), "rss_before_first_input_mb": round(base_rss, 1),
        "tracemalloc_peak_mb": round(py_peak[0] / 2 ** 20, 1), "tracemalloc_peak_kind": py_peak[1],
        "kinds": dict(sorted(kinds.items())),
        "rss_jumps": rss_jumps[:50],
        "internal": internal[:50], "caught": caught_inputs[:50], "slow": slow[:50],
        }

    only = sorted(int(x) for x in args.only.split(",")) if args.only else None
    if only:
        args.inputs = only[-1] + 1
    try:
        for i in range(args.inputs):
            kind, files = make_input(rng, fixtures)
            if only is not None and i not in only:
                rng.random()  # the walk-or-name draw below, so that the sequence matches a full run
                continue
            kinds[kind.split("+")[0]] = kinds.get(kind.split("+")[0], 0) + 1
            d = os.path.join(tmp, str(i))
            os.mkdir(d)
            paths = write_input(d, files)
            walk = d if rng.random() < 0.5 else None
            keep = False
            traced = args.tracemalloc_every and i % args.tracemalloc_every == 0
            rss_generated = rss_mb()
            fresh()  # (untimed) each input timed as a fresh `hangdoc aggregate` would run it
            c0, w0 = time.process_time(), time.perf_counter()
            signal.alarm(args.alarm)
            err = None
            try:
                caught, _ = run_one(paths, walk)
            except BaseException as e:  # noqa: B902 - everything that escapes is what we count
                if isinstance(e, KeyboardInterrupt):
                    raise
                caught = 0
                err = "".join(traceback.format_exception_only(type(e), e)).strip()[:300]
                tb = traceback.extract_tb(e.__traceback__)
                where = f"{tb[-1].filename}:{tb[-1].lineno}" if tb else "?"
            finally:
                signal.alarm(0)
            cpu, wall = time.process_time() - c0, time.perf_counter() - w0
            rss = rss_mb()
            if rss > last_rss + 20:
                rss_jumps.append({"input": i, "kind": kind, "peak_rss_mb": round(rss, 1),
                                  "raised_by": "generating the input" if rss_generated > last_rss + 20 else "the pipeline",
                                  "bytes_in": sum(len(x) for _, x in files if isinstance(x, bytes))})
                keep = True
            last_rss = rss
            if traced and err is None:
                # again, under tracemalloc (it slows allocation several times: this run is not timed)
                tracemalloc.start()
                signal.alarm(args.alarm)
                try:
                    run_one(paths, walk)
                finally:
                    signal.alarm(0)
                    _, peak = tracemalloc.get_traced_memory()
                    tracemalloc.stop()
                if peak > py_peak[0]:
                    py_peak = (peak, kind)
            cpu_sum += cpu
            if cpu > worst_cpu[0]:
                worst_cpu = (cpu, kind)
            worst_wall = max(worst_wall, wall)
            slow_wall += wall > args.slow
            if err is not None:
                internal.append({"input": i, "kind": kind, "error": err, "at": where})
                keep = True
            if caught:
                caught_total += caught
                caught_inputs.append({"input": i, "kind": kind})
                keep = True
            if cpu > args.slow:
                slow.append({"input": i, "kind": kind, "cpu_s": round(cpu, 3), "wall_s": round(wall, 3)})
                keep = True
            if keep and args.save:
                dest = os.path.join(args.save, f"{i}-{kind.replace('+', '_')}")
                shutil.copytree(d, dest, symlinks=True, ignore=lambda src, names: [n for n in names if not os.path.isfile(os.path.join(src, n)) or os.path.islink(os.path.join(src, n))])
            shutil.rmtree(d)
            if args.progress and (i + 1) % args.progress == 0:
                print(f"{i + 1} inputs, {time.time() - start:.0f} s, internal errors {len(internal)}, caught {caught_total}, "
                      f"slow {len(slow)}, peak RSS {rss_mb():.0f} MB, worst CPU {worst_cpu[0]:.2f} s ({worst_cpu[1]})", flush=True)
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump(snapshot(i + 1), f, indent=1)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    n = len(only) if only else args.inputs
    figures = snapshot(n)
    print(json.dumps(figures, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    ok = not internal and not caught_total and not slow and figures["peak_rss_mb"] <= args.max_rss_mb
    print("PASS" if ok else "FAIL", f"({n} inputs: {len(internal)} internal errors, {caught_total} reader exceptions caught, "
          f"{len(slow)} over {args.slow} s CPU, peak RSS {figures['peak_rss_mb']} MB of {args.max_rss_mb})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
