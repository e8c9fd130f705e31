"""Shared set-up of the NCCL hang scenarios: bounded NCCL timeouts, one GPU per rank."""

import datetime
import os

import torch
import torch.distributed as dist


def init():
    """Initialise NCCL with a short timeout (SCENARIO_NCCL_TIMEOUT, default 40 s) so no run is endless."""
    timeout = datetime.timedelta(seconds=float(os.environ.get("SCENARIO_NCCL_TIMEOUT", "40")))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=timeout, device_id=torch.device("cuda", local_rank))
    return dist.get_rank(), dist.get_world_size()


def step_marker():
    """Tell hangdoc's watchdog (when present) that a training step finished."""
    try:
        import hangdoc

        hangdoc.step()
    except Exception:
        pass
