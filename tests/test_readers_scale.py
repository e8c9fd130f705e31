"""Reading costs per block and per distinct stack, not per process (speed is measured in benchmarks/)."""

from __future__ import annotations

from hangdoc.readers import normalize_rank_map, pyspy, read_text


def _dump(n: int) -> str:
    out = []
    for i in range(n):
        pid = 100 + i
        out.append(f"Process {pid}: python train.py\nPython v3.11.7 (/usr/bin/python3.11)\n\n"
                   f'Thread {pid} (idle): "MainThread"\n'
                   f"    all_reduce (torch/distributed/distributed_c10d.py:3252)\n"
                   f"    main (train.py:{40 + i % 2})\n")
    return "".join(out)


def test_one_parser_per_block_of_back_to_back_processes(monkeypatch):
    made = []
    real = pyspy.PySpyParser.__init__

    def counting(self, *a, **k):
        made.append(1)
        real(self, *a, **k)

    monkeypatch.setattr(pyspy.PySpyParser, "__init__", counting)
    job = read_text(_dump(500), rank_map={str(100 + i): i for i in range(500)})
    assert [p.pid for p in job.processes] == list(range(100, 600))
    assert [p.rank for p in job.processes] == list(range(500))
    assert [p.source_line for p in job.processes] == [1 + 6 * i for i in range(500)]
    assert len({id(p.main_thread.frames) for p in job.processes}) == 2  # interned: two distinct stacks
    assert len(made) == 1


def test_a_normal_rank_map_is_not_copied():
    m = {f"n1:{i}": i for i in range(1000)}
    assert normalize_rank_map(m) is m
    assert normalize_rank_map({"n1:1": "3"}) == {"n1:1": 3}
