"""``hangdoc aggregate`` opens the source file a dump's call site names (to tell whether the call
sits in a loop, issue 20): that name is input. A FIFO there must not hang the aggregate, a link to
``/dev/zero`` must not eat its memory; a real file is still read. Real ``hangdoc aggregate`` runs."""

import os
import resource
import subprocess
import sys

from tests.procs import ROOT, env_for

# ranks 0-1 wait in a broadcast at x.py:5, rank 2 in an all_reduce: a collective-mismatch whose
# evidence says whether x.py:5 is inside a loop (when x.py can be read)
_BLOCK = """# hangdoc process host=n1 pid={pid} rank={rank} world_size=3
Process {pid}: python x.py
Python v3.11.7 (/usr/bin/python3)

Thread {pid} (idle): "MainThread"
    {op} (torch/distributed/distributed_c10d.py:3151)
    step ({src}:{line})
    <module> ({src}:20)
"""


def _dump(tmp_path, src):
    blocks = [_BLOCK.format(pid=100 + r, rank=r, op=op, line=line, src=src)
              for r, (op, line) in enumerate([("broadcast", 5), ("broadcast", 5), ("all_reduce", 9)])]
    path = tmp_path / "trace.out"
    path.write_text("\n".join(blocks))
    return str(path)


def _limit_memory():
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


def _aggregate(dump):
    return subprocess.run([sys.executable, "-m", "hangdoc", "aggregate", dump], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, env=env_for(), preexec_fn=_limit_memory)


def test_a_call_site_in_a_real_file_is_read(tmp_path):
    src = tmp_path / "x.py"
    src.write_text("import torch\n\ndef step():\n    for i in range(3):\n        dist.broadcast(t, 0)\n")
    r = _aggregate(_dump(tmp_path, str(src)))
    assert r.returncode == 0, r.stderr
    assert "x.py:5), which is inside a loop" in r.stdout, r.stdout


def test_a_call_site_naming_a_fifo_does_not_hang_aggregate(tmp_path):
    src = tmp_path / "x.py"
    os.mkfifo(str(src))
    r = _aggregate(_dump(tmp_path, str(src)))  # blocked for ever in open() before: TimeoutExpired
    assert r.returncode == 0, r.stderr
    assert "collective-mismatch" in r.stdout and "if it runs in a loop" in r.stdout, r.stdout


def test_a_call_site_naming_a_link_to_dev_zero_does_not_eat_memory(tmp_path):
    src = tmp_path / "x.py"
    os.symlink("/dev/zero", str(src))
    # read whole before: a MemoryError under the 2 GiB limit (or all the machine's memory without it)
    r = _aggregate(_dump(tmp_path, str(src)))
    assert r.returncode == 0, r.stderr
    assert "collective-mismatch" in r.stdout and "if it runs in a loop" in r.stdout, r.stdout
