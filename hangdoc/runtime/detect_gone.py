"""A member the others wait for whose process is dead or stopped, seen from a rank on its node.

Every publication carries its process's ``host`` and ``pid``, and the last one a rank writes on its
way out through Python (a normal exit, an exception, its launcher's SIGTERM) says ``end``. A quiet
rank waiting in call #n of a group reads a few members; one that has not issued that call and runs
on the same host is looked up in ``/proc``:

* gone (or a zombie) with no ``end`` in its last publication: it was killed (SIGKILL, the OOM
  killer) or aborted in native code: ``rank-failed``; where its Python stack as it died is in the
  output directory (:mod:`hangdoc.runtime.detect_fatal`) and shows it inside a torch.distributed
  call, the backend ended it on a mismatched call: ``collective-mismatch`` of that call;
* stopped (``T``: SIGSTOP, a debugger, a suspended job step): ``unresponsive-process``;
* ending or gone after its last publication said it ended cleanly (``end`` = ``exit``: its script finished,
  ``destroy_process_group`` and all, having issued fewer calls there than this rank waits in): its
  loop ran fewer steps (uneven data, an early ``break``), a ``collective-mismatch``, said only when no
  member was found dead or stopped (a rank that left because another died is no culprit).

A member that never published (a rank stopped within its first second) is found among this
process's siblings, the launcher's other children, by the ``RANK`` in their environment
(:mod:`hangdoc.runtime.siblings` does the same for the stall report). Ranks on other hosts are not
looked up (their pids mean nothing here); a rank of theirs on the dead rank's host does it. A pid
the kernel gave to another process since reads as alive: nothing is said, never a wrong rank.

    >>> import os
    >>> pub = lambda n, **kw: {"quiet": True, "last": "default_pg", "g": {"default_pg": {"n": n}}, **kw}
    >>> me = pub(5, host="h", pid=os.getpid())
    >>> dead = pub(4, host="h", pid=2 ** 22 + 12345, quiet=False)   # no such pid
    >>> v = gone_member(0, me, {0: me, 1: dead}.get, lambda g: (0, 1), "h", lambda pid: None)
    >>> v.kind, v.deviants
    ('rank-failed', [1])
    >>> v = gone_member(0, me, {0: me}.get, lambda g: (0, 1), "h", lambda pid: "T", siblings=lambda: {1: 4242})
    >>> v.kind, v.deviants   # it never published: found among this process's siblings
    ('unresponsive-process', [1])
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

from hangdoc.runtime.detect_digest import Verdict, entry_at, partners
from hangdoc.runtime.detect_groups import count as _count
from hangdoc.runtime.detect_groups import hypercube


def proc_state(pid: int) -> Optional[str]:
    """The process's state letter (``R``, ``S``, ``T``, ``Z``, ...; :func:`hangdoc.proctree.stat`);
    None when there is no such process."""
    from hangdoc.proctree import stat

    try:
        return stat(int(pid))[0]
    except (OSError, ValueError):
        return None


def sibling_pids() -> Dict[int, int]:
    """rank -> pid of this process's siblings that carry a ``RANK`` (:func:`hangdoc.runtime.siblings.by_rank`)."""
    from hangdoc.runtime.siblings import by_rank

    return {rank: pid for rank, (pid, _info) in by_rank().items()}


def _odd_side(dead: int, me: int, index: int, group: str, read: Sequence[int],
              pub_of: Callable[[int], Optional[Dict[str, Any]]]) -> Optional[tuple]:
    """(ranks, their call, the others' call) of the smaller side at call ``index`` of ``group``,
    among the publications that show that call (the dead member published it as it issued it when
    its signature was new); None without two sides, or with two as large."""
    sides: Dict[tuple, List[int]] = {}
    entries: Dict[tuple, list] = {}
    for r in sorted(set(list(read) + [me, dead])):
        e = entry_at(((pub_of(r) or {}).get("g") or {}).get(group) or {}, index)
        if e:
            sides.setdefault((e[0], e[2]), []).append(r)
            entries[(e[0], e[2])] = e
    if len(sides) != 2:
        return None
    (a, ra), (b, rb) = sorted(sides.items(), key=lambda kv: len(kv[1]))
    if len(ra) == len(rb):
        return None
    return ra, entries[a], entries[b]


def _survivors_agree(dead: int, me: int, index: int, group: str, read: Sequence[int],
                     pub_of: Callable[[int], Optional[Dict[str, Any]]]) -> bool:
    """Two or more members other than ``dead`` show call ``index`` of ``group``, all the same call."""
    calls = []
    for r in sorted(set(list(read) + [me]) - {dead}):
        e = entry_at(((pub_of(r) or {}).get("g") or {}).get(group) or {}, index)
        if e:
            calls.append((e[0], e[2]))
    return len(calls) >= 2 and len(set(calls)) == 1


