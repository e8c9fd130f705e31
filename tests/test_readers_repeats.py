"""A process dumped again and again into one file (``py-spy dump`` or faulthandler's signal handler in
a loop, appending to one log) is one process, its last dump kept and the repeats counted; the fuzz
run's 8 MB of one dump header repeated (160,000 "processes" of one line each) reads as one. Issue 20:
no input over 2 s. Identical dumps that name no process (two ranks' tracebacks) stay apart."""

import os

from hypothesis import given, settings
from hypothesis import strategies as st

from hangdoc.analysis import analyse
from hangdoc.readers import read_paths
from hangdoc.renderers import RenderOptions, render
from tests.procs import ROOT

FIXTURES = os.path.join(ROOT, "tests", "fixtures")
PYSPY = os.path.join(FIXTURES, "dumps", "pythons", "trace-py3.11.out")


def _line(rel, start):
    with open(os.path.join(FIXTURES, rel)) as f:
        return next(x.rstrip("\n") for x in f if x.startswith(start))


#: dump headers of real fixtures, each a dump of its own when repeated
HEADERS = [
    _line("dumps/pythons/trace-py3.11.out", "Process 10169:"),
    _line("bugs/opposite_groups/output/stacks-vm-r0-23028.txt", "Thread 0x00007f325dea06c0"),
    _line("bugs/opposite_groups/output/stacks-vm-r0-23028.txt", "Current thread 0x"),
    _line("bloom/2-nodes/trace-jean-zay-iam48.out", 'Thread 688514 (idle): "MainThread"'),  # a thread is once in a process
    _line("dumps/healthy/gdb/trace-node1.out", "Thread 3 (Thread 0x"),  # gdb's numbering starts again
]
#: a traceback's header: the next one is read as its exception line (a dump of two lines)
TRACEBACK = _line("bugs/opposite_groups/hangdoc.log", "Traceback (most recent call last):")


def _read(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return read_paths([str(p)])


def _notes(job):
    return [e.message for e in job.errors if "repeated the dump" in e.message]


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(HEADERS), st.integers(2, 3000))
def test_a_dump_header_repeated_is_one_process(tmp_path_factory, header, n):
    job = _read(tmp_path_factory.mktemp("rep"), "x.log", "\n".join([header] * n) + "\n")
    assert len(job.processes) == 1, len(job.processes)
    assert job.processes[0].meta["snapshots"] == n
    assert job.processes[0].source_line == n  # the last dump is the one kept
    assert _notes(job) == [f"{n - 1} dump{'s' if n > 2 else ''} repeated the dump right before {'them' if n > 2 else 'it'} "
                           "(the same process, threads and stacks): read as that process dumped again, the last kept"]


def test_8_mb_of_one_traceback_header_is_no_traceback(tmp_path):
    # the header again before any frame is the same header (it was read as the exception line of a
    # traceback of no frames: 120,000 of them)
    n = (8 << 20) // (len(TRACEBACK) + 1)
    job = _read(tmp_path, "x.log", "\n".join([TRACEBACK] * n) + "\n")
    assert job.processes == []
    tb = '  File "/w/train.py", line 9, in <module>\n    main()\nRuntimeError: boom\n'
    job = _read(tmp_path, "y.log", f"{TRACEBACK}\n{TRACEBACK}\n{tb}")
    assert [p.meta["exception"] for p in job.processes] == ["RuntimeError: boom"]


def test_8_mb_of_one_faulthandler_thread_line_is_one_process(tmp_path):
    header = HEADERS[1]
    n = (8 << 20) // (len(header) + 1)
    job = _read(tmp_path, "stacks-vm-r0-23028.txt", "\n".join([header] * n) + "\n")
    assert [(p.host, p.pid, p.rank, p.meta["snapshots"]) for p in job.processes] == [("vm", 23028, 0, n)]
    report = analyse(job)
    for fmt in ("text", "json"):
        render(report, fmt, RenderOptions())


def test_a_whole_py_spy_dump_appended_three_times_is_one_process_dumped_three_times(tmp_path):
    text = open(PYSPY).read()
    once = _read(tmp_path, "a.log", text)
    thrice = _read(tmp_path, "b.log", (text.rstrip("\n") + "\n\n") * 3)
    assert len(once.processes) == len(thrice.processes) == 1
    p, q = once.processes[0], thrice.processes[0]
    assert (q.pid, q.command, [(t.ident, t.frames) for t in q.threads]) == (p.pid, p.command, [(t.ident, t.frames) for t in p.threads])
    assert q.meta["snapshots"] == 3 and "snapshots" not in p.meta
    assert _notes(thrice) and not _notes(once)


def test_two_ranks_identical_tracebacks_stay_two_processes(tmp_path):
    tb = ('Traceback (most recent call last):\n  File "/w/train.py", line 9, in <module>\n    main()\n'
          'RuntimeError: boom\n')
    job = _read(tmp_path, "x.log", tb + tb)
    assert len(job.processes) == 2 and not _notes(job)


def test_a_tagged_dump_is_not_folded_into_the_one_before(tmp_path):
    # hangdoc's own dumps: a tag line before each; the tag says who each is (two processes here)
    body = "".join(l for l in open(PYSPY) if not l.startswith("Process "))
    text = ("# hangdoc process host=n1 pid=10169 rank=0\nProcess 10169: python t.py\n" + body + "\n"
            "# hangdoc process host=n1 pid=10169 rank=1\nProcess 10169: python t.py\n" + body)
    job = read_paths([str(_write(tmp_path, "x.log", text))])
    assert not _notes(job)


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_one_log_line_repeated_is_one_event_of_the_file(tmp_path):
    from hangdoc.readers import crash_log
    from hangdoc.readers._base import FileContext, Interner
    from hangdoc.model import Source

    line = _line("logs/launch/pytorch-pytorch-72086.log", "Fatal Python error: Segmentation fault")
    r = crash_log.Reader(FileContext("x.log", Source("x.log"), Interner()))
    for i in range(3):
        r.feed(i + 1, line, (None, None, None))
    assert len(r.events) == 1 and r.emitted == 3  # one event, the lines still counted
    job = _read(tmp_path, "x.log", "\n".join([line] * 5000) + "\n")
    assert [(e.kind, e.fields["exc"], e.line) for e in job.events] == [("exception", "Fatal Python error: Segmentation fault", 1)]


def test_a_log_line_repeated_in_a_row_is_shown_to_the_readers_max_run_times(tmp_path, monkeypatch):
    # 8 MB of one "Failures:" line (torchrun's failure table) went to its reader 840,000 times, 3 s
    from hangdoc.readers import elastic_log, stream

    calls = []
    feed = elastic_log.Reader.feed
    monkeypatch.setattr(elastic_log.Reader, "feed", lambda self, *a: (calls.append(1), feed(self, *a))[1])
    line = _line("bugs/dead_rank/hangdoc.log", "Failures:")
    job = _read(tmp_path, "x.log", "\n".join([line] * 10_000) + "\n")
    assert len(calls) == stream.MAX_RUN and job.processes == []
    # a stack's frame lines repeated (a recursion) are all read: the parsers see every line
    frame = '    f (/w/rec.py:3)'
    text = 'Process 7: python rec.py\n\nThread 7 (active): "MainThread"\n' + "\n".join([frame] * 500) + "\n"
    job = _read(tmp_path, "y.log", "".join(f"[rank0]: {x}\n" for x in text.splitlines()))
    assert len(job.processes[0].main_thread.frames) == 500
