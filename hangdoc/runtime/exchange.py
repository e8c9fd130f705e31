"""Sharing stall dumps between ranks through the job's own torch.distributed store.

When a rank's watchdog fires, it puts its stacks and records into the store the job already has
(torchrun's TCPStore: it is served by the launcher, so it answers while NCCL is wedged) under
``hangdoc/dump/{rank}``. Rank 0 writes the report; when it has posted nothing within 2 s (it is
not stalled, or its Python is wedged), one other stalled rank takes over (the first to claim
``hangdoc/reporter`` with a ``compare_set``; ranks watch only rank 0's key, so the store sees one
operation per rank and poll whatever the world size). The reporting rank collects the others'
entries for a bounded time, writes them as files into its output directory, runs the aggregator on
them and prints the verdict to stderr with the ``[host:rank]`` prefix, so the verdict lands in the
job's log even without a shared filesystem. When the store cannot be reached, the ranks' files in
the (shared) output directory are used instead, and the lowest rank with files reports.

A rank that makes progress again deletes its entry, so an entry in the store always describes a
stall that is still going on; a stall that persists is dumped and shared again (watchdog).

Everything here runs in the watchdog's daemon thread: every store operation has a hard time limit
(it runs in a daemon thread that is abandoned after 2.5 s, on a clone of the store with its own 2 s
timeout: the job's store keeps its own), waits are bounded, nothing is a collective. ::

    >>> sorted(entry_files({"files": {"stacks-n-r1-7.txt": "x", "../evil": "y"}}))
    ['stacks-n-r1-7.txt']
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import stat
import sys
import threading
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence

#: store key of one rank's current stall entry
KEY = "hangdoc/dump/{rank}"
#: seconds each store operation may take
STORE_TIMEOUT = 2.0
#: how long after its own stall the reporting rank waits for the other ranks' entries
COLLECT_WAIT = 3.0
#: how long a rank > 0 waits for rank 0 to post before it takes over the report
TAKEOVER_WAIT = 2.0
#: seconds between two looks at the store (or the output directory) while waiting
POLL = 0.2
#: store key of the rank > 0 that took over the report of a stall: "RANK WALLTIME"
CLAIM = "hangdoc/reporter"
#: size caps per entry: stacks are small, records are cut to their most recent lines
MAX_STACKS = 512 * 1024
MAX_RECORDS = 2 * 1024 * 1024

_FILE_RE = re.compile(r"^(stacks|collectives)-[\w.\-]+\.(txt|jsonl)$")

_store_cache: Dict[str, Any] = {}


# -- the store ---------------------------------------------------------------------------------
def dist_initialized() -> bool:
    dist = sys.modules.get("torch.distributed")
    try:
        return dist is not None and dist.is_available() and dist.is_initialized()
    except Exception:
        return False


def prepare() -> None:
    """Connect to the job's store ahead of any stall (called by the watchdog while all is well).

    Connecting is the one store operation that would use the job's own (long) timeout, so it is
    done while the store is healthy, in a helper thread that may be abandoned.
    """
    if "store" in _store_cache or "pending" in _store_cache or not dist_initialized():
        return
    done = threading.Event()
    _store_cache["pending"] = done

    def connect() -> None:
        store = _connect()
        _store_cache.setdefault("store", store)
        done.set()

    threading.Thread(target=connect, name="hangdoc-store", daemon=True).start()


def _connect() -> Any:
    """A clone of the job's default store with a short timeout, or None when there is none."""
    if not dist_initialized():
        return None
    dist = sys.modules["torch.distributed"]
    import datetime

    timeout = datetime.timedelta(seconds=STORE_TIMEOUT)
    try:
        from torch.distributed import distributed_c10d as c10d

        store = c10d._get_default_store().clone()
        store.set_timeout(timeout)
        return store
    except Exception:
        pass
    try:
        # older torch: no clone(); a client of its own on the launcher's store
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if host and port:
            return dist.TCPStore(host, int(port), is_master=False, timeout=timeout, wait_for_workers=False)
    except Exception:
        pass
    return None


def job_store() -> Any:
    """The store connection made by :func:`prepare`, or None (never blocks for long)."""
    if "store" in _store_cache:
        return _store_cache["store"]
    prepare()
    pending = _store_cache.get("pending")
    if pending is None or not pending.wait(STORE_TIMEOUT):
        return None
    return _store_cache.get("store")


def _store_failed() -> None:
    _store_cache["store"] = None


