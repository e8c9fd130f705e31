"""NCCL: does the recorder see issued vs completed right, without a sync of its own?

Rank 1 sleeps before joining each collective, so rank 0's synchronous NCCL calls return at once
while the GPU work is still waiting for rank 1. Rank 0 reads ``pending()`` right after issuing
(must list the call, state ``issued``) and again after rank 1 joined and the stream drained (must be
empty, state ``completed``). Checked on the default stream, a side stream, and for async_op=True.
Prints one JSON line per check; exits 1 when a check fails.

    HANGDOC_CUDA_COMPLETION=work|event torchrun --nproc-per-node 2 examples/gpu/recorder_fidelity.py
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from hangdoc.runtime import recorder  # noqa: E402

rec = recorder.enable(capacity=1000)
local = int(os.environ.get("LOCAL_RANK", 0))
torch.cuda.set_device(local)
dist.init_process_group("nccl", device_id=torch.device("cuda", local))
rank = dist.get_rank()
x = torch.ones(1 << 20, device="cuda")
dist.all_reduce(x)
torch.cuda.synchronize()
side = torch.cuda.Stream()
ok = True


def check(label, issue):
    global ok
    dist.barrier()
    if rank == 1:
        time.sleep(1.5)  # rank 0's GPU work waits for this rank meanwhile
        w = issue()
        if w is not None:
            w.wait()
        torch.cuda.synchronize()
        dist.barrier()
        return
    t0 = time.perf_counter()
    w = issue()
    issue_s = time.perf_counter() - t0
    before = [(r.op, r.seq, r.stream, r.state) for r in rec.pending()]
    if w is not None:
        w.wait()
    torch.cuda.synchronize()
    dist.barrier()
    time.sleep(0.05)
    after = [(r.op, r.seq, r.stream, r.state) for r in rec.pending()]
    last = rec.records()[-2]  # the barrier's record is the newest
    good = issue_s < 1.0 and len(before) >= 1 and before[-1][0] == "all_reduce" and last.state == "completed" and not [
        p for p in after if p[0] == "all_reduce"]
    ok = ok and good
    print(json.dumps({"check": label, "mode": recorder._CUDA_COMPLETION, "ok": good, "issue_s": round(issue_s, 4),
                      "pending_after_issue": before, "pending_after_sync": after, "state": last.state,
                      "stream": last.stream,
                      "marker": sorted({type(m[0]).__name__ for st in rec._streams.values() for m in st.marks})}), flush=True)


check("default stream", lambda: dist.all_reduce(x))


def on_side():
    with torch.cuda.stream(side):
        dist.all_reduce(x)


check("side stream", on_side)
check("async_op=True", lambda: dist.all_reduce(x, async_op=True))
dist.destroy_process_group()
sys.exit(0 if ok else 1)
