"""Process trees from /proc, and killing one whole: what the demo, the dump collector, the test
harnesses and the capture scripts all need.

torchrun starts each rank in a session of its own, so killing the launcher's process group leaves
the ranks (and their DataLoader workers) running; :func:`kill_tree` finds every descendant first and
kills it by pid and by its own process group.

    >>> import os, subprocess, sys
    >>> p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    >>> p.pid in descendants(os.getpid())
    True
    >>> _ = kill_tree(p.pid); p.wait()
    -9
"""

from __future__ import annotations

import os
import random
import signal
import socket
from typing import Dict, List, Tuple


def stat(pid: int) -> Tuple[str, int, int]:
    """(state, ppid, start time in clock ticks after boot) from ``/proc/PID/stat``; OSError when
    the process is gone.

        >>> stat(os.getpid())[1] == os.getppid()
        True
    """
    rest = _stat_fields(pid)
    try:
        return rest[0], int(rest[1]), int(rest[19])
    except (IndexError, ValueError):
        return (rest[0] if rest else "?"), 0, 0


def _stat_fields(pid: int) -> List[str]:
    """The fields of ``/proc/PID/stat`` after the command name (from the state on); OSError when gone."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        raw = f.read(4096).decode("utf-8", "replace")
    # the command name in (...) may itself hold spaces and parentheses: fields start after the last ')'
    return raw[raw.rfind(")") + 2:].split()


def cpu_seconds(pid: int) -> float:
    """User and system CPU time a process (or a thread, by its id) used; OSError when gone.

        >>> cpu_seconds(os.getpid()) >= 0
        True
    """
    rest = _stat_fields(pid)
    try:
        return (int(rest[11]) + int(rest[12])) / float(os.sysconf("SC_CLK_TCK"))
    except (IndexError, ValueError):
        return 0.0


def wchan(pid: int) -> str:
    """Where in the kernel a process sleeps (``/proc/PID/wchan``: ``futex_wait_queue``,
    ``anon_pipe_write``, ...); ``"?"`` when the kernel does not say; OSError when gone."""
    with open(f"/proc/{pid}/wchan", "rb") as f:
        return f.read(64).decode("ascii", "replace").strip() or "?"


def parent_map() -> Dict[int, List[int]]:
    """``{ppid: [child pids]}`` of every live (not zombie) process /proc lists now."""
    children: Dict[int, List[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return children
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            state, ppid, _ = stat(int(entry))
        except OSError:
            continue
        if state == "Z":  # a zombie has exited already: nothing to dump, wait for or kill
            continue
        children.setdefault(ppid, []).append(int(entry))
    return children


def descendants(pid: int) -> List[int]:
    """Every live descendant of ``pid``, children before grandchildren."""
    children = parent_map()
    found: List[int] = []
    todo = [pid]
    while todo:
        for child in sorted(children.get(todo.pop(0), [])):
            if child not in found:
                found.append(child)
                todo.append(child)
    return found


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> List[int]:
    """Send ``sig`` to ``pid``, all its descendants and their process groups (never the caller's
    own group); a stopped process is continued first so that it can act on ``sig``.
    Returns the descendants found. Nothing is raised for processes that are gone already."""
    tree = descendants(pid)
    groups = set()
    for target in [pid] + tree:
        try:
            groups.add(os.getpgid(target))
        except OSError:
            pass
    groups.discard(os.getpgrp())
    for s in ((signal.SIGCONT, sig) if sig in (signal.SIGTERM, signal.SIGKILL) else (sig,)):
        for target in [pid] + tree:
            try:
                os.kill(target, s)
            except OSError:
                pass
        for pgid in groups:
            try:
                os.killpg(pgid, s)
            except OSError:
                pass
    return tree


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        return stat(pid)[0] != "Z"
    except OSError:
        return False


#: ports handed out by :func:`free_port` in this process: never twice, though free again
_given: set = set()


def _ephemeral_range() -> Tuple[int, int]:
    """The kernel's range for ports bound to 0 and for outgoing connections."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", "rb") as f:
            low, high = (int(x) for x in f.read(64).split()[:2])
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A TCP port on the loopback interface that was free a moment ago, from below the kernel's
    ephemeral range: a port the kernel chose (``bind(0)``) is the next one some rank's outgoing
    connection or gloo's listener may take before the launcher binds it (``EADDRINUSE`` with
    several jobs at a time); the ports below it are only ever taken on purpose. Random, so that
    processes running jobs side by side rarely try the same one; never the same twice here.

        >>> a, b = free_port(), free_port()
        >>> a != b and 1024 < a < 65536
        True
    """
    low, _ = _ephemeral_range()
    start = 10000 if low > 12000 else 1024
    for _ in range(200 if low - start > 1000 else 0):
        port = random.randint(start, low - 1)
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given.add(port)
        return port
    with socket.socket() as s:  # a range set to cover (nearly) everything: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
