"""ZeRO-3/FSDP-like waits: the gradient reduce-scatter runs on a side communication thread; rank 2 skips one.

Each step every rank gathers its parameter shards (``all_gather_into_tensor``, plus a coalesced
pair of ``all_gather_into_tensor`` under ``_coalescing_manager`` as FSDP's unshard does), computes,
and hands the gradient to a communication thread that runs ``reduce_scatter_tensor``; the main
thread keeps computing the next micro-batch (busy) and only then waits for the reduce-scatter's
result. At step 3 rank 2's gradient hook decides its bucket is empty and never queues it. Ranks 0,
1, 3: the comm thread waits in ``reduce_scatter_tensor``, the main thread waits for it. Rank 2 goes
on to the next step's ``all_gather_into_tensor``.

    torchrun --nproc-per-node 4 examples/bugs/zero3_waits.py
"""

import os
import queue
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "collective-mismatch", "culprits": [2], "world": 4,
         "why": "rank 2 skipped the reduce_scatter_tensor of step 3 (issued by the others on their comm thread)"}

SHARD = 64


def comm_thread(jobs, results, world):
    while True:
        grad = jobs.get()
        out = torch.empty(grad.numel() // world, device=grad.device)  # a thread: no default device
        dist.reduce_scatter_tensor(out, grad)
        results.put(out)


def unshard(shard, world):
    full = torch.empty(shard.numel() * world)
    dist.all_gather_into_tensor(full, shard)
    a, b = torch.empty(shard.numel() * world), torch.empty(shard.numel() * world)
    with dist._coalescing_manager():  # FSDP-style coalesced unshard of two more parameters
        dist.all_gather_into_tensor(a, shard)
        dist.all_gather_into_tensor(b, shard)
    return full + a + b


def busy_compute(n=40):
    m = torch.randn(64, 64)
    for _ in range(n):
        m = torch.tanh(m @ m)
    return m


def main():
    rank, world = init()
    jobs, results = queue.Queue(), queue.Queue()
    threading.Thread(target=comm_thread, args=(jobs, results, world), name="comm", daemon=True).start()
    shard = torch.ones(SHARD) * rank
    for step in range(8):
        if step == 3:
            hang_point(rank, "skips reduce_scatter" if rank == 2 else "reduce_scatter on comm thread")
        full = unshard(shard, world)
        grad = full * 0.01
        if not (rank == 2 and step == 3):  # the bug: rank 2's hook thinks the bucket is empty
            jobs.put(grad)
            busy_compute()  # overlap: the next micro-batch
            shard -= results.get()
        progress(rank, step)
    finish()


if __name__ == "__main__":
    main()
