"""Bundled hang scenarios for ``hangdoc demo``: small torch.distributed programs that hang on
purpose, on CPU with gloo, each the way real jobs hang.

Each scenario is a module here, runnable as a script under torchrun::

    python -m torch.distributed.run --nproc-per-node 4 -m hangdoc --hang-timeout 5 \\
        "$(python -c 'import hangdoc.examples as e; print(e.path("skip_broadcast"))')"

    >>> sorted(SCENARIOS)
    ['dataloader', 'pipeline', 'skip_broadcast']
    >>> path("skip_broadcast").endswith("skip_broadcast.py")
    True
    >>> import tempfile
    >>> os.path.basename(copy_to("pipeline", tempfile.mkdtemp()))
    'pipeline.py'
"""

from __future__ import annotations

import os
import shutil
from typing import Dict, NamedTuple


class Scenario(NamedTuple):
    name: str
    #: what goes wrong, one line
    summary: str
    #: ranks it needs (at least 2)
    nproc: int
    #: the rank hangdoc should name
    culprit: int
    #: the finding kind hangdoc should report first
    kind: str


SCENARIOS: Dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("skip_broadcast", "the last rank skips a broadcast and goes on to the next all_reduce", 4, 3, "collective-mismatch"),
        Scenario("dataloader", "a DataLoader worker of rank 1 never returns a batch; the others wait in all_reduce", 3, 1, "dataloader-stall"),
        Scenario("pipeline", "every pipeline stage receives from the previous one before sending: a p2p cycle", 3, 0, "p2p-cycle"),
    )
}


def path(name: str) -> str:
    """The file of scenario ``name`` (a script torchrun can run)."""
    if name not in SCENARIOS:
        raise KeyError(f"unknown scenario {name!r}; one of {', '.join(sorted(SCENARIOS))}")
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), name + ".py")


def copy_to(name: str, directory: str) -> str:
    """Copy scenario ``name`` (and its helper module) into ``directory``; returns the script path.

    Run from there, the scenario is user code like any training script: hangdoc leaves its own
    package's frames out of call sites, and would leave the scenario's out with them.
    """
    src = path(name)
    os.makedirs(directory, exist_ok=True)
    for f in (src, os.path.join(os.path.dirname(src), "_common.py")):
        shutil.copyfile(f, os.path.join(directory, os.path.basename(f)))
    return os.path.join(directory, os.path.basename(src))
