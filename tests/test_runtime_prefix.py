"""Rank-prefixed output: the line splitter (hypothesis), templates, a real process, a torchrun job."""

from __future__ import annotations

import os
import re
import socket
import sys
import textwrap

from hypothesis import given, settings, strategies as st

from hangdoc.runtime.identity import Identity
from hangdoc.runtime.prefix import Prefixer, render_prefix
from tests.procs import run, torchrun_cmd

HOST = socket.gethostname().split(".")[0]


def expected(prefix: bytes, data: bytes) -> bytes:
    if not data:
        return b""
    lines = data.split(b"\n")
    last = lines.pop()
    return b"".join(prefix + line + b"\n" for line in lines) + (prefix + last if last else b"")


@settings(max_examples=300, deadline=None)
@given(
    chunks=st.lists(st.tuples(st.binary(max_size=40).map(lambda b: b.replace(b"\r", b"")) | st.sampled_from([b"\n", b"ab\n", b"\n\n"]),
                              st.booleans()), max_size=30),
    prefix=st.binary(min_size=1, max_size=8),
)
def test_prefixer_never_splits_or_loses_a_line(chunks, prefix):
    # However the bytes are chunked, and wherever an idle flush (finish) falls, the output is the
    # input with exactly one prefix at the start of every line.
    p = Prefixer(prefix)
    out = b""
    for data, idle in chunks:
        out += p.feed(data)
        if idle:
            out += p.finish()
    out += p.finish()
    assert out == expected(prefix, b"".join(d for d, _ in chunks))


@settings(max_examples=200, deadline=None)
@given(
    parts=st.lists(st.one_of(
        st.text(alphabet=st.characters(blacklist_characters="{}$"), max_size=5),
        st.sampled_from(["${rank}", "${local_rank}", "${role_name}", "{host}", "{rank}", "{local_rank}", "{world_size}", "{pid}", "{nope}", "${nope}"]),
    ), max_size=8),
    rank=st.integers(0, 4096), local_rank=st.integers(0, 7),
)
def test_render_prefix_substitutes_known_names_only(parts, rank, local_rank):
    ident = Identity(host="node-3", rank=rank, local_rank=local_rank, world_size=8192, local_world_size=8, pid=99)
    values = {"rank": str(rank), "local_rank": str(local_rank), "role_name": "trainer", "host": "node-3",
              "world_size": "8192", "pid": "99"}
    want = "".join(values.get(re.sub(r"[${}]", "", p), p) if p.startswith(("{", "$")) else p for p in parts)
    assert render_prefix("".join(parts), ident, role_name="trainer") == want


def test_default_prefix():
    ident = Identity(host="n1", rank=12, local_rank=4, world_size=16, local_world_size=8, pid=1)
    assert render_prefix(None, ident) == "[n1:12] "


PROGRAM = textwrap.dedent('''\
    import ctypes, logging, os, sys, time, warnings
    import hangdoc
    restore = hangdoc.prefix_output(sys.argv[1] if len(sys.argv) > 1 else None)
    print("from print")
    sys.stdout.write("half a "); sys.stdout.flush(); time.sleep(0.05); print("line")
    os.write(1, b"from os.write\\n")
    libc = ctypes.CDLL(None); libc.printf(b"from C printf\\n"); libc.fflush(None)
    warnings.warn("from warnings")
    hangdoc.get_logger("job").warning("from a logger")
    sys.stdout.write("partial at exit")
    raise RuntimeError("boom")
    ''')


def test_every_kind_of_output_is_prefixed_and_tracebacks_too(tmp_path):
    script = tmp_path / "p.py"
    script.write_text(PROGRAM)
    res = run([sys.executable, str(script)], timeout=60, env={"RANK": "5", "WORLD_SIZE": "8"})
    assert res.returncode == 1
    tag = f"[{HOST}:5] "
    out = res.stdout.splitlines()
    assert out == [tag + "from print", tag + "half a line", tag + "from os.write", tag + "from C printf",
                   tag + "partial at exit"], res.stdout
    err = res.stderr.splitlines()
    assert err and all(line.startswith(tag) for line in err), res.stderr
    text = "\n".join(err)
    assert "UserWarning: from warnings" in text
    assert re.search(r"WARNING job: from a logger", text) and f"[{HOST}:5] [{HOST}:5]" not in text
    assert err[-1] == tag + "RuntimeError: boom" and any("Traceback" in line for line in err)


def test_restore_puts_the_original_streams_back(tmp_path):
    script = tmp_path / "r.py"
    script.write_text(textwrap.dedent('''\
        import os, hangdoc
        before = os.fstat(1).st_ino
        restore = hangdoc.prefix_output("<${rank}> ")
        print("in")
        assert hangdoc.prefix_output() is not None  # a second call changes nothing
        restore()
        assert os.fstat(1).st_ino == before
        print("out")
        '''))
    res = run([sys.executable, str(script)], timeout=60, env={"RANK": "2"})
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == ["<2> in", "out"]


JOB = textwrap.dedent('''\
    import os, sys
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.ones(1)
    dist.all_reduce(t)
    for i in range(200):
        print(f"line {i} of rank {rank} sum {int(t.item())}")
    os.write(1, f"fd write of rank {rank}\\n".encode())
    print(f"stderr of rank {rank}", file=sys.stderr)
    dist.destroy_process_group()
    ''')


def test_torchrun_job_every_line_carries_its_rank(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    res = run(torchrun_cmd(3, "-m", "hangdoc", "--prefix-template", "[${role_name}:${rank}|{host}] ", str(script)),
              timeout=120)
    assert res.returncode == 0 and not res.timed_out, res.stderr[-3000:]
    seen = set()
    for line in res.stdout.splitlines():
        m = re.fullmatch(r"\[default:(\d)\|" + re.escape(HOST) + r"\] (?:line (\d+) of rank (\d) sum 3|fd write of rank (\d))", line)
        assert m, line
        rank = int(m.group(1))
        assert rank == int(m.group(3) or m.group(4))
        seen.add((rank, m.group(2)))
    assert seen == {(r, str(i)) for r in range(3) for i in range(200)} | {(r, None) for r in range(3)}
    for r in range(3):
        assert f"[default:{r}|{HOST}] stderr of rank {r}" in res.stderr.splitlines()


def test_exit_does_not_wait_for_children_that_hold_the_pipe(tmp_path):
    # A child (DataLoader worker, compile pool) inherits the pipe and may outlive the parent's
    # exit; the parent must still exit promptly, with its own output forwarded.
    script = tmp_path / "c.py"
    script.write_text(textwrap.dedent('''\
        import subprocess, sys, hangdoc
        hangdoc.prefix_output()
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        print("parent", child.pid)
        sys.stdout.write("no newline")
        '''))
    proc = run([sys.executable, str(script)], timeout=60, stdout=open(tmp_path / "out", "w"), stderr=None)
    try:
        assert proc.returncode == 0
        # a liveness bound, not a speed figure: the child sleeps 30 s, waiting for it is the bug
        assert proc.elapsed < 10, proc.elapsed
        lines = (tmp_path / "out").read_text().splitlines()
        assert lines[0].startswith(f"[{HOST}:0] parent ") and lines[1] == f"[{HOST}:0] no newline"
    finally:
        pid = int((tmp_path / "out").read_text().split()[2])
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
