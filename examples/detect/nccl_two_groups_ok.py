"""A correct NCCL job for ``--detect`` to stay silent on: two groups used in the same order on every
rank, and a pipeline exchange, while the host often goes quiet with calls still queued on the GPU.

Every step exchanges a tensor between the ranks of each pair (r, r ^ 1: the lower one sends first,
then receives), all_reduces on group A, then on group B, then (every ``PAUSE_EVERY`` steps) keeps the GPU
busy for ``GPU_BUSY_MS`` and sleeps the host for ``HOST_SLEEP_S`` without waiting for the GPU: the
detector sees the rank quiet with calls not yet completed, as in a deadlock, but in one order on
every rank. Some steps also issue an ``async_op=True`` pair (waited for later) and an all_reduce on
a side stream. Exits 0 with ``OK`` when it ran through;
``divergence.json`` must then not exist in the output directory.

    torchrun --nproc-per-node 2 -m hangdoc --detect --out /tmp/ok examples/detect/nccl_two_groups_ok.py
"""

import os
import time

import torch
import torch.distributed as dist

STEPS = int(os.environ.get("STEPS", "60"))
PAUSE_EVERY = int(os.environ.get("PAUSE_EVERY", "10"))
GPU_BUSY_MS = float(os.environ.get("GPU_BUSY_MS", "3000"))
HOST_SLEEP_S = float(os.environ.get("HOST_SLEEP_S", "2.5"))


def main():
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    everyone = list(range(world))
    group_a = dist.new_group(everyone)
    group_b = dist.new_group(everyone)
    a, b = torch.ones(8, device="cuda"), torch.ones(24, device="cuda")
    side = torch.cuda.Stream()
    cycles_per_ms = 1_000_000  # torch.cuda._sleep spins about this many cycles a millisecond
    for step in range(STEPS):
        if step % PAUSE_EVERY == PAUSE_EVERY - 1:
            torch.cuda._sleep(int(GPU_BUSY_MS * cycles_per_ms))  # the GPU is busy: later calls queue
        peer = dist.get_rank() ^ 1
        if peer < world:  # a pipeline's exchange, in the order both sides agree on
            if dist.get_rank() < peer:
                dist.send(a, dst=peer)
                dist.recv(b[:8], src=peer)
            else:
                dist.recv(b[:8], src=peer)
                dist.send(a, dst=peer)
        dist.all_reduce(a, group=group_a)
        dist.all_reduce(b, group=group_b)
        if step % 7 == 3:  # both asynchronous, then waited for
            works = [dist.all_reduce(t, group=g, async_op=True) for t, g in ((a, group_a), (b, group_b))]
            for w in works:
                w.wait()
        if step % 5 == 2:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                dist.all_reduce(a, group=group_a)
            torch.cuda.current_stream().wait_stream(side)
        if step % PAUSE_EVERY == PAUSE_EVERY - 1:
            time.sleep(HOST_SLEEP_S)  # the host quiet while the GPU works through the queue
        a.div_(world)
        b.div_(world)
    torch.cuda.synchronize()
    dist.destroy_process_group()
    print("OK", flush=True)


if __name__ == "__main__":
    main()
