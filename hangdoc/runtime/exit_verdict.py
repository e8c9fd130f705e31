"""A verdict when a job fails before any stall: rank 0 reads what the dying ranks left.

The watchdog's verdict comes after ``hang_timeout`` seconds with no progress. A job whose rank dies
in its first second never gets there: gloo aborts a rank on a dtype or size mismatch
(``terminate called after throwing gloo::EnforceNotMet``), the OOM killer or a user SIGKILLs one,
the others raise (``Connection closed by peer``) and the launcher sends SIGTERM to whatever is
left. The log then held tracebacks and torchrun's failure table, and no word from hangdoc.

Rank 0 (or, where rank 0 died with no dump, the lowest rank of its node whose lower ranks all did),
on its way out (it raised, or its launcher's SIGTERM came), now

1. looks at once which ranks of its node are gone already (torchrun numbers a node's ranks
   ``RANK - LOCAL_RANK`` on; a rank absent from its siblings in ``/proc``, or a zombie, died
   before the teardown: killed, or aborted in native code, with no chance to dump);
2. waits, :data:`WAIT` seconds at most, for the others' exit dumps in the output directory (the
   raising ranks' tracebacks and records, the SIGTERM'd ranks' records);
3. reads them as the stall report does, writes ``report.txt``/``report.json`` and prints the
   verdict: ``hangdoc: DUMP: the job is failing (...) before any stall; ...``.

Only when the job is failing: rank 0 raised, another rank raised (its dump says so), or a rank of
this node died before the teardown. A job stopped whole (``scancel``, Ctrl-C, a time limit) gets
no verdict. Never when a stall was reported already (that verdict stands). SIGTERM's end waits for
it (:func:`hangdoc.runtime.on_term.holding`, bounded): launchers give 30 s before SIGKILL.
"""

from __future__ import annotations

import os
import re
import threading
import time
from typing import Any, Dict, List, Optional

#: seconds rank 0 waits at most for the other ranks' exit dumps
WAIT = 3.0
#: seconds without a new or growing file after which the dumps are taken as complete
SETTLE = 0.6
#: seconds a rank waits at most to learn whether the ranks below it died (then it reports)
REPORTER_WAIT = 5.0
#: files older than the watchdog's start by more than this are an earlier run's
SLACK = 10.0

_claimed = threading.Lock()
#: a rank's exit dump, records, "gone" line, or the stack of its native abort (hangdoc.runtime.fatal)
_RANK_FILE = re.compile(r"^(?:stacks|collectives|fatal)-.*-r(\d{1,9})-(?:\d{1,12}|gone)\.(?:txt|jsonl)$")


def gone_ranks(ident: Any, environ: Optional[Dict[str, str]] = None) -> List[int]:
    """The ranks of this node whose process has ended already (or is a zombie), under torchrun
    only (its agent is the parent of every rank of the node, and numbers them contiguously)."""
    env = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" not in env or not os.path.isdir("/proc"):
        return []
    base = ident.rank - ident.local_rank
    expected = set(range(base, base + ident.local_world_size)) - {ident.rank}
    if base < 0 or not expected or ident.local_world_size > (1 << 16):
        return []
    from hangdoc.collect import describe
    from hangdoc.proctree import parent_map

    alive = set()
    for pid in sorted(parent_map().get(os.getppid(), []))[:4096]:
        if pid == os.getpid():
            continue
        info = describe(pid)
        if info is None or info.uid != os.getuid():
            continue
        rank = info.environ.get("RANK", "")
        if not (rank.isdigit() and len(rank) <= 9):
            continue
        if info.state not in ("Z", "X"):
            alive.add(int(rank))
    return sorted(expected - alive)


def _fresh(out_dir: str, since: float) -> Dict[int, List[str]]:
    from hangdoc.runtime.exchange import fresh_rank_files

    return fresh_rank_files(out_dir, since, _RANK_FILE)


def _sizes(files: Dict[int, List[str]]) -> Dict[str, int]:
    out = {}
    for paths in files.values():
        for p in paths:
            try:
                out[p] = os.path.getsize(p)
            except OSError:
                pass
    return out


def _wait_for_dumps(out_dir: str, since: float, want: set) -> Dict[int, List[str]]:
    """The fresh dump files by rank, once every wanted rank has one or nothing changed for
    :data:`SETTLE` seconds (at most :data:`WAIT` seconds)."""
    start = last_change = time.monotonic()
    files = _fresh(out_dir, since)
    sizes = _sizes(files)
    while time.monotonic() - start < WAIT:
        if want <= set(files):
            break
        if time.monotonic() - last_change >= SETTLE:
            break
        time.sleep(0.1)
        files = _fresh(out_dir, since)
        now = _sizes(files)
        if now != sizes:
            sizes, last_change = now, time.monotonic()
    return files