class StoreTimeout(Exception):
    """A store operation did not answer in time, or failed for the connection's sake (its server
    is gone: a broken pipe, a reset); the store is not used again and the files take over at once
    (not at the watchdog's next re-dump, 4x the stall later)."""


def bounded_op(store: Any, name: str, *args: Any) -> Any:
    """``store.name(*args)`` with a hard time limit.

    The store's own timeout does not bound every operation (a stopped or wedged server leaves
    ``check``/``set`` waiting on the socket), so each runs in a daemon thread that is abandoned
    when it does not return in time.
    """
    result: List[Any] = []

    def call() -> None:
        try:
            result.append((True, getattr(store, name)(*args)))
        except BaseException as e:  # handed to the caller
            result.append((False, e))

    t = threading.Thread(target=call, name="hangdoc-store-op", daemon=True)
    t.start()
    t.join(STORE_TIMEOUT + 0.5)
    if not result:
        _store_failed()
        raise StoreTimeout(f"store {name} did not answer within {STORE_TIMEOUT + 0.5:g}s")
    ok, value = result[0]
    if not ok:
        if connection_lost(value):
            _store_failed()
            raise StoreTimeout(f"store {name} failed: {type(value).__name__}: {value}") from value
        raise value
    return value


def connection_lost(error: BaseException) -> bool:
    """Whether a store operation failed because its server is gone (torch's ``DistNetworkError``, a
    broken pipe, a reset, a refused connection), not for the one key (a ``get`` that timed out).

        >>> connection_lost(BrokenPipeError()), connection_lost(RuntimeError("Broken pipe")), connection_lost(KeyError("k"))
        (True, True, False)
    """
    if isinstance(error, OSError) or type(error).__name__ == "DistNetworkError":
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(s in text for s in _LOST)


_LOST = ("Broken pipe", "Connection reset", "Connection refused", "Connection closed", "connection closed")


def _usable(store: Any) -> bool:
    return store is not None and _store_cache.get("store") is store


def has_key(store: Any, key: str) -> bool:
    return bool(bounded_op(store, "check", [key]))


