"""Set-up shared by the bundled scenarios: gloo on CPU and a progress line per step.

``PROGRESS rank=R step=S t=T`` (wall time) after every completed step lets the benchmark measure
the time from the last progress to the verdict.
"""

import os
import sys
import time
from datetime import timedelta


def init():
    """Initialise gloo; returns (rank, world_size). The gloo timeout bounds a forgotten job."""
    import torch.distributed as dist

    timeout = float(os.environ.get("HANGDOC_DEMO_GLOO_TIMEOUT", "300"))
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
    return dist.get_rank(), dist.get_world_size()


def progress(rank, step):
    """One step done: tell hangdoc's watchdog (when it runs) and the log."""
    hangdoc = sys.modules.get("hangdoc")
    if hangdoc is not None:
        hangdoc.step()
    print(f"PROGRESS rank={rank} step={step} t={time.time():.3f}", flush=True)
