"""Who this process is in the job: host, rank, local rank, world size, pid.

Read from the launcher's environment (torchrun, SLURM, Open MPI, MPICH/PMI), so it works before
``init_process_group``; once torch.distributed is initialised, its rank and world size win. A plain
single-process run is rank 0 of 1. Never issues a collective and never imports torch itself.

    >>> ident = identity(environ={"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1"})
    >>> (ident.rank, ident.world_size, ident.local_rank)
    (3, 8, 1)
    >>> identity(environ={}).rank
    0
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

# Each launcher's variables, in the order they are believed.
_RANK_VARS: Sequence[str] = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
_LOCAL_RANK_VARS: Sequence[str] = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")
_WORLD_VARS: Sequence[str] = ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
_LOCAL_WORLD_VARS: Sequence[str] = (
    "LOCAL_WORLD_SIZE",
    "SLURM_NTASKS_PER_NODE",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "MPI_LOCALNRANKS",
)


@dataclass(frozen=True)
class Identity:
    host: str
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    pid: int

    @property
    def label(self) -> str:
        """``host:rank``, the default output prefix without brackets."""
        return f"{self.host}:{self.rank}"


def _first_int(environ: Mapping[str, str], names: Sequence[str]) -> Optional[int]:
    for name in names:
        value = environ.get(name)
        if value is None:
            continue
        try:
            # SLURM_NTASKS_PER_NODE can read "4(x2)"; the leading number is what we want.
            return int(value.split("(")[0].split(",")[0])
        except ValueError:
            continue
    return None


def short_hostname() -> str:
    return socket.gethostname().split(".")[0] or "localhost"


def identity(environ: Optional[Mapping[str, str]] = None) -> Identity:
    """The current process's identity; ``environ`` defaults to ``os.environ``."""
    env = os.environ if environ is None else environ
    rank = _first_int(env, _RANK_VARS)
    world = _first_int(env, _WORLD_VARS)
    local_rank = _first_int(env, _LOCAL_RANK_VARS)
    local_world = _first_int(env, _LOCAL_WORLD_VARS)
    if environ is None:
        dist_rank, dist_world = _from_torch()
        if dist_rank is not None:
            rank, world = dist_rank, dist_world
    rank = 0 if rank is None else rank
    world = 1 if world is None else world
    local_rank = rank if local_rank is None and world == (local_world or world) else (local_rank or 0)
    local_world = local_world or world
    return Identity(
        host=env.get("HANGDOC_HOST") or short_hostname(),
        rank=rank,
        local_rank=local_rank,
        world_size=world,
        local_world_size=local_world,
        pid=os.getpid(),
    )


def _from_torch() -> "tuple[Optional[int], Optional[int]]":
    # Only when the user already imported torch: importing it here would cost seconds.
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return None, None
    try:
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:  # an half-initialised or torn-down group must not break the caller
        pass
    return None, None
