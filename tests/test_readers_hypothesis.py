"""Dumps generated from the grammar: well-formed ones round-trip, mutated ones never crash.

Processes are generated, rendered the way py-spy / faulthandler / a traceback / gdb print them,
read back, and must come back with the same frames. Then the rendered bytes are mutated (lines
dropped, duplicated, swapped, cut, garbage inserted): the readers must not raise, and every error
must name the file and a line that exists.
"""

from __future__ import annotations

import os
import tempfile

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from hangdoc.readers import read_paths, read_text

_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_"
_ALNUM = _LETTERS + "0123456789"
# st.text over a small alphabet, not st.from_regex: the latter is ~100x slower to draw
IDENT = st.builds(str.__add__, st.sampled_from(_LETTERS), st.text(_ALNUM, max_size=10))
FUNCTION = st.one_of(
    IDENT,
    st.builds(lambda a, b: f"{a}.{b}", IDENT, IDENT),
    st.builds(lambda a, b: f"{a}.<locals>.{b}", IDENT, IDENT),
    st.sampled_from(["<module>", "<listcomp>", "<lambda>"]),
)
_PART = st.builds(str.__add__, st.sampled_from("abcdefghijklmnopqrstuvwxyz_"), st.text("abcdefghijklmnopqrstuvwxyz_0123456789", max_size=7))
FILE = st.builds(lambda parts: "/".join(parts) + ".py", st.lists(_PART, min_size=1, max_size=3))
FRAME = st.tuples(FUNCTION, FILE, st.integers(1, 99_999))
VALUE = st.text(_ALNUM + "<>.,[]{}\"' -", min_size=1, max_size=20).map(str.strip).filter(bool)
LOCALS = st.lists(st.tuples(IDENT, VALUE), max_size=3)
STATE = st.sampled_from(["idle", "active", "active+gil"])


@st.composite
def processes(draw, min_size=1, max_size=4):
    pids = draw(st.lists(st.integers(1, 4_000_000), min_size=min_size, max_size=max_size, unique=True))
    out = []
    for pid in pids:
        n = draw(st.integers(1, 3))
        idents = [pid] + draw(st.lists(st.integers(4_000_001, 8_000_000), min_size=n - 1, max_size=n - 1, unique=True))
        threads = []
        for i, ident in enumerate(idents):
            frames = draw(st.lists(FRAME, min_size=1, max_size=12))
            threads.append({"ident": ident, "name": "MainThread" if i == 0 else draw(IDENT), "state": draw(STATE), "frames": frames})
        out.append({"pid": pid, "threads": threads})
    return out


def render_pyspy(procs, locals_by_frame=None) -> str:
    lines = []
    for p in procs:
        lines += [f"Process {p['pid']}: python train.py", "Python v3.11.7 (/usr/bin/python3.11)", ""]
        for t in p["threads"]:
            lines.append(f"Thread {t['ident']} ({t['state']}): \"{t['name']}\"")
            for func, file, line in reversed(t["frames"]):  # py-spy prints innermost first
                lines.append(f"    {func} ({file}:{line})")
                for name, value in (locals_by_frame or {}).get((func, file, line), ()):
                    lines += ["        Locals:", f"            {name}: {value}"]
    return "\n".join(lines) + "\n"


def render_faulthandler(procs) -> str:
    lines = []
    for p in procs:
        for i, t in enumerate(p["threads"]):
            kind = "Current thread" if i == 0 else "Thread"
            lines.append(f"{kind} 0x{t['ident']:016x} (most recent call first):")
            for func, file, line in reversed(t["frames"]):
                lines.append(f'  File "{file}", line {line} in {func}')
            lines.append("")
        lines.append("some other output between two processes")
    return "\n".join(lines) + "\n"


def render_traceback(procs) -> str:
    lines = []
    for p in procs:
        lines.append("Traceback (most recent call last):")
        for func, file, line in p["threads"][0]["frames"]:
            lines += [f'  File "{file}", line {line}, in {func}', "    do_something()"]
        lines.append(f"RuntimeError: process {p['pid']} timed out")
    return "\n".join(lines) + "\n"


def render_gdb(procs) -> str:
    lines = []
    for p in procs:
        for n, t in reversed(list(enumerate(p["threads"], 1))):
            lines.append(f'Thread {n} (Thread 0x7f00{t["ident"]:08x} (LWP {t["ident"]}) "python"):')
            for k, (func, file, line) in enumerate(reversed(t["frames"])):
                lines.append(f"#{k:<2} 0x00007f1853326f36 in {func.replace('.', '_').strip('<>')} (x=1, y=0x0) at {file}:{line}")
            lines.append("")
        lines.append(f"[Inferior 1 (process {p['pid']}) detached]")
    return "\n".join(lines) + "\n"


def render_pystack(procs) -> str:
    """pystack remote: threads newest first, the main thread (from ``<module>``) last."""
    lines = []
    for p in procs:
        for t in reversed(p["threads"]):
            lines.append(f"Traceback for thread {t['ident']} (python) [] (most recent call last):")
            for func, file, line in pystack_frames(t, t is p["threads"][0]):
                lines += [f'    (Python) File "{file}", line {line}, in {func}', "        do_something()"]
            lines.append("")
    return "\n".join(lines) + "\n"


def pystack_frames(t, main):
    # only a main thread starts in <module>: that is how pystack output is cut into processes
    frames = [f for f in t["frames"] if f[0] != "<module>"] or [("run", "threading.py", 982)]
    return [("<module>", "train.py", 1)] + frames if main else frames


def frames_of(thread):
    return [(f.function, f.file, f.line) for f in thread.frames]


FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(processes())
def test_pyspy_round_trip(procs):
    job = read_text(render_pyspy(procs))
    assert job.errors == []
    assert [p.pid for p in job.processes] == [p["pid"] for p in procs]
    for got, want in zip(job.processes, procs):
        assert [(t.ident, t.name, t.state) for t in got.threads] == [
            (str(t["ident"]), t["name"], t["state"]) for t in want["threads"]]
        assert [frames_of(t) for t in got.threads] == [t["frames"] for t in want["threads"]]
        assert got.main_thread.ident == str(want["pid"])


@FAST
@given(processes(max_size=2), st.data())
def test_pyspy_locals_round_trip(procs, data):
    all_frames = [f for p in procs for t in p["threads"] for f in t["frames"]]
    chosen = data.draw(st.lists(st.sampled_from(all_frames), max_size=3, unique=True))
    locals_by_frame = {f: data.draw(LOCALS) for f in chosen}
    job = read_text(render_pyspy(procs, locals_by_frame))
    assert job.errors == []
    for got, want in zip(job.processes, procs):
        for t, wt in zip(got.threads, want["threads"]):
            assert frames_of(t) == wt["frames"]
            for f in t.frames:
                assert list(f.locals) == list(locals_by_frame.get((f.function, f.file, f.line), []))


@FAST
@given(processes())
def test_faulthandler_round_trip(procs):
    job = read_text(render_faulthandler(procs))
    assert job.errors == []
    assert len(job.processes) == len(procs)
    for got, want in zip(job.processes, procs):
        assert [t.ident for t in got.threads] == [f"0x{t['ident']:016x}" for t in want["threads"]]
        assert [frames_of(t) for t in got.threads] == [t["frames"] for t in want["threads"]]
        assert sum(t.is_main for t in got.threads) == 1


@FAST
@given(processes())
def test_traceback_round_trip(procs):
    job = read_text(render_traceback(procs))
    assert job.errors == []
    assert [frames_of(p.main_thread) for p in job.processes] == [p["threads"][0]["frames"] for p in procs]
    assert [p.meta["exception"] for p in job.processes] == [f"RuntimeError: process {p['pid']} timed out" for p in procs]


@FAST
@given(processes())
def test_gdb_round_trip(procs):
    job = read_text(render_gdb(procs))
    assert job.errors == []
    assert [p.pid for p in job.processes] == [p["pid"] for p in procs]
    for got, want in zip(job.processes, procs):
        assert [[(f.function, f.file, f.line) for f in t.frames] for t in reversed(got.threads)] == [
            [(fn.replace(".", "_").strip("<>"), fi, li) for fn, fi, li in t["frames"]] for t in want["threads"]]
        assert got.main_thread.ident == str(want["threads"][0]["ident"])


@FAST
@given(processes())
def test_pystack_round_trip(procs):
    job = read_text(render_pystack(procs))
    assert job.errors == []
    assert [p.pid for p in job.processes] == [p["pid"] for p in procs]
    for got, want in zip(job.processes, procs):
        assert [t.ident for t in got.threads] == [str(t["ident"]) for t in reversed(want["threads"])]
        assert [frames_of(t) for t in reversed(got.threads)] == [
            pystack_frames(t, i == 0) for i, t in enumerate(want["threads"])]
        assert got.main_thread.ident == str(want["pid"])


RENDERERS = [render_pyspy, render_faulthandler, render_traceback, render_gdb, render_pystack]


@st.composite
def mutated(draw):
    procs = draw(processes(max_size=3))
    text = "".join(r(procs) for r in draw(st.lists(st.sampled_from(RENDERERS), min_size=1, max_size=3)))
    lines = text.encode().split(b"\n")
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["drop", "dup", "swap", "garbage", "cut", "bytes", "prefix"]))
        if not lines:
            break
        i = draw(st.integers(0, len(lines) - 1))
        if op == "drop":
            del lines[i]
        elif op == "dup":
            lines.insert(i, lines[i])
        elif op == "swap":
            j = draw(st.integers(0, len(lines) - 1))
            lines[i], lines[j] = lines[j], lines[i]
        elif op == "garbage":
            lines[i] = draw(st.binary(max_size=40))
        elif op == "cut":
            lines[i] = lines[i][: draw(st.integers(0, max(0, len(lines[i]))))]
        elif op == "bytes":
            k = draw(st.integers(0, len(lines[i])))
            lines[i] = lines[i][:k] + draw(st.binary(min_size=1, max_size=8)) + lines[i][k:]
        else:
            lines[i] = draw(st.sampled_from([b"[rank3]:", b"[default1]:", b"[n1:2] ", b"[x]"])) + lines[i]
    data = b"\n".join(lines)
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]
    return data


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
@example(b'[n1:2] Process 1: python train.py\nPython v3.11.7 (/usr/bin/python3.11)\n\nThread 1 (idle): "MainThread"\n    <module> (a.py:1)\n')
def test_mutated_dumps_never_crash_and_errors_name_real_lines(data):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace-node1.out")
        with open(path, "wb") as f:
            f.write(data)
        job = read_paths([path])
    n_lines = data.count(b"\n") + 1
    for e in job.errors:
        assert e.source == path
        assert 0 <= e.line <= n_lines, (e, n_lines)
        assert str(e).startswith(f"{path}:{e.line}: ")
    # hangdoc's own prefix "[n1:2] " names the host (it wins over the file name), so a process
    # whose lines got that prefix is on n1; every other one is on node1, from the file name.
    hosts = {"node1", "n1"} if b"[n1:2] " in data else {"node1"}
    for p in job.processes:
        assert 1 <= p.source_line <= n_lines
        assert p.host in hosts
        for t in p.threads:
            assert isinstance(t.frames, tuple)
