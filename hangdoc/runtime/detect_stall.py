"""A rank the others wait for, its main thread blocked outside any collective on what will not come.

Two forms, each a fact about the rank's own process that its stacks alone do not show:

* **a DataLoader worker that stopped**: the main thread waits for batch ``i`` in the DataLoader's
  ``_get_data``, the worker that owes it (the iterator's ``_task_info[i]``) is alive, sleeps in the
  kernel (``/proc/PID/stat`` state ``S`` or ``D``, its ``wchan`` named) and has used next to no CPU
  since the wait began (``examples/bugs/dataloader_getitem.py``: a read of a FIFO nobody writes;
  a remote read that never returns, a retry loop that sleeps). A worker that computes is slow, not
  stuck, and is left alone;
* **a thread that died of an exception** while the main thread waits in the standard library
  (``queue.get()``, ``Event.wait()``, ``Thread.join()``: ``examples/bugs/prefetch_thread_died_queue.py``,
  whose prefetch thread raised on a truncated record). Python prints such a traceback on stderr and
  goes on; the verdict is ``rank-failed`` with that exception;
* **a wait no thread is left to end**: the main thread waits in ``threading``/``queue`` and no other
  thread of the process is alive (hangdoc's own aside): the thread that was to set the event or fill
  the queue returned without doing it (``examples/bugs/shard_prefetch_event_never_set.py``). The
  rank never issues its next collective: ``collective-mismatch``, as for a lock it deadlocked on.

* **the main thread standing in one frame of the user's code** (none of the above): asleep at a
  ``time.sleep`` (a retry loop's back-off, ``examples/bugs/b4_proc_cache_retry_backoff_forever.py``),
  reading its standard input (``input()``), running a loop that does not return (its own CPU time
  grows: ``examples/bugs/b4_proc_tokenizer_nbsp_spin.py``), in a C call, or waiting for a child that
  is blocked writing to a full pipe this process never reads (``Popen(stdout=PIPE)`` then
  ``wait()``: ``examples/bugs/b4_proc_git_status_pipe_wait.py``, a deadlock). Not a main thread in
  torch.distributed (the other rules' business), in a DataLoader or in any other library's wait.

All are time-based, so all wait: the main thread must stand at the same wait for
``max(STALL, PAUSES * the longest pause between this rank's recent calls)`` seconds (a loop whose
steps include a 10 s data fetch is not flagged at 4 s), and another member of one of its groups
must be waiting for it (quiet, having issued a call in a group this rank has not issued yet: the
detector reads that from the partners' publications, :func:`waiting_for`).

Nothing here runs the user's code: the iterator's fields are read from its instance ``__dict__``,
the kernel's view from ``/proc``; the excepthook keeps at most MAX_ERRORS short tuples, no frames.

    >>> longest_pause([1.0, 1.5, 4.0, 4.2])
    2.5
    >>> threshold([0.0, 0.01, 0.02])
    4.0
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

#: the least time (s) a main thread stands at one wait before it is a stall
STALL = 4.0
#: ... or this many times the longest pause between the rank's recent calls, when longer
PAUSES = 3.0
#: the worker's CPU use during the wait that still counts as "next to none" (share of the wall time)
CPU_SHARE = 0.05
#: thread deaths kept
MAX_ERRORS = 4
#: frames of the main thread looked at
MAX_FRAMES = 64
_DATA = os.sep + os.path.join("torch", "utils", "data") + os.sep
_DIST = os.sep + os.path.join("torch", "distributed") + os.sep
_STDLIB = os.path.dirname(os.__file__) + os.sep
_HANGDOC = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
#: the standard library's waits a main thread sits in for another thread's work
_WAIT_FILES = ("threading.py", "queue.py", os.path.join("multiprocessing", "queues.py"),
               os.path.join("multiprocessing", "connection.py"), os.path.join("concurrent", "futures", "_base.py"))

_state: Dict[str, Any] = {"hook": None, "errors": []}


def longest_pause(times: Sequence[float]) -> float:
    """The longest gap between consecutive times (seconds)."""
    return max((b - a for a, b in zip(times, times[1:])), default=0.0)


def threshold(times: Sequence[float]) -> float:
    """How long a wait must stand, from the issue times of the rank's recent calls."""
    return max(STALL, PAUSES * longest_pause(times))


