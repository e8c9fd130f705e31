"""`hangdoc aggregate` reads files with the readers' own loop, also when it splits them among processes."""

from __future__ import annotations

import hangdoc.readers as readers
from hangdoc.cli.aggregate import ParallelRead


def test_parallel_read_uses_the_readers_loop(tmp_path, monkeypatch):
    for n in range(4):
        (tmp_path / f"trace-node{n}.out").write_text(
            f'Process {10 + n}: python t.py\n\nThread {10 + n} (idle): "MainThread"\n    main (t.py:{n + 1})\n')
    calls = []
    real = readers.read_files
    monkeypatch.setattr(readers, "read_files", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    job = ParallelRead.start([str(tmp_path)], {"node3:13": 7}, 2).finish()
    # the parent read its share through readers.read_files (a forked helper's call is not seen here)
    assert calls and all(isinstance(f, tuple) for f in calls[0])
    assert sorted((p.host, p.pid, p.rank) for p in job.processes) == [
        ("node0", 10, None), ("node1", 11, None), ("node2", 12, None), ("node3", 13, 7)]
