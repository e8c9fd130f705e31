"""batch_isend_irecv once Work.wait is patched (after any async call): its records stay issued
until the Works complete, and are completed once (not at issue and again in wait())."""

import json
import textwrap

from tests.procs import run, torchrun_cmd

SCRIPT = textwrap.dedent('''
    import json, time
    import torch, torch.distributed as dist
    from hangdoc.runtime import recorder as R
    rec = R.enable()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.ones(4)
    dist.all_reduce(t, async_op=True).wait()  # installs the Work.wait hook
    if rank == 1:
        time.sleep(1.5)  # rank 0's receive cannot complete before this rank sends
    peer = 1 - rank
    ops = [dist.P2POp(dist.isend, torch.ones(4), peer), dist.P2POp(dist.irecv, torch.zeros(4), peer)]
    replaced = []
    original = rec._replace
    rec._replace = lambda old, new: (replaced.append(1), original(old, new))[1]
    works = dist.batch_isend_irecv(ops)
    at_issue = [r.state for r in rec.records() if r.op != "all_reduce"]
    for w in works:
        w.wait()
    time.sleep(0.1)
    after = [r.state for r in rec.records() if r.op != "all_reduce"]
    # one write (line and newline together): two ranks' unbuffered prints once ran into one line
    print(json.dumps({"rank": rank, "recv_at_issue": at_issue[-1], "after": after, "replaced": len(replaced)}) + "\\n", end="", flush=True)
    dist.destroy_process_group()
''')


def test_batch_records_complete_once_through_their_works(tmp_path):
    script = tmp_path / "batch.py"
    script.write_text(SCRIPT)
    res = run(torchrun_cmd(2, str(script)), timeout=60)
    assert res.returncode == 0, res.stderr
    out = {d["rank"]: d for d in (json.loads(line) for line in res.stdout.splitlines() if line.startswith("{"))}
    assert out[0]["recv_at_issue"] == "issued"  # rank 1 had not sent yet
    for d in out.values():
        assert d["after"] == ["completed", "completed"]
        assert d["replaced"] == 2  # one completion per record, none repeated
