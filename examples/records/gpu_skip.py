"""On 2+ GPUs: rank 1 skips one NCCL all_reduce. With NCCL the host does not block in the
collective, so every stack shows the later sync point; the records (CUDA-event completion) and the
Flight Recorder dump show the all_reduce enqueued but never completed on the other ranks.

    TORCH_FR_BUFFER_SIZE=2000 TORCH_NCCL_TRACE_BUFFER_SIZE=2000 HANGDOC_OUT=/tmp/gpu torchrun --nproc-per-node 2 examples/records/gpu_skip.py

Each rank writes its records and its Flight Recorder dump (``fr_trace_rank_<rank>``) after 5 s,
then exits without tearing NCCL down (the hung communicator would block that).
"""
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from hangdoc.runtime import recorder  # noqa: E402

out = os.environ.get("HANGDOC_OUT", "hangdoc-out")
rec = recorder.enable(capacity=1000, out_dir=out)
local = int(os.environ.get("LOCAL_RANK", 0))
torch.cuda.set_device(local)
dist.init_process_group("nccl", device_id=torch.device("cuda", local))
rank = dist.get_rank()


def dump_and_exit():
    time.sleep(5)
    os.makedirs(out, exist_ok=True)
    try:
        import torch._C._distributed_c10d as c

        with open(os.path.join(out, f"fr_trace_rank_{rank}"), "wb") as f:
            f.write(c._dump_fr_trace())
    except Exception as e:
        print(f"rank {rank}: no Flight Recorder dump: {e}", flush=True)
    rec.dump()
    print(f"rank {rank} pending:", [(r.op, r.seq, r.stream, r.state) for r in rec.pending()], flush=True)
    time.sleep(3)  # let the other ranks write theirs before anyone exits
    os._exit(0)


threading.Thread(target=dump_and_exit, daemon=True).start()
x = torch.ones(1024, device="cuda")
for step in range(4):
    if not (rank == 1 and step == 2):  # the bug
        dist.all_reduce(x)
side = torch.cuda.Stream()
with torch.cuda.stream(side):
    y = torch.ones(8, device="cuda")
    dist.broadcast(y, src=0)
print(f"rank {rank} waits in .item()", flush=True)
x.sum().item()  # where every stack will be