def gone_member(me: int, mine: Dict[str, Any], pub_of: Callable[[int], Optional[Dict[str, Any]]],
                ranks_of: Callable[[str], Sequence[int]], host: str,
                state_of: Callable[[int], Optional[str]] = proc_state, final: bool = False,
                siblings: Callable[[], Dict[int, int]] = sibling_pids,
                fatal_of: Optional[Callable[[int, int], Optional[Dict[str, Any]]]] = None) -> Optional[Verdict]:
    """The dead or stopped member of this quiet rank's group that has not issued the call this rank
    waits in (see the module), as a verdict; None if there is none on this host."""
    from hangdoc.ranges import describe_ranks

    group = mine.get("last")
    if not mine.get("quiet") or not isinstance(group, str):
        return None
    n = _count(mine, group)
    members = list(ranks_of(group))
    if not n or me not in members:
        return None
    read = hypercube(me, members)
    if final:
        read += [r for r in partners(me, members, extra=8) if r not in read]
    found: Optional[Dict[int, int]] = None
    ended: Optional[Verdict] = None
    for q in read:
        pq = pub_of(q)
        if pq is not None and _count(pq, group) >= n:
            continue
        if pq is not None and type(pq.get("pid")) is int:
            if pq.get("host") != host:
                continue
            pid, said_end = pq["pid"], pq.get("end") or False
        else:  # it never published: a sibling of this process, if on this host
            if found is None:
                found = siblings()
            if q not in found:
                continue
            pid, said_end = found[q], True  # (not found dead: only a live sibling is found at all)
        state = state_of(pid)
        call = entry_at((mine.get("g") or {}).get(group) or {}, n - 1)
        waits = f"{call[1]} at {call[2]}" if call else f"collective #{n - 1}"
        died = fatal_of(q, pid) if fatal_of is not None and state in (None, "Z", "X") and not said_end else None
        if died is not None:  # its Python stack as it died (hangdoc.runtime.detect_fatal)
            v = Verdict(group, n - 1, True, [q], [me], None, call, "process")
            at = f" at {died['site']}" if died.get("site") else ""
            if died.get("op"):
                odd = _odd_side(q, me, n - 1, group, read, pub_of)
                if odd is None and call and died.get("site") == call[2] and not _survivors_agree(q, me, n - 1, group, read, pub_of):
                    # it died in the very call this rank waits in (a dtype or size that differs): the
                    # side that aborts need not be the side that is wrong, and the survivors' calls
                    # there do not yet show one side of two or more: not this member's verdict
                    continue
                v.text = (f"{describe_ranks([q])} died in native code (Fatal Python error: {died['signal']}) inside "
                          f"{died['op']}{at}, while rank {me} waits in {waits} (#{n - 1} of {group}): the backend "
                          f"ended it on a call that does not match its peers' (sizes, split sizes, dtypes)")
                if odd is not None:  # the publications say whose call it was that did not match
                    ranks, theirs, others = odd
                    v.deviants, v.agreeing = ranks, sorted(set(read + [me, q]) - set(ranks))
                    v.text += (f"; {describe_ranks(ranks)} issued {theirs[1]} at {theirs[2]} there where the others "
                               f"issued {others[1]} at {others[2]}")
            else:
                v.kind = "rank-failed"
                v.text = (f"{describe_ranks([q])} has not issued {waits} (#{n - 1} of {group}) that rank {me} waits "
                          f"in: it died in native code (Fatal Python error: {died['signal']}){at}")
            return v
        if state in (None, "Z", "X") and not said_end:
            kind, what = "rank-failed", (f"its process (pid {pid} on {host}) is gone without a word: killed "
                                         f"(SIGKILL, the OOM killer) or aborted in native code")
        elif state in ("T", "t"):
            kind, what = "unresponsive-process", (f"its process (pid {pid} on {host}) is stopped (SIGSTOP, a "
                                                  f"debugger, a suspended job step)")
        elif said_end == "exit" and ended is None and pq is not None:  # (gone, or on its way out)
            issued = _count(pq, group)
            ended = Verdict(group, n - 1, True, [q], [me], None, call, "process")
            ended.text = (f"{describe_ranks([q])} has not issued {waits} (#{n - 1} of {group}) that rank {me} waits "
                          f"in: it ended cleanly (pid {pid} on {host}: its script finished after {issued} calls "
                          f"there): its loop ran fewer steps than this rank's (uneven data, an early break or "
                          f"return)")
            continue
        else:
            continue
        v = Verdict(group, n - 1, True, [q], [me], None, call, "process")
        v.kind = kind
        v.text = (f"{describe_ranks([q])} has not issued {waits} (#{n - 1} of {group}) that rank {me} waits in: "
                  f"{what}")
        return v
    return ended
