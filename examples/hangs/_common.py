"""Shared set-up of the example hangs: gloo on CPU, faulthandler on SIGUSR1, a ready marker.

Each scenario prints ``HANG-POINT rank=R`` (flushed) right before the call that hangs, so that
``examples/capture_dumps.py`` knows when to take its dumps. ``HANG_TIMEOUT`` (seconds, default 600)
bounds the gloo timeout so that a forgotten job ends by itself; set it low (``HANG_TIMEOUT=8``) to
make the hang end in a Python traceback instead.
"""

import faulthandler
import os
import signal
import sys
from datetime import timedelta


def init():
    """Init the default process group (gloo) and return (rank, world_size)."""
    import torch.distributed as dist

    # faulthandler writes every thread's Python stack to stderr on SIGUSR1, without stopping the run.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    timeout = float(os.environ.get("HANG_TIMEOUT", "600"))
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
    return dist.get_rank(), dist.get_world_size()


def hang_point(rank, what=""):
    print(f"HANG-POINT rank={rank} pid={os.getpid()} {what}".rstrip(), flush=True)
    sys.stderr.flush()
