"""The state of a rank that posted no dump, when it runs on this node: stopped, stuck in the kernel.

A rank stopped by SIGSTOP (a debugger, ``kill -STOP``, a frozen container) cannot dump itself, so
the stall report only knew it as *missing*. The ranks of one node are the children of one launcher
(torchrun's agent): the reporting rank looks among its siblings for the one whose ``RANK`` is the
missing rank and reads its state from ``/proc`` (:func:`hangdoc.collect.describe`). Only the
launcher's children of this user are looked at.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Iterable, List, Optional, Tuple

#: /proc/PID/stat states that explain a rank's silence
STATES = {"T": "stopped (SIGSTOP, or a debugger: state T)", "t": "stopped by a debugger (state t)",
          "D": "in uninterruptible sleep, stuck in the kernel (state D: a hung file system or driver)"}


def unanswered(missing: Iterable[int], host: Optional[str]) -> List[object]:
    """:class:`~hangdoc.model.Process` entries for the missing ranks found among this process's
    siblings in a state that explains their silence."""
    from hangdoc.collect import undumpable_block
    from hangdoc.model import STATUS_STOPPED, STATUS_UNRESPONSIVE, Process

    wanted = set(missing)
    if not wanted or not os.path.isdir("/proc"):
        return []
    found = {}
    for rank, (pid, info) in sorted(by_rank().items()):
        if info.state not in STATES or rank not in wanted:
            continue
        status = STATUS_UNRESPONSIVE if info.state == "D" else STATUS_STOPPED
        why = f"posted no dump; its process is {STATES[info.state]}"
        found[rank] = Process(host=host, pid=pid, rank=rank, ppid=info.ppid, status=status,
                                   status_detail=why,
                                   meta={"block": undumpable_block(info, [why], status, host)})
    return [found[r] for r in sorted(found)]


def by_rank() -> Dict[int, Tuple[int, Any]]:
    """rank -> (pid, :func:`hangdoc.collect.describe` of it) for this process's siblings (the
    launcher's children of this user) that carry a ``RANK`` in their environment; the first such
    process of a rank."""
    from hangdoc.collect import describe
    from hangdoc.proctree import parent_map

    out: Dict[int, Tuple[int, Any]] = {}
    if not os.path.isdir("/proc"):
        return out
    for pid in sorted(parent_map().get(os.getppid(), []))[:4096]:
        info = describe(pid) if pid != os.getpid() else None
        if info is None or info.uid != os.getuid():
            continue
        rank = info.environ.get("RANK", "")
        if rank.isdigit() and len(rank) <= 9:
            out.setdefault(int(rank), (pid, info))
    return out


def write_status(out_dir: str, processes: List[object]) -> None:
    """A stacks file for each such process, the block ``hangdoc dump`` writes for a process it could
    not dump (tag line with its status, one ``Error:`` line), so that ``hangdoc aggregate`` of the
    output directory knows it too. Best effort."""
    from hangdoc.runtime.options import KINDS
    from hangdoc.runtime.dump_files import write_file as _write_file

    for p in processes:
        name = KINDS["stacks"].format(host=p.host, rank=p.rank, local_rank=p.rank, pid=p.pid)
        try:
            _write_file(out_dir, os.path.join(out_dir, name), p.meta["block"])
        except (OSError, KeyError):
            pass
