"""The block ``hangdoc dump`` writes for a process it could not dump, whatever the dumpers said,
stays one tag line plus one ``Error:`` line that the readers take as a process with that status."""

from hypothesis import given, settings, strategies as st

from hangdoc.collect import ProcessInfo, undumpable_block
from hangdoc.readers import read_text
from hangdoc.tags import parse_tag

# what dumpers print on failure: any text, newlines and odd whitespace included
messages = st.lists(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=120), max_size=3)


@settings(max_examples=80, deadline=None)
@given(reasons=messages, rank=st.one_of(st.none(), st.integers(0, 4095)),
       status=st.sampled_from(["unresponsive", "stopped"]))
def test_undumpable_block_round_trips_through_the_readers(reasons, rank, status):
    env = {} if rank is None else {"RANK": str(rank), "WORLD_SIZE": "4096"}
    info = ProcessInfo(pid=4242, ppid=1, cmdline=["python", "train.py"], environ=env)
    block = undumpable_block(info, reasons, status, host="node1")
    lines = block.splitlines()
    assert len(lines) == 2 and lines[1].startswith("Error: ") and lines[1].strip() != "Error:"
    fields = parse_tag(lines[0])
    assert fields["status"] == status and fields["pid"] == "4242"
    assert fields.get("rank") == (None if rank is None else str(rank))
    assert fields["reason"] and len(fields["reason"]) <= 200
    assert not any(c.isspace() for c in fields["reason"])
    (p,) = read_text(block).processes
    assert (p.host, p.pid, p.rank, p.status) == ("node1", 4242, rank, status)


@settings(max_examples=60, deadline=None)
@given(reason=st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=80),
       rank=st.one_of(st.none(), st.integers(0, 4094)))  # 4095 is the live block's: one rank in two processes reads as two runs
def test_exited_line_is_no_process_and_names_no_other(reason, rank):
    """The line of a process that exited while it was dumped is a process of its own with status
    exited and no stack (never unresponsive), and the block after it keeps its own identity."""
    from hangdoc.collect import exited_block

    env = {} if rank is None else {"RANK": str(rank), "WORLD_SIZE": "4096"}
    gone = exited_block(ProcessInfo(pid=4242, ppid=1, cmdline=["python", "train.py"], environ=env), reason, host="node1")
    assert gone.count("\n") == 1 and parse_tag(gone) is None
    live = undumpable_block(ProcessInfo(pid=77, ppid=1, environ={"RANK": "4095"}), ["py-spy timed out"], host="node2")
    job = read_text(gone + "\n" + live)
    exited, p = job.processes
    assert (exited.host, exited.pid, exited.rank, exited.status, exited.threads) == ("node1", 4242, rank, "exited", [])
    assert (p.host, p.pid, p.rank) == ("node2", 77, 4095)
