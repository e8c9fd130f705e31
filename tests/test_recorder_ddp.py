"""DDP's gradient all_reduces in the records (hangdoc.runtime.ddp), on real 2-rank gloo jobs.

Two jobs: one runs every well-behaved case in turn (hooked, user hooks, builtin hook, a hook
registered after the first forward, uninstalled, opted out) and compares gradients with DDP's own
path; the other hangs for real (rank 1 skips its backward) and is diagnosed from its records.
"""

from __future__ import annotations

import json
import socket
import sys
import time

from hangdoc.analysis import sequence
from hangdoc.model import Source
from hangdoc.readers import records as records_reader
from tests.procs import kill_group, run

WORKER = r'''
import json, os, sys, threading, time
from datetime import timedelta
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from hangdoc.runtime import recorder, ddp

mode, out = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", timeout=timedelta(seconds=10))
rank = dist.get_rank()
rec = recorder.enable()
assert ddp.install()

def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

def buckets(d):  # numel of each gradient bucket the reducer will all_reduce in this step
    return sorted(b.buffer().numel() for b in d.reducer._get_zeros_like_grad_buckets())

def train(d, steps, skip=None):
    opt = torch.optim.SGD(d.parameters(), lr=0.1)
    grads, per_step = [], []
    for step in range(steps):
        torch.manual_seed(100 + 10 * step + rank)  # different data per rank: the average matters
        loss = d(torch.randn(5, 8)).pow(2).sum()
        n0 = len(rec.records())
        expected = buckets(d)
        if skip is not None and skip(step):
            return grads, per_step
        opt.zero_grad()
        loss.backward()  # BACKWARD LINE
        grads.append([p.grad.clone() for p in d.parameters()])
        opt.step()
        per_step.append((n0, expected))
    return grads, per_step

def settle():  # async Works seen completed by the recorder's non-blocking sweep
    dist.barrier()
    for _ in range(100):
        if not [r for r in rec.pending()]:
            return
        time.sleep(0.02)

def recs(a, b=None):
    return [r.to_json() for r in rec.records()[a:b]]

def all_reduces(a):  # DDP's construction (parameter checks, broadcast) is recorded anyway
    return [r for r in recs(a) if r["op"] == "all_reduce"]

result = {"rank": rank}
if mode == "ok":
    a = DDP(model(), bucket_cap_mb=0.0003)
    grads_a, steps_a = train(a, 3)
    result["hooked"] = ddp.hooked(a)
    result["steps"] = [(recs(n0, n0 + len(exp)), exp) for n0, exp in steps_a]
    result["tail"] = recs(steps_a[-1][0] + len(steps_a[-1][1]))

    calls = [0]
    def user_hook(pg, bucket):  # issued on the ProcessGroup itself: never recorded
        calls[0] += 1
        t = bucket.buffer().div_(pg.size())
        return pg.allreduce([t]).get_future().then(lambda f: f.value()[0])
    n = len(rec.records())
    b = DDP(model(), bucket_cap_mb=0.0003)
    b.register_comm_hook(dist.group.WORLD, user_hook)
    grads_b, _ = train(b, 2)
    c = DDP(model(), bucket_cap_mb=0.0003)
    c._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    train(c, 2)
    result["user_hooks"] = {"records": all_reduces(n), "calls": calls[0], "hooked": [ddp.hooked(b), ddp.hooked(c)]}

    late_calls = calls[0]
    d = DDP(model(), bucket_cap_mb=0.0003)
    d(torch.randn(2, 8))  # first forward: hangdoc's hook goes on
    was = ddp.hooked(d)
    d.register_comm_hook(dist.group.WORLD, user_hook)  # torch alone would refuse a second hook
    n = len(rec.records())
    train(d, 2)
    result["late"] = {"was_hooked": was, "hooked": ddp.hooked(d), "calls": calls[0] - late_calls,
                      "records": all_reduces(n)}

    ddp.uninstall()
    n = len(rec.records())
    e = DDP(model(), bucket_cap_mb=0.0003)
    grads_e, _ = train(e, 3)
    result["uninstalled"] = {"records": all_reduces(n), "hooked": ddp.hooked(e), "installed": ddp.installed()}
    result["grad_diff"] = max((x - y).abs().max().item() for ga, ge in zip(grads_a, grads_e) for x, y in zip(ga, ge))
    result["grad_scale"] = max(x.abs().max().item() for ga in grads_a for x in ga)
    result["grad_diff_user"] = max((x - y).abs().max().item() for ga, gb in zip(grads_a, grads_b) for x, y in zip(ga, gb))

    os.environ["HANGDOC_RECORD_DDP"] = "0"
    result["opt_out_install"] = ddp.install()
    n = len(rec.records())
    train(DDP(model(), bucket_cap_mb=0.0003), 2)
    result["opt_out"] = all_reduces(n)

    # The hook on a thread without Python frames (what an autograd engine thread is on CUDA):
    # the record's call site is the DDP forward's line, named after the module.
    import _thread
    from hangdoc.runtime.ddp import _hook, _states
    class Bucket:
        def __init__(self, t): self.t = t
        def buffer(self): return self.t
    t = torch.ones(3)
    n = len(rec.records())
    del os.environ["HANGDOC_RECORD_DDP"]
    assert ddp.install()
    f = DDP(model())
    f(torch.randn(2, 8))  # FORWARD LINE
    _thread.start_new_thread(_hook, (_states[f], Bucket(t)))  # called from C: no caller frame
    for _ in range(500):
        if all_reduces(n):
            break
        time.sleep(0.01)
    settle()
    result["thread"] = all_reduces(n)
    result["thread_value"] = t.tolist()  # all_reduced in place
    result["pending"] = [r.to_json() for r in rec.pending()]
elif mode == "hang":
    a = DDP(model(), bucket_cap_mb=0.0003)
    path = os.path.join(out, f"collectives-r{rank}.jsonl")
    if rank == 0:
        def watch():  # dump while blocked: the watchdog's job, done by hand here
            while True:
                time.sleep(0.1)
                p = rec.pending()
                if p and time.time() - p[0].time_issued > 1.0:
                    rec.dump(path)
                    return
        threading.Thread(target=watch, daemon=True).start()
    train(a, 4, skip=lambda step: rank == 1 and step == 2)
    if rank == 1:
        # a gloo Work reads completed a moment after DDP's future (a watchdog dumps much later)
        for _ in range(100):
            if not rec.pending():
                break
            time.sleep(0.02)
        rec.dump(path)
        time.sleep(60)  # stuck elsewhere; the test kills it
with open(os.path.join(out, f"result-r{rank}.json"), "w") as fh:
    json.dump(result, fh)
settle()
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _line(marker: str) -> int:
    return next(i for i, text in enumerate(WORKER.splitlines(), 1) if marker in text)


def _launch(procs, tmp_path, mode: str):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = _free_port()
    ps = []
    for rank in range(2):
        env = {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "HANGDOC_OUT": str(tmp_path)}
        ps.append(procs.spawn([sys.executable, str(script), mode, str(tmp_path)], env=env))
    return ps


def _wait(ps, until, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if until():
            return True
        if any(p.poll() not in (None, 0) for p in ps):
            break
        time.sleep(0.05)
    return until()


def test_ddp_all_reduces_recorded_and_hooks_respected(procs, tmp_path):
    ps = _launch(procs, tmp_path, "ok")
    try:
        outs = [p.communicate(timeout=90) for p in ps]
    finally:
        for p in ps:
            kill_group(p)
    for p, (out, err) in zip(ps, outs):
        assert p.returncode == 0, err
        assert "hangdoc" not in err, err  # no noise: a user's hook taking precedence is not news
    backward_line = _line("BACKWARD LINE")
    for rank in range(2):
        res = json.loads((tmp_path / f"result-r{rank}.json").read_text())
        assert res["hooked"]
        # every step: one async all_reduce per bucket on the default group, in the backward pass
        assert len(res["steps"]) == 3
        for got, expected in res["steps"]:
            assert [r["op"] for r in got] == ["all_reduce"] * len(expected)
            assert sorted(r["shapes"][0][0] for r in got) == expected
            for r in got:
                assert (r["group"], r["group_ranks"], r["async_op"], r["phase"]) == ("default_pg", [0, 1], True, "backward")
                assert r["call_site"].endswith(f"worker.py:{backward_line}:train"), r["call_site"]
        # the second step's buckets are DDP's rebuilt ones: more than one, so buckets x steps is tested
        assert len(res["steps"][1][1]) >= 2
        assert res["tail"] == []
        assert res["pending"] == []
        # DDP's own path (uninstalled) and hangdoc's hook compute the same gradients
        assert res["grad_scale"] > 1e-3
        assert res["grad_diff"] <= 1e-6
        assert res["grad_diff_user"] <= 1e-6
        # a user's Python or builtin hook is left alone: nothing of hangdoc's in the records
        assert res["user_hooks"]["records"] == []
        assert res["user_hooks"]["calls"] > 0
        assert res["user_hooks"]["hooked"] == [False, False]
        # a hook registered after the first forward replaces hangdoc's instead of failing
        late = res["late"]
        assert late["was_hooked"] and not late["hooked"] and late["calls"] > 0 and late["records"] == []
        assert res["uninstalled"] == {"records": [], "hooked": False, "installed": False}
        assert res["opt_out_install"] is False and res["opt_out"] == []
        # on a thread without Python frames the site is the forward's line, named after the module
        (thread_rec,) = res["thread"]
        assert thread_rec["op"] == "all_reduce" and thread_rec["state"] == "completed"
        assert thread_rec["call_site"].endswith(f"worker.py:{_line('FORWARD LINE')}:DistributedDataParallel(Sequential).backward")
        assert res["thread_value"] == [1.0, 1.0, 1.0]  # ones / 2 summed over 2 ranks


def test_skipped_backward_names_the_rank(procs, tmp_path):
    ps = _launch(procs, tmp_path, "hang")
    dumps = [tmp_path / "collectives-r0.jsonl", tmp_path / "collectives-r1.jsonl"]
    try:
        # generous: two interpreters importing torch and DDP on two busy cores (25 s failed once in .ci/run)
        assert _wait(ps, lambda: all(d.exists() for d in dumps), timeout=90), [p.poll() for p in ps]
        assert all(p.poll() is None for p in ps)  # a real hang: both still running
    finally:
        for p in ps:
            kill_group(p)
    recs = {}
    for rank, path in enumerate(dumps):
        src = Source(str(path))
        recs[rank] = records_reader.read(str(path), src)
        assert not src.errors
    r0 = [r for r in recs[0] if r.op == "all_reduce"]
    r1 = [r for r in recs[1] if r.op == "all_reduce"]
    assert len(r0) > len(r1) > 0
    # rank 0 issued the third step's bucket all_reduces and is blocked in them; rank 1 never did
    pending = [r for r in r0 if r.state == "issued"]
    assert pending and all(r.phase == "backward" for r in pending)
    assert all(r.state == "completed" for r in r1)
    assert {r.seq for r in pending}.isdisjoint(r.seq for r in r1)
    # a hung job: rank 1's records are a prefix of rank 0's, which waits for it: rank 1 is behind
    everything = recs[0] + recs[1]
    assert sequence.divergences(everything, hung=True) == []
    assert [(lag.ranks, lag.waiting) for lag in sequence.lags(everything)] == [([1], [0])]
    res = run([sys.executable, "-m", "hangdoc", "aggregate", "--format", "json", *map(str, dumps)], timeout=30)
    assert res.returncode == 0, res.stderr
    findings = json.loads(res.stdout)["findings"]
    # records alone blame nobody for being behind, but name who is behind and where rank 0 waits
    head = findings[0]
    assert head["kind"] == "collective-wait", head
    assert "for rank 1, which is behind" in head["summary"], head["summary"]
    assert f"worker.py:{_line('BACKWARD LINE')}" in head["summary"], head["summary"]
    assert 0 not in [c["rank"] for c in head["culprits"]]


def test_install_is_idempotent_and_uninstall_restores(monkeypatch):
    import doctest

    from torch.nn.parallel import DistributedDataParallel as DDP

    from hangdoc.runtime import ddp

    monkeypatch.delenv("HANGDOC_RECORD_DDP", raising=False)
    original = DDP.__dict__["forward"]
    try:
        assert ddp.install() and ddp.install()
        assert DDP.__dict__["forward"].__hangdoc_original__ is original
        ddp.uninstall()
        ddp.uninstall()
        assert DDP.__dict__["forward"] is original and not ddp.installed()
        monkeypatch.setenv("HANGDOC_RECORD_DDP", "0")
        assert ddp.install() is False and DDP.__dict__["forward"] is original
        monkeypatch.delenv("HANGDOC_RECORD_DDP")
        result = doctest.testmod(ddp)
        assert result.failed == 0 and result.attempted > 0
    finally:
        ddp.uninstall()


def test_gpu_instances_are_opt_in(monkeypatch):
    # On GPUs a Python comm hook costs ~90-150 us per bucket (docs/recorder.md): opt-in there.
    from hangdoc.runtime import ddp as hd

    class FakeDDP:
        device_type = "cuda"
        _comm_hooks = []

    monkeypatch.delenv("HANGDOC_RECORD_DDP", raising=False)
    assert hd._skip(FakeDDP()) == "GPU parameters without HANGDOC_RECORD_DDP=1"
    monkeypatch.setenv("HANGDOC_RECORD_DDP", "1")
    assert hd._skip(FakeDDP()) != "GPU parameters without HANGDOC_RECORD_DDP=1"
    FakeDDP.device_type = "cpu"
    monkeypatch.delenv("HANGDOC_RECORD_DDP")
    assert hd._skip(FakeDDP()) != "GPU parameters without HANGDOC_RECORD_DDP=1"