# -- entries -----------------------------------------------------------------------------------
def _read_capped(path: str, cap: int) -> str:
    """The file, or for big ones its first line (the records header) and its last ``cap`` bytes."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if size <= cap:
            return f.read().decode("utf-8", "replace")
        head = f.readline()
        f.seek(size - cap)
        f.readline()  # skip the partial line
        return (head + f.read()).decode("utf-8", "replace")


def _cap_text(text: str, cap: int) -> str:
    """:func:`_read_capped` for text held in memory (``cap`` counted in characters).

        >>> _cap_text("head\\nold\\nnew\\n", 5)
        'head\\nnew\\n'
    """
    if len(text) <= cap:
        return text
    head, _, _ = text.partition("\n")
    tail = text[len(text) - cap:]
    return head + "\n" + tail[tail.find("\n") + 1:] if "\n" in tail else head + "\n"


def make_entry(paths: Sequence[str], ident: Any, reason: str, last_progress_wall: float,
               texts: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """This rank's store entry: ``texts`` (the dump by file name, as the watchdog holds it in memory,
    written or not), else the files at ``paths``; each cut to its cap."""
    files: Dict[str, str] = {}
    for name, text in (texts or {}).items():
        files[name] = _cap_text(text, MAX_RECORDS if name.endswith(".jsonl") else MAX_STACKS)
    for p in paths:
        name = os.path.basename(p)
        if name in files:
            continue
        try:
            files[name] = _read_capped(p, MAX_RECORDS if name.endswith(".jsonl") else MAX_STACKS)
        except OSError:
            pass
    return {
        "hangdoc": "stall",
        "version": 1,
        "host": ident.host,
        "rank": ident.rank,
        "pid": ident.pid,
        "world_size": ident.world_size,
        "reason": reason,
        "time": time.time(),
        "last_progress": last_progress_wall,
        "files": files,
    }


def entry_files(entry: Dict[str, Any]) -> Dict[str, str]:
    """The entry's files whose names are hangdoc's own (nothing else is ever written)."""
    files = entry.get("files") or {}
    return {n: t for n, t in files.items() if isinstance(t, str) and _FILE_RE.match(n)}


# -- the protocol ------------------------------------------------------------------------------
def share(dog: Any, paths: Sequence[str], reason: str, stall: bool = True) -> Optional[str]:
    """Post this rank's dump; if this rank reports this stall, write and print the report.

    Returns the report path when this rank wrote it. Never raises.
    """
    try:
        return _share(dog, paths, reason, stall)
    except Exception as e:
        say(f"hangdoc watchdog: report failed: {type(e).__name__}: {e}")
        return None


def post(dog: Any, reason: str) -> None:
    """Put this rank's last dump into the store without reporting: a rank whose main function
    raised leaves it there for whichever rank reports the stall that follows. Never raises."""
    from hangdoc.runtime.identity import identity

    store = job_store()
    if store is not None:
        ident = identity()
        entry = make_entry(getattr(dog, "last_paths", ()), ident, reason, dog.last_progress_wall,
                           getattr(dog, "last_files", None))
        _post_entry(store, dog, ident, entry)


def _post_entry(store: Any, dog: Any, ident: Any, entry: Dict[str, Any]) -> Any:
    """This rank's ``entry`` into the job's ``store``; the store, or None when it failed."""
    try:
        bounded_op(store, "set", KEY.format(rank=ident.rank), json.dumps(entry))
    except Exception as e:
        say(f"hangdoc watchdog: store unreachable ({type(e).__name__}: {e}); using files in {dog.out_dir}")
        _store_failed()
        return None
    return store


def withdraw(dog: Any) -> None:
    """This rank progresses again: its entry no longer describes a stall."""
    store = job_store()
    if store is None:
        return
    from hangdoc.runtime.identity import identity

    try:
        bounded_op(store, "delete_key", KEY.format(rank=identity().rank))
    except Exception:
        pass


def _share(dog: Any, paths: Sequence[str], reason: str, stall: bool = True) -> Optional[str]:
    from hangdoc.runtime.identity import identity

    started = time.monotonic()
    ident = identity()
    entry = make_entry(paths, ident, reason, dog.last_progress_wall, getattr(dog, "last_files", None))
    store = job_store()
    if store is not None:
        store = _post_entry(store, dog, ident, entry)
    elif ident.world_size > 1:
        say(f"hangdoc watchdog: no torch.distributed store; using files in {dog.out_dir}")

    world = max(1, ident.world_size)
    if ident.rank > 0 and world > 1:
        if not _take_over(store, dog, ident.rank, started + TAKEOVER_WAIT):
            return None  # rank 0, or a rank that took over before us, writes the report
        say(f"hangdoc watchdog: rank 0 did not report; rank {ident.rank} writes the report")

    _preload_offline()
    entries = {ident.rank: entry}
    # counted from this rank's own stall, so that a rank that took over has waited for rank 0
    # already, and the verdict stays within the timeout + 5 s budget
    deadline = max(started + COLLECT_WAIT, time.monotonic() + 1.0)
    while True:
        if _usable(store):
            try:
                _collect_store(store, world, entries)
            except StoreTimeout:
                say(f"hangdoc watchdog: store unreachable; using files in {dog.out_dir}")
        if not _usable(store):
            _collect_files(dog, entries)
        if len(entries) >= world or time.monotonic() >= deadline:
            break
        time.sleep(POLL)
    # Ranks whose store operations failed still wrote their files (on a shared filesystem they
    # are here), and a rank's records file may have landed after its stacks file was seen.
    _collect_files(dog, entries)
    return _report(dog, ident, entries, world, reason, stall)


def _take_over(store: Any, dog: Any, rank: int, deadline: float) -> bool:
    """Whether this rank (> 0) must write the report: rank 0 posted nothing before ``deadline``
    and no other rank claimed this stall first.

    Only rank 0's key is watched (one store operation per poll, whatever the world size); the
    claim is a ``compare_set``, so exactly one rank takes over.
    """
    while True:
        if _usable(store):
            try:
                if has_key(store, KEY.format(rank=0)):
                    return False
            except StoreTimeout:
                say(f"hangdoc watchdog: store unreachable; using files in {dog.out_dir}")
        if not _usable(store):
            fresh = _fresh_files(dog)
            if any(r < rank for r in fresh):
                return False  # the lowest rank with files of this stall reports
        if time.monotonic() >= deadline:
            break
        time.sleep(POLL)
    if not _usable(store):
        return True
    try:
        current = bounded_op(store, "get", CLAIM).decode() if has_key(store, CLAIM) else ""
        claimed_at = float(current.split()[1]) if current else 0.0
        if current and claimed_at >= dog.last_progress_wall - 1.0:
            return False  # claimed for this stall already
        desired = f"{rank} {time.time():.3f}"
        return bounded_op(store, "compare_set", CLAIM, current, desired).decode() == desired
    except StoreTimeout:
        return True
    except Exception:
        return True


def _collect_store(store: Any, world: int, entries: Dict[int, Dict[str, Any]]) -> None:
    # Key by key: list_keys() would be one operation, but it holds the GIL while it waits, so a
    # store that does not answer would freeze the whole process, training thread included.
    missing = [r for r in range(world) if r not in entries]
    posted = [r for r in missing if has_key(store, KEY.format(rank=r))]
    for r in posted:
        try:
            entry = json.loads(bounded_op(store, "get", KEY.format(rank=r)).decode("utf-8", "replace"))
        except StoreTimeout:
            raise
        except Exception:
            continue
        if isinstance(entry, dict):
            entries[r] = entry


_RANK_IN_NAME = re.compile(r"^(?:stacks|collectives)-.*-r(\d{1,9})-\d{1,12}\.(?:txt|jsonl)$")


def fresh_rank_files(out_dir: str, since: float, name_re: "re.Pattern[str]" = _RANK_IN_NAME) -> Dict[int, List[str]]:
    """The per-rank files in ``out_dir`` written since ``since`` (epoch seconds), by rank: only
    regular, non-empty files named like ``name_re`` (rank in group 1). ``lstat``: a link or FIFO
    planted in a shared output directory is no dump of this job and is never opened."""
    found: Dict[int, List[str]] = {}
    for path in glob.glob(os.path.join(glob.escape(out_dir), "*-r*-*.*")):
        m = name_re.match(os.path.basename(path))
        if not m:
            continue
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_mtime >= since and st.st_size > 0:
            found.setdefault(int(m.group(1)), []).append(path)
    return found


def _fresh_files(dog: Any) -> Dict[int, List[str]]:
    """Files of this stall in the output directory (shared filesystem fallback), by rank."""
    return fresh_rank_files(dog.out_dir, dog.last_progress_wall - max(2.0, dog.hang_timeout))


def _collect_files(dog: Any, entries: Dict[int, Dict[str, Any]]) -> None:
    for r, paths in _fresh_files(dog).items():
        if r not in entries or "paths" in entries[r]:
            entries[r] = {"rank": r, "paths": paths}


def _preload_offline() -> None:
    # Import the offline side now, while the other ranks are still posting, not after.
    for name in ("hangdoc.readers", "hangdoc.analysis.grouping", "hangdoc.analysis.diagnose", "hangdoc.renderers.text"):
        try:
            __import__(name)
        except Exception:
            pass


def _report(dog: Any, ident: Any, entries: Dict[int, Dict[str, Any]], world: int, reason: str = "",
            stall: bool = True, dumped: Optional[List[int]] = None) -> Optional[str]:
    """Write the entries as files and the report, read them, print the verdict. What cannot be
    written (a full disk, an output directory that is no directory) is read from memory instead,
    and the verdict is printed all the same. Returns the report's path when it was written."""
    paths: List[str] = []
    memory: Dict[str, str] = {}
    written = set(getattr(dog, "last_paths", ()) or ())
    for r, entry in sorted(entries.items()):
        if "paths" in entry:
            paths.extend(entry["paths"])
            continue
        for name, text in entry_files(entry).items():
            path = os.path.join(dog.out_dir, name)
            if r == ident.rank and path in written:
                paths.append(path)
                continue
            try:
                _write_file(dog.out_dir, path, text)
                paths.append(path)
            except OSError:
                memory[name] = text

    from hangdoc.analysis import analyse
    from hangdoc.readers import read_paths
    from hangdoc.renderers import render

    with _in_memory(memory) as more:
        job = read_paths(paths + more)
    if job.world_size is None or job.world_size < world:
        job.world_size = world
    try:  # a rank that posted nothing may be stopped or stuck on this node: say so, not "missing"
        from hangdoc.runtime.siblings import unanswered, write_status

        silent = unanswered(sorted(set(range(min(world, 1 << 16))) - set(entries)), ident.host)
        job.processes.extend(silent)
        write_status(dog.out_dir, silent)  # for a later aggregate of the output directory
    except Exception:
        pass
    report = analyse(job)
    text_path: Optional[str] = os.path.join(dog.out_dir, "report.txt")
    where = text_path
    try:
        _write_file(dog.out_dir, text_path, render(report, "text"))
    except OSError as e:
        where = f"not written ({dog.out_dir}: {e.strerror or e})"
        text_path = None
    if text_path is not None:
        try:
            _write_file(dog.out_dir, os.path.join(dog.out_dir, "report.json"), render(report, "json"))
        except Exception as e:  # the text report and the verdict matter more than the JSON
            say(f"hangdoc watchdog: report.json not written: {type(e).__name__}: {e}")
    ranks = sorted(entries) if dumped is None else sorted(dumped)  # (an exit verdict's dead ranks have entries, no dump)
    say(verdict(report, ranks, world, time.time() - dog.last_progress_wall, where, reason, stall), ident)
    if stall:
        from hangdoc.runtime.retract import remember

        remember(dog, report, text_path)
    return text_path


