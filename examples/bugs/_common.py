"""Shared set-up of the bug scenarios: gloo on CPU, faulthandler on SIGUSR1, progress and hang markers.

Every scenario prints ``HANG-POINT rank=R`` (flushed) right before the call where it hangs or dies,
so that ``benchmarks/bug_matrix.py`` knows when to take its dumps, and calls :func:`progress` after
each completed step (hangdoc's watchdog counts it when the job runs under ``-m hangdoc``).
``HANG_TIMEOUT`` (seconds, default 300) is the gloo timeout: a forgotten job ends by itself; the
matrix sets it to 8 for its ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` run, the same threshold it gives
hangdoc's watchdog.

``BUG_BACKEND=nccl`` runs the same scenario on GPUs (one per rank, by ``LOCAL_RANK``): the default
device becomes that GPU, so the scenarios' tensors live there and their collectives go through NCCL
(``benchmarks/bug_matrix.py --backend nccl``). Tensors made in DataLoader workers or side threads
name their device explicitly (a forked worker must not touch CUDA; a thread does not inherit the
default device).
"""

import faulthandler
import os
import signal
import sys
import time
from datetime import timedelta


BACKEND = os.environ.get("BUG_BACKEND", "gloo")


def init():
    """Init the default process group (gloo, or NCCL with ``BUG_BACKEND=nccl``) and return (rank, world_size)."""
    import torch
    import torch.distributed as dist

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    timeout = float(os.environ.get("HANG_TIMEOUT", "300"))
    if BACKEND == "nccl":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        torch.set_default_device(f"cuda:{local}")
    dist.init_process_group(BACKEND, timeout=timedelta(seconds=timeout))
    return dist.get_rank(), dist.get_world_size()


def timeout():
    """The gloo timeout init() used, for the groups a scenario creates itself."""
    return timedelta(seconds=float(os.environ.get("HANG_TIMEOUT", "300")))


def progress(rank, step):
    """One step done: tell hangdoc's watchdog (when it runs) and the log."""
    hangdoc = sys.modules.get("hangdoc")
    if hangdoc is not None and hasattr(hangdoc, "step"):
        hangdoc.step()
    print(f"PROGRESS rank={rank} step={step} t={time.time():.3f}", flush=True)


def hang_point(rank, what=""):
    print(f"HANG-POINT rank={rank} pid={os.getpid()} {what}".rstrip(), flush=True)
    sys.stderr.flush()


def finish():
    import torch.distributed as dist

    dist.destroy_process_group()
    print("DONE", flush=True)