# --- threads that died ----------------------------------------------------------------------------

def install() -> None:
    """Keep (thread, exception, where, when) of each thread that dies of an exception; the hook
    before still runs (Python's prints the traceback)."""
    if _state["hook"] is not None:
        return
    before = threading.excepthook

    def hook(args: Any) -> None:
        try:
            _note(args)
        except Exception:
            pass
        before(args)

    threading.excepthook = hook
    _state["hook"] = (before, hook)


def uninstall() -> None:
    hooks = _state["hook"]
    _state["hook"] = None
    if hooks is not None and threading.excepthook is hooks[1]:
        threading.excepthook = hooks[0]


def _note(args: Any) -> None:
    from hangdoc.runtime import on_term

    name = str(getattr(args.thread, "name", "?"))
    if args.exc_type is SystemExit or name.startswith("hangdoc") or on_term.terminating():
        return
    errors = _state["errors"]
    if len(errors) >= MAX_ERRORS:
        return
    tb, site = args.exc_traceback, "?"
    while tb is not None:  # the innermost frame: where it was raised
        site = f"{os.path.basename(tb.tb_frame.f_code.co_filename)}:{tb.tb_lineno}"
        tb = tb.tb_next
    message = str(args.exc_value)[:200] if args.exc_value is not None else ""
    errors.append((name[:100], f"{args.exc_type.__name__}: {message}" if message else args.exc_type.__name__,
                   site, time.monotonic()))


def thread_errors() -> List[Tuple[str, str, str, float]]:
    return list(_state["errors"])


# --- the main thread's wait -----------------------------------------------------------------------

def is_lib(name: str) -> bool:
    """Whether a frame's file is the standard library's, torch's or hangdoc's (not the user's)."""
    return (name.startswith((_STDLIB, _HANGDOC, "<")) or (os.sep + "torch" + os.sep) in name)


def _user_site(frame: Any) -> Tuple[str, int, str]:
    """(file, line, "file:line") of the innermost frame outside the standard library, torch and hangdoc."""
    f = frame
    while f is not None:
        name = f.f_code.co_filename
        if not is_lib(name):
            return name, f.f_lineno, f"{os.path.basename(name)}:{f.f_lineno}"
        f = f.f_back
    return "", 0, "?"


def main_frame() -> Any:
    main = threading.main_thread()
    return sys._current_frames().get(main.ident) if main.ident is not None else None


def dataloader_wait(frame: Any) -> Optional[Dict[str, Any]]:
    """The batch the main thread waits for from a DataLoader worker, and that worker; None when it
    does not wait for one (or the batch is there: out of order, kept for later)."""
    f, depth = frame, 0
    while f is not None and depth < MAX_FRAMES:
        if _DATA in f.f_code.co_filename and f.f_code.co_name in ("_get_data", "_try_get_data", "_next_data"):
            it = f.f_locals.get("self")
            fields = getattr(it, "__dict__", None)
            if isinstance(fields, dict) and "_task_info" in fields:
                break
        f, depth = f.f_back, depth + 1
    else:
        return None
    try:
        idx = int(fields["_rcvd_idx"])
        info = fields["_task_info"].get(idx)
        if not isinstance(info, tuple) or len(info) != 1:
            return None  # no task, or its data already came
        worker = int(info[0])
        pid = int(fields["_workers"][worker].pid)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError):
        return None
    _file, _line, site = _user_site(frame)
    return {"what": "dataloader", "key": (id(it), idx, worker, pid), "batch": idx, "worker": worker,
            "pid": pid, "site": site}