def _write_file(out_dir: str, path: str, text: str) -> None:
    from hangdoc.runtime.dump_files import write_file as write

    write(out_dir, path, text)


@contextlib.contextmanager
def _in_memory(files: Dict[str, str]) -> Iterator[List[str]]:
    """Paths the readers can read ``files`` (name -> text) at without a disk: anonymous memory
    files (``memfd_create``, seen at ``/proc/self/fd/N``); where there are none, a private temporary
    directory. A file that cannot be placed either way is left out."""
    fds: List[int] = []
    tmp: Optional[str] = None
    paths: List[str] = []
    try:
        for name, text in sorted(files.items()):
            data = text.encode("utf-8", "replace")
            memfd = getattr(os, "memfd_create", None)
            try:
                if memfd is not None and os.path.isdir("/proc/self/fd"):
                    fd = memfd(name, getattr(os, "MFD_CLOEXEC", 0))
                    fds.append(fd)
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view):]
                    paths.append(f"/proc/self/fd/{fd}")
                    continue
                if tmp is None:
                    import tempfile

                    tmp = tempfile.mkdtemp(prefix="hangdoc-report-")
                path = os.path.join(tmp, name)
                with open(path, "wb") as f:
                    f.write(data)
                paths.append(path)
            except OSError as e:
                say(f"hangdoc watchdog: {name} left out of the report: {e.strerror or e}")
        yield paths
    finally:
        for fd in fds:
            os.close(fd)
        if tmp is not None:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)


