"""What the GPUs really do in ``examples/bugs/pp_skip_pair.py`` under NCCL, without hangdoc: a CUDA
event after every call, queried 6 s after the last one (tests/fixtures/detect/gpu-queue/README.md).

    torchrun --nproc-per-node 2 examples/detect/peek/pp_events.py
"""

import os
import time

import torch
import torch.distributed as dist


def main():
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    torch.set_default_device(f"cuda:{local}")
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    events = []

    def mark(name):
        e = torch.cuda.Event()
        e.record()
        events.append((name, e))

    for step in range(8):
        if rank == 0:
            act = torch.ones(16) * step
            dist.send(act, dst=1)
            mark(f"send{step}")
            grad = torch.empty(16)
            dist.recv(grad, src=1)
            mark(f"recv{step}")
        else:
            act = torch.empty(16)
            dist.recv(act, src=0)
            mark(f"recv{step}")
            grad = act * 0.5
            dist.send(grad, dst=0)
            mark(f"send{step}")
        norm = grad.norm().reshape(1) + 100 * step
        if not (rank == 1 and step == 3):  # the scenario's skip
            dist.all_reduce(norm)
            mark(f"AR{step}")
    time.sleep(6)
    print(f"rank {rank}: " + " ".join(f"{n}={'done' if e.query() else 'wait'}" for n, e in events), flush=True)
    os._exit(0)  # the GPUs are hung: no teardown


if __name__ == "__main__":
    main()