def thread_wait(frame: Any) -> Optional[Dict[str, Any]]:
    """Where the main thread waits in the standard library for another thread (a queue, an event, a
    join), from the user's line; None when it does not."""
    if frame is None or not frame.f_code.co_filename.startswith(_STDLIB) \
            or not frame.f_code.co_filename.endswith(_WAIT_FILES):
        return None
    file, line, site = _user_site(frame)
    if not file:
        return None
    from hangdoc.runtime.detect_lock import line_of
    from hangdoc.textsafe import visible

    text = line_of(file, line)
    code = visible(text.decode("utf-8", "replace").strip())[:120] if text else ""
    user = frame
    while user is not None and user.f_code.co_filename != file:
        user = user.f_back
    lib = frame.f_code.co_filename[len(_STDLIB):]
    return {"what": "thread", "key": (id(user), line, frame.f_code.co_name), "site": site, "code": code,
            "lib": lib.startswith(("multiprocessing", "concurrent"))}


def _others_alive() -> bool:
    """Whether a thread other than the main one and hangdoc's own is alive: one that may still set the
    event, put into the queue, end for a join. Threads torch starts in C++ call no Python wait's
    wake-up; a signal handler could, and is not counted."""
    main = threading.main_thread()
    return any(t is not main and t.is_alive() and not t.name.startswith("hangdoc") for t in threading.enumerate())


#: a line that sleeps, or reads the terminal
_SLEEP = re.compile(r"\bsleep\(")
_INPUT = re.compile(r"\binput\(|\bstdin\b|\bgetpass\(")
#: the kernel's names for a process blocked writing to a full pipe
_PIPE_WRITE = ("pipe_write", "pipe_wait", "pipe_wait_writable", "anon_pipe_write")
_SUBPROCESS = ("subprocess.py",)


def frame_wait(frame: Any) -> Optional[Dict[str, Any]]:
    """The main thread standing in one frame of the user's code, none of the waits above: its
    innermost frame is the user's (a sleep, a read of the terminal, a C call, a Python loop), or it
    waits for a child process that is blocked writing to a pipe nobody reads. None when it is in
    torch.distributed (a collective: the other rules' business) or in any other library wait."""
    f, depth = frame, 0
    while f is not None and depth < MAX_FRAMES:
        if _DIST in f.f_code.co_filename or _DATA in f.f_code.co_filename:
            return None
        f, depth = f.f_back, depth + 1
    file, line, site = _user_site(frame)
    if not file:
        return None
    inner = frame.f_code.co_filename
    child = None
    if is_lib(inner):
        if not (inner.startswith(_STDLIB) and inner.endswith(_SUBPROCESS)):
            return None
        child = _child_on_a_pipe()
        if child is None:
            return None
    user = frame
    while user is not None and user.f_code.co_filename != file:
        user = user.f_back
    from hangdoc.runtime.detect_lock import line_of
    from hangdoc.textsafe import visible

    text = line_of(file, line)
    code = visible(text.decode("utf-8", "replace").strip())[:120] if text else ""
    how = "child" if child else "sleep" if _SLEEP.search(code) else "input" if _INPUT.search(code) else "run"
    return {"what": "frame", "key": (id(user), user.f_code), "site": site, "code": code, "how": how,
            "func": user.f_code.co_name, "child": child}


def _child_on_a_pipe() -> Optional[int]:
    """A child of this process blocked writing to a pipe (its wchan), or None."""
    from hangdoc import proctree

    for pid in proctree.parent_map().get(os.getpid(), [])[:64]:
        st = process_state(pid)
        if st is not None and st[0] == "S" and st[2].startswith(_PIPE_WRITE):
            return pid
    return None


def main_cpu() -> Optional[float]:
    """CPU seconds the main thread used (its /proc task), None where unknown."""
    tid = getattr(threading.main_thread(), "native_id", None)
    st = process_state(tid) if tid else None
    return st[1] if st is not None else None