def _is_fatal(path: str) -> bool:
    """A rank's fatal-signal stack (hangdoc.runtime.fatal), not a dump it wrote itself."""
    from hangdoc.runtime.fatal import PREFIX

    return os.path.basename(path).startswith(PREFIX)


def _raised(paths: List[str]) -> bool:
    """Whether a rank's stacks file says its main function raised (the tag line's reason), or the
    rank died of a fatal signal (its fatal file holds a stack)."""
    for p in paths:
        if _is_fatal(p):
            return True
        if not os.path.basename(p).startswith("stacks-"):
            continue
        try:
            with open(p, "rb") as f:
                head = f.read(4096)
        except OSError:
            continue
        if b" reason=raised_" in head.split(b"\n", 1)[0]:
            return True
    return False


def _gone_block(host: str, rank: int, world: int) -> str:
    from hangdoc.tags import DIED_IN_JOB, format_exited

    return format_exited(host=host, rank=rank, world_size=world, reason=DIED_IN_JOB) + "\n"


def at_exit(dog: Any, why: str, raised: bool = False) -> bool:
    """Rank 0's verdict of a failing job (see the module); True when one was printed. Once per
    process; never raises."""
    if dog is None or not getattr(dog, "report", False) or dog.stalls or dog.reported is not None:
        return False
    if not _claimed.acquire(blocking=False):
        return False
    try:
        from hangdoc.runtime.identity import identity

        ident = identity()
        if ident.world_size < 2:
            return False
        since = getattr(dog, "started_wall", time.time()) - SLACK
        gone = _reporter(ident, dog.out_dir, since)  # now, before the teardown ends the others too
        if gone is None:
            return False
        return _run(dog, ident, why, raised, gone)
    except Exception as e:
        try:
            from hangdoc.runtime.exchange import say

            say(f"hangdoc watchdog: no verdict at exit: {type(e).__name__}: {e}")
        except Exception:
            pass
        return False


def _reporter(ident: Any, out_dir: str, since: float) -> Optional[List[int]]:
    """The ranks of this node gone already, when this rank reports; None when another one does.

    Rank 0 reports; when rank 0 died with no dump (a native abort), the lowest rank of its node
    whose lower ranks all did. A rank that dies takes a moment to be gone (an abort on a loaded
    machine): a lower rank neither gone nor dumped is waited for, :data:`REPORTER_WAIT` s at most."""
    deadline = time.monotonic() + REPORTER_WAIT
    while True:
        gone = gone_ranks(ident)
        if ident.rank == 0:
            return gone
        if ident.rank - ident.local_rank != 0:
            return None  # rank 0 is on another node: it reports
        files = _fresh(out_dir, since)
        lower = range(ident.rank)
        if any(not _is_fatal(p) for r in lower for p in files.get(r, ())):
            return None  # a lower rank dumped (not its native abort's stack): it lives and reports, or one below it does
        # a rank whose only file is its fatal-signal stack died of that signal: dying or gone, it never reports
        dying = {r for r in lower if files.get(r) and all(_is_fatal(p) for p in files[r])}
        if all(r in gone or r in dying for r in lower):
            return sorted(set(gone) | dying)
        if time.monotonic() >= deadline:
            return None  # a lower rank lives on: it reports when the launcher stops it
        time.sleep(0.1)


def _run(dog: Any, ident: Any, why: str, raised: bool, gone: List[int]) -> bool:
    from hangdoc.runtime import exchange, on_term
    from hangdoc.runtime.dump_files import write_file as _write_file

    world = ident.world_size
    if getattr(dog, "_recorder", None) is None:
        # only with the recorder, whose exit dump every rank leaves unless it is killed, is a rank
        # gone without one known not to have ended by itself
        gone = []
    with on_term.holding():
        if not raised:
            dog.dump_now(why)
        since = getattr(dog, "started_wall", time.time()) - SLACK
        files = _wait_for_dumps(dog.out_dir, since, set(range(min(world, 1 << 16))) - set(gone))
        # gone with no dump: a rank the teardown ended (SIGTERM) dumped on its way out
        gone = [r for r in gone if r not in files]
        failing = raised or bool(gone) or any(_raised(ps) for r, ps in files.items() if r != ident.rank)
        if not failing:
            return False  # the whole job is being stopped (scancel, Ctrl-C, a time limit)
        entries: Dict[int, Dict[str, Any]] = {r: {"rank": r, "paths": ps} for r, ps in files.items()}
        for r in gone:
            path = os.path.join(dog.out_dir, f"stacks-{ident.host}-r{r}-gone.txt")
            try:
                _write_file(dog.out_dir, path, _gone_block(ident.host, r, world))
                entries[r] = {"rank": r, "paths": [path]}
            except OSError:
                pass
        exchange._report(dog, ident, entries, world, reason=f"the job is failing (rank {ident.rank}: {why}) before any stall",
                         stall=False, dumped=sorted(files))
    return True
