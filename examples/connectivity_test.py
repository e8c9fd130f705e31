"""All-ranks connectivity test: does every rank reach every other, and how fast?

Run it on the nodes of a job that hangs with every rank in the same collective (hangdoc's
``collective-wait`` finding), with the same launcher and environment as the job:

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST:29500 examples/connectivity_test.py
    srun ... python -m torch.distributed.run ... examples/connectivity_test.py

Every rank prints one line (host, rank, device, bandwidth of a large all_reduce); rank 0 ends with
``OK: N ranks on M hosts`` or names what failed. Each step is bounded by ``--timeout`` seconds, and a
gloo ``monitored_barrier`` names the ranks that did not arrive instead of hanging. Backend: NCCL
when CUDA is available, gloo otherwise (``--backend`` overrides). Exit status 0 on success.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from datetime import timedelta


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default=None, help="nccl or gloo (default: nccl if CUDA is available)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per step before giving up")
    ap.add_argument("--mbytes", type=float, default=None, help="all_reduce size in MB (default 256 on GPU, 4 on CPU)")
    args = ap.parse_args(argv)

    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    backend = args.backend or ("nccl" if cuda else "gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=args.timeout)
    dist.init_process_group(backend, timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    host = socket.gethostname()

    # A gloo group for the checks that must name absent ranks rather than hang.
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
    try:
        dist.monitored_barrier(group=cpu_group, timeout=timeout, wait_all_ranks=True)
    except RuntimeError as e:  # names the ranks that did not arrive
        print(f"[{host}:{rank}] FAILED barrier: {e}", flush=True)
        return 1

    who = [None] * world
    dist.all_gather_object(who, (host, rank, str(device)), group=cpu_group)

    ones = torch.ones(1, device=device)
    dist.all_reduce(ones)
    if int(ones.item()) != world:
        print(f"[{host}:{rank}] FAILED: all_reduce of ones gave {ones.item()}, expected {world}", flush=True)
        return 1

    mbytes = args.mbytes if args.mbytes is not None else (256.0 if device.type == "cuda" else 4.0)
    n = max(1, int(mbytes * 2**20 / 4))
    big = torch.ones(n, device=device)
    dist.all_reduce(big)  # warm-up (communicator set-up)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    dist.all_reduce(big)
    if device.type == "cuda":
        torch.cuda.synchronize()
    took = time.perf_counter() - start
    # ring all_reduce moves 2(n-1)/n of the buffer per rank: the usual "bus bandwidth"
    busbw = (big.numel() * 4 * 2 * (world - 1) / world) / took / 1e9 if world > 1 else float("inf")
    print(f"[{host}:{rank}] device={device} all_reduce {mbytes:g} MB in {took * 1e3:.1f} ms, busbw {busbw:.2f} GB/s", flush=True)

    dist.monitored_barrier(group=cpu_group, timeout=timeout, wait_all_ranks=True)
    if rank == 0:
        hosts = sorted({h for h, _, _ in who})
        print(f"OK: {world} ranks on {len(hosts)} hosts ({', '.join(hosts)})", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