def verdict(report: Any, ranks: List[int], world: int, since: float, path: str, reason: str = "",
            stall: bool = True) -> str:
    """The lines printed into the job's log: headline, culprits, advice, where the report is.

    The headline says why the dumps were taken: a stall (``HANG``), or, with ``stall=False``,
    ``reason`` (the detector's divergence, taken while the job still progresses).
    """
    from hangdoc.ranges import compress_ranks

    got = f"dumps from ranks {compress_ranks(ranks)} of {world}"
    if stall:
        lines = [f"hangdoc: HANG: no progress for {since:.1f}s; {got}"]
    else:
        lines = [f"hangdoc: DUMP: {reason}; {got}"]
    missing = sorted(set(range(world)) - set(ranks))
    if missing:
        lines.append(f"hangdoc:   no dump from ranks {compress_ranks(missing)}")
    findings = list(getattr(report, "findings", []) or [])
    for i, f in enumerate(findings[:3]):
        lines.append(f"hangdoc: {'VERDICT' if i == 0 else 'also'}: [{f.kind}] {f.summary}")
        if i == 0:
            for c in f.culprits[:8]:
                who = f"rank {c.rank}" if c.rank is not None else "process"
                lines.append(f"hangdoc:   culprit: {who} ({c.host or '?'} pid {c.pid if c.pid is not None else '?'})")
            if getattr(f, "candidates", None):
                from hangdoc.ranges import describe_ranks

                lines.append(f"hangdoc:   candidates (one of them): {describe_ranks(c.rank for c in f.candidates if c.rank is not None)}")
            for a in f.advice[:3]:
                lines.append(f"hangdoc:   advice: {a}")
    lines.append(f"hangdoc: full report: {path}")
    return "\n".join(lines)


def _prefix(ident: Any) -> str:
    # Under hangdoc's fd-level prefixing the lines get their prefix on the way out already; under
    # torchrun's --tee on one node, its own prefix names the rank.
    prefix = sys.modules.get("hangdoc.runtime.prefix")
    try:
        if prefix is not None and prefix.active():
            return ""
        from hangdoc.runtime.launcher_prefix import rank_shown

        if rank_shown(2):
            return ""
    except Exception:
        pass
    return f"[{ident.host}:{ident.rank}] "


def say(message: str, ident: Any = None) -> None:
    prefix = _prefix(ident) if ident is not None else ""
    data = "".join(prefix + line + "\n" for line in message.splitlines())
    try:
        os.write(2, data.encode("utf-8", "replace"))
    except OSError:
        pass


def prepared() -> bool:
    """True once :func:`prepare` has connected (or found there is no store to connect to)."""
    return "store" in _store_cache


def connected() -> bool:
    """True when :func:`prepare` found the job's store and connected to it."""
    return _store_cache.get("store") is not None