def process_state(pid: int) -> Optional[Tuple[str, float, str]]:
    """(state, CPU seconds used, wchan) of a process from /proc; None when it is gone."""
    from hangdoc import proctree

    try:
        state, cpu = proctree.stat(pid)[0], proctree.cpu_seconds(pid)
    except OSError:
        return None
    try:
        where = proctree.wchan(pid)
    except OSError:
        where = "?"
    return state, cpu, where


#: records looked at for the pauses between this rank's calls, and publications read for who waits
#: for a stalled rank
STALL_RECORDS = 256
WAITING_READS = 8


def wait_asked() -> float:
    """How long this rank's main thread must stand at one wait to be stalled: from the pauses
    between its recent calls (:func:`threshold`), as the recorder has them."""
    from hangdoc.runtime import recorder

    r = recorder.get()
    records = list(r._buf)[-STALL_RECORDS:] if r is not None else []  # one C-level copy: consistent
    return threshold([rec[recorder._T0] for rec in records])


def waiting_for(node: Any, digests: Any) -> Optional[Dict[str, Any]]:
    """Who waits for this rank: members of one of its groups (its latest call's first) that are
    quiet having issued more calls there than it did; read from their publications
    (:class:`hangdoc.runtime.detect_node.Node`), at most WAITING_READS of them in all.
    {"ranks", "group", "index", "entry"} or None."""
    from hangdoc.runtime.detect_digest import entry_at

    counts = {name: g.n for name, g in list(digests.groups.items())}
    latest = digests.last[0] or "default_pg"
    reads = 0
    for name in sorted(counts, key=lambda g: (g != latest, g)):
        found: List[int] = []
        entry = None
        for r in node.ranks_of(name):
            if r == node.rank:
                continue
            if reads >= WAITING_READS:
                break
            reads += 1
            pub = node.read(r)
            g = (pub or {}).get("g", {}).get(name) if isinstance(pub, dict) else None
            if isinstance(g, dict) and pub.get("quiet") and int(g.get("n", 0)) > counts[name]:
                found.append(r)
                entry = entry or entry_at(g, counts[name])
        if found:
            return {"ranks": found, "group": name, "index": counts[name], "entry": entry}
    return None


class Watch:
    """The detector's look, once a second while quiet: the wait that stood long enough, or None."""

    def __init__(self) -> None:
        #: (key, since, the worker's CPU then)
        self.first: Optional[Tuple[Any, float, float]] = None

    def look(self, now: float, wait_for: float) -> Optional[Dict[str, Any]]:
        frame = main_frame()
        found = dataloader_wait(frame) if frame is not None else None
        if found is None:
            found = thread_wait(frame)
            errors = thread_errors()
            if found is not None and errors:
                found["error"] = errors[0]
            elif found is not None and (found["lib"] or _others_alive()):
                return self._none()  # a live thread may still wake it (or another process may: a multiprocessing queue)
        if found is None and frame is not None:
            found = frame_wait(frame)
        if found is None:
            return self._none()
        cpu = 0.0
        if found["what"] == "frame":
            cpu = main_cpu() or 0.0
        if found["what"] == "dataloader":
            st = process_state(found["pid"])
            if st is None or st[0] not in ("S", "D"):
                self.first = None  # gone (the DataLoader says so itself) or computing: not a stall
                return None
            cpu = st[1]
            found["wchan"] = st[2]
        if self.first is None or self.first[0] != found["key"]:
            self.first = (found["key"], now, cpu)
            return None
        since, cpu0 = self.first[1], self.first[2]
        found["waited"] = now - since
        if found["waited"] < wait_for:
            return None
        if found["what"] == "dataloader":
            found["cpu"] = cpu - cpu0
            if found["cpu"] > CPU_SHARE * found["waited"] + 0.05:
                self.first = (found["key"], now, cpu)  # it works, slowly: look again from here
                return None
        if found["what"] == "frame":
            found["cpu"] = max(0.0, (main_cpu() or 0.0) - cpu0)
        return found

    def _none(self) -> None:
        self.first = None
        return None


