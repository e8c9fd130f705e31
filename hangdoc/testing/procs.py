"""Start, watch, dump and kill the per-rank processes of one test; never leave one behind.

Each rank runs in its own session (``start_new_session=True``). What a rank starts may sit in a
session of its own too (``start_new_session=True`` in the test), out of reach of ``os.killpg``: so
every path that ends ranks walks the process tree (:func:`kill_rank_tree`, with
:func:`hangdoc.proctree.kill_tree`) and kills each descendant and its group: the parent's
:meth:`RankProcesses.kill_all` (a passing, failing or hung test, Ctrl-C), the rank's own exit (what
it started outlives no passing test), and its guard thread. Each rank also holds the read end of a
pipe whose write end only the parent has: when the parent dies, however it dies (SIGKILL too), the
guard thread reads EOF and kills the rank's whole tree, then itself. A rank is its descendants'
subreaper (Linux ``PR_SET_CHILD_SUBREAPER``), so that what they leave behind stays in its tree. The
same pipe carries the parent's "dump now" request to a hung rank, which the guard thread answers
from outside the blocked main thread.

    >>> import sys
    >>> ranks = RankProcesses([[sys.executable, "-c", "pass"]] * 2, env=[{}, {}], log_dir=None)
    >>> ranks.wait(timeout=60)
    True
    >>> [p.returncode for p in ranks.procs]
    [0, 0]
    >>> ranks.kill_all()
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional, Sequence

from hangdoc.proctree import parent_map
from hangdoc.testing import warm as _warm

#: environment variable naming the control pipe's read end in a rank process.
CONTROL_FD_ENV = "HANGDOC_TESTING_CONTROL_FD"
#: byte the parent writes to ask a rank for its stacks and records.
DUMP_REQUEST = b"D"


class RankProcesses:
    """The processes of one multi-rank run, started at once, killed together."""

    def __init__(
        self,
        commands: Sequence[Sequence[str]],
        env: Sequence[Dict[str, Optional[str]]],
        log_dir: Optional[str],
        cwd: Optional[str] = None,
        warm: bool = False,
    ) -> None:
        """``warm``: fork ``python -m pytest`` ranks from zygotes that imported torch already
        (:mod:`hangdoc.testing.warm`); other commands, and ranks a zygote cannot fork, start cold."""
        self.procs: List[Any] = []  # subprocess.Popen, or warm.WarmProcess
        self._control: List[int] = []
        self.log_paths: List[Optional[str]] = []
        self._log_dir = log_dir or tempfile.mkdtemp(prefix="hangdoc-ranks-")
        self._own_log_dir = log_dir is None
        envs = [_child_env(extra) for extra in env]
        self._warm = None
        if warm and _warm.enabled():
            self._warm = _warm.pool()
            self._warm.prepare(envs)  # every rank's zygote starts at once: their imports overlap
        try:
            for i, (cmd, child_env) in enumerate(zip(commands, envs)):
                self._start(i, list(cmd), child_env, cwd)
        except BaseException:
            self.kill_all()
            raise

    def _start(self, index: int, cmd: List[str], child_env: Dict[str, str], cwd: Optional[str]) -> None:
        read_end, write_end = os.pipe()
        child_env = dict(child_env)
        child_env[CONTROL_FD_ENV] = str(read_end)
        log_path = os.path.join(self._log_dir, f"output-r{index}.log")
        with open(log_path, "wb") as log:
            try:
                proc = None
                if self._warm is not None:
                    proc = self._warm.spawn(index, cmd, child_env, cwd, [log.fileno(), read_end], CONTROL_FD_ENV)
                if proc is None:
                    proc = subprocess.Popen(
                        cmd,
                        env=child_env,
                        cwd=cwd,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        pass_fds=(read_end,),
                        start_new_session=True,
                    )
            finally:
                os.close(read_end)
        self.procs.append(proc)
        self._control.append(write_end)
        self.log_paths.append(log_path)

    def wait(self, timeout: float, until=None) -> bool:
        """Wait until every process exited (True) or ``timeout`` seconds passed (False).

        ``until`` (optional callable returning a deadline in ``time.monotonic()`` seconds or None)
        lets the caller move the deadline while waiting, e.g. to start the clock only once the
        ranks are past their imports.
        """
        deadline = time.monotonic() + timeout
        delay = 0.01
        while True:
            if all(p.poll() is not None for p in self.procs):
                return True
            if until is not None:
                moved = until()
                if moved is not None:
                    deadline = moved
            if time.monotonic() >= deadline:
                return False
            time.sleep(delay)
            delay = min(delay * 1.5, 0.1)

    def alive(self) -> List[int]:
        """Indexes of the processes still running."""
        return [i for i, p in enumerate(self.procs) if p.poll() is None]

    def request_dump(self, indexes: Sequence[int]) -> None:
        """Ask the guard thread of each process to write its stacks and records."""
        for i in indexes:
            try:
                os.write(self._control[i], DUMP_REQUEST)
            except OSError:
                pass  # it died meanwhile: nothing to dump

    def output(self, index: int, limit: int = 4000) -> str:
        """The last ``limit`` characters of what the process printed."""
        path = self.log_paths[index]
        if not path:
            return ""
        try:
            with open(path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - limit))
                data = f.read()
        except OSError:
            return ""
        text = data.decode("utf-8", "replace")
        return ("..." + text) if size > limit else text

    def kill_all(self) -> None:
        """SIGKILL every process, its group and every descendant (in sessions of their own too), and
        reap every process; safe to call more than once."""
        for p in self.procs:
            if p.poll() is None:
                kill_rank_tree(p.pid)  # walked while the rank lives: its descendants are found
            _killpg(p.pid)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover - the kernel owes us this one
                pass
        # A rank that exited normally may have left children in its group: kill those too.
        for p in self.procs:
            _killpg(p.pid)
        for fd in self._control:
            try:
                os.close(fd)
            except OSError:
                pass
        self._control = [-1] * len(self._control)
        if self._own_log_dir:
            shutil.rmtree(self._log_dir, ignore_errors=True)


def _child_env(extra: Dict[str, Optional[str]]) -> Dict[str, str]:
    """This process's environment with ``extra`` over it (None: not inherited)."""
    env = dict(os.environ)
    for k, v in extra.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def pyspy_dump(pids: Sequence[int], timeout: float = 15.0) -> Dict[int, str]:
    """``py-spy dump`` of each pid, taken in parallel; pids py-spy could not read are left out."""
    exe = shutil.which("py-spy")
    if exe is None:
        return {}
    out: Dict[int, str] = {}

    def one(pid: int) -> None:
        try:
            r = subprocess.run(
                [exe, "dump", "--pid", str(pid)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                timeout=timeout,
                start_new_session=True,
            )
        except (OSError, subprocess.TimeoutExpired):
            return
        text = r.stdout.decode("utf-8", "replace")
        if r.returncode == 0 and "Thread" in text:
            out[pid] = text

    threads = [threading.Thread(target=one, args=(pid,), daemon=True) for pid in pids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 1)
    return out


def kill_rank_tree(pid: int) -> None:
    """SIGKILL every descendant of ``pid`` with its process group (never the caller's own), then
    ``pid`` unless it is the caller: the one cleanup of every path (see the module's docstring)."""
    from hangdoc.proctree import kill_tree

    if pid == os.getpid():
        for child in child_pids(pid):
            kill_tree(child)
    else:
        kill_tree(pid)


def become_subreaper() -> bool:
    """Make this process the subreaper of its descendants (Linux >= 3.4): an orphan among them (a
    daemon that double-forked, a child whose parent exited) is re-parented here, not to init, so a
    tree walk from here still finds it. False where it cannot be done."""
    try:
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError, TypeError):
        return False


def child_pids(pid: int) -> List[int]:
    """Direct live children of ``pid`` from /proc (Linux), without psutil."""
    return sorted(parent_map().get(pid, []))


def start_guard(fd: int, on_dump) -> threading.Thread:
    """In a rank process: a daemon thread that serves dump requests and dies with the parent.

    EOF on the control pipe means the parent is gone (killed, crashed, interrupted): the rank kills
    its whole tree (in sessions of their own too) and process group rather than live on as an
    orphan holding ports and memory.
    """
    become_subreaper()

    def run() -> None:
        while True:
            try:
                data = os.read(fd, 64)
            except InterruptedError:
                continue
            except OSError:
                data = b""
            if not data:
                try:
                    kill_rank_tree(os.getpid())
                    os.killpg(os.getpgid(0), signal.SIGKILL)
                finally:
                    os._exit(70)
            if DUMP_REQUEST in data:
                try:
                    on_dump()
                except Exception as e:  # a failed dump must not take the rank down with it
                    print(f"hangdoc: dump failed: {type(e).__name__}: {e}", file=sys.stderr)

    t = threading.Thread(target=run, name="hangdoc-testing-guard", daemon=True)
    t.start()
    return t
