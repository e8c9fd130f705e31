"""On a CUDA machine: record NCCL calls on the default and a side stream; print the records.

    torchrun --nproc-per-node 1 examples/records/gpu_streams.py   (or more ranks, one GPU each)

What it checks by eye: ``stream`` is "default" for calls on the default stream and "streamN" under
``torch.cuda.stream(side)``; synchronous NCCL calls stay "issued" until their CUDA event completes
(observed without a sync); async calls complete through Work.is_completed()/wait().
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from hangdoc.runtime import recorder  # noqa: E402

rec = recorder.enable(capacity=1000, out_dir=os.environ.get("HANGDOC_OUT", "hangdoc-out"))
local = int(os.environ.get("LOCAL_RANK", 0))
torch.cuda.set_device(local)
dist.init_process_group("nccl", device_id=torch.device("cuda", local))
x = torch.ones(1 << 20, device="cuda")
dist.all_reduce(x)
side = torch.cuda.Stream()
with torch.cuda.stream(side):
    dist.all_reduce(x)
w = dist.all_reduce(x, async_op=True)
print("pending right after issue:", [(r.op, r.stream, r.state) for r in rec.pending()])
w.wait()
torch.cuda.synchronize()
time.sleep(0.1)
for r in rec.records():
    print(json.dumps({k: r.to_json()[k] for k in ("seq", "op", "stream", "async_op", "state", "call_site")}))
print("progress", rec.progress, "pending", len(rec.pending()))
n = 2000
for label, on in (("off", False), ("on", True)):
    if not on:
        recorder.disable()
    else:
        recorder.enable()
    y = torch.ones(4, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(y)
    torch.cuda.synchronize()
    print(f"nccl all_reduce([4]) recorder {label}: {(time.perf_counter() - t0) / n * 1e6:.2f} µs/call")
recorder.disable()
dist.destroy_process_group()