def verdict(rank: int, found: Dict[str, Any], waiting: Dict[str, Any], digests: Any, describe: Any) -> Any:
    """``dataloader-stall`` for a worker that stopped, ``rank-failed`` for a thread that died;
    ``waiting`` = {"ranks", "group", "index", "entry"}: who waits for this rank, and in what."""
    from hangdoc.ranges import describe_ranks
    from hangdoc.runtime.detect_digest import Verdict
    from hangdoc.textsafe import visible

    entry = waiting.get("entry")
    v = Verdict(waiting["group"], int(waiting["index"]), True, [rank], sorted(waiting["ranks"]), None, entry, "stall")
    call = f"{entry[1]} at {entry[2]}" if entry else "their next call"
    verb = "waits" if len(waiting["ranks"]) == 1 else "wait"
    others = (f"{describe_ranks(sorted(waiting['ranks']))} {verb} for it in {call} "
              f"(#{int(waiting['index'])} of {waiting['group']})")
    site = visible(str(found.get("site", "?")))[:200]
    if found["what"] == "dataloader":
        v.kind = "dataloader-stall"
        v.text = (f"{describe_ranks([rank])} waits at {site} for batch {int(found['batch'])} from its DataLoader "
                  f"worker {int(found['worker'])} (pid {int(found['pid'])}), which has slept in the kernel "
                  f"({visible(str(found.get('wchan', '?')))[:40]}) for {found['waited']:.0f} s using "
                  f"{found.get('cpu', 0.0):.2f} s of CPU; {others}")
    elif found["what"] == "frame":
        code = f" (`{found['code']}`)" if found.get("code") else ""
        waited = f"{found['waited']:.0f} s"
        if found["how"] == "child":
            doing = (f"has waited {waited} at {site}{code} for its child (pid {int(found['child'])}), which is blocked "
                     f"writing to a full pipe that this process never reads: a deadlock (read the output before "
                     f"waiting, or use communicate())")
        elif found["how"] == "sleep":
            doing = f"has slept at {site}{code} for {waited} (a retry or back-off loop?)"
        elif found["how"] == "input":
            doing = f"has waited {waited} at {site}{code} for input on its standard input"
        elif found.get("cpu", 0.0) >= 0.5 * found["waited"]:
            doing = (f"has run in {visible(str(found.get('func', '?')))[:80]} at {site}{code} for {waited} "
                     f"({found['cpu']:.0f} s of CPU) without returning (a loop that does not end?)")
        else:
            doing = f"has stood at {site}{code} for {waited}"
        v.text = f"{describe_ranks([rank])}'s main thread {doing}, outside any collective; {others}"
    elif "error" not in found:
        code = f" (`{found['code']}`)" if found.get("code") else ""
        v.text = (f"{describe_ranks([rank])}'s main thread has waited at {site}{code} for {found['waited']:.0f} s, "
                  f"and no other thread of it is alive to wake it: it will never issue its next collective; {others}")
    else:
        v.kind = "rank-failed"
        name, what, where, _t = found["error"]
        code = f" (`{found['code']}`)" if found.get("code") else ""
        v.text = (f"{describe_ranks([rank])}: thread {visible(name)!r} died of {visible(what)} at "
                  f"{visible(where)}; the main thread has waited at {site}{code} for {found['waited']:.0f} s "
                  f"since; {others}")
    return v


def completed_calls() -> int:
    """Calls of this rank seen completed so far (the recorder's count; 0 without one): a stall is
    withdrawn only once one completed after it (hangdoc.runtime.detect's ``_resumed``)."""
    from hangdoc.runtime import recorder

    r = recorder.get()
    try:
        return r.progress if r is not None else 0
    except Exception:
        return 0
