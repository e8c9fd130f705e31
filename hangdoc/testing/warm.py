"""Warm rank processes: fork each rank of a test from a process that has imported torch already.

A rank of ``@pytest.mark.world_size`` is ``python -m pytest NODEID``: an interpreter, pytest's start,
then ``import torch`` (about 3 s of CPU on a small machine) before the test's first line. A *zygote*
pays for ``import torch`` once, then forks a rank per request, which starts in a fraction of a
second and then runs exactly what the cold command would (``python -m pytest ...``, through
:mod:`runpy`), with the rank's environment, working directory, output file and control pipe.

There is one zygote per rank index: rank 0 of every test is forked from zygote 0, rank 1 from
zygote 1, and so on. Forks share their parent's string-hash seed, and ranks that shared one would
iterate a ``set`` of strings in the same order: a classic cause of diverging collective order that
torchrun's separate interpreters expose and one shared zygote would hide. Zygotes are keyed by the
environment variables torch, its thread pools and Python read at start (``PYTHON*``, ``TORCH*``,
``OMP_*``, ...): a test run with other values gets zygotes of its own. A zygote lives as long as the
pytest process that started it: it reads end-of-file on its socket when that process is gone, however
it died, and exits.

A zygote imports nothing of hangdoc and no pytest plugin (pytest rewrites the asserts of plugins
when it imports them, and warns on modules imported before it could), and runs no thread of its own.
Set ``HANGDOC_TESTING_WARM=0`` to start every rank as a fresh interpreter instead; ranks start cold
too wherever ``fork`` or Unix sockets are missing, or when a zygote fails to start.

    >>> key_of({"PYTHONPATH": "/src", "RANK": "3", "OMP_NUM_THREADS": "1"}, 0)[1:]
    (('OMP_NUM_THREADS', '1'), ('PYTHONPATH', '/src'))
"""

from __future__ import annotations

import array
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

#: set to 0 (or "no", "off", "false") to start every rank as a fresh interpreter.
ENV_WARM = "HANGDOC_TESTING_WARM"
#: the zygote's end of its socket (set in the zygote's environment only).
ENV_SOCKET = "HANGDOC_TESTING_ZYGOTE_FD"
#: environment variables read when an interpreter starts or torch is imported: a zygote is reused
#: only for ranks that agree with it on every one of these.
KEY_PREFIXES = ("PYTHON", "TORCH", "PYTORCH", "OMP_", "KMP_", "MKL_", "OPENBLAS_", "GOTO", "NUMEXPR",
                "CUDA", "NCCL_", "GLOO_", "LD_", "MALLOC", "TMPDIR")
#: how long a zygote may take to import torch before its ranks start cold instead.
READY_TIMEOUT = 180.0
#: zygotes one process keeps; past this the oldest is closed (a test run with many environments).
MAX_ZYGOTES = 16
_MSG = 65536


def enabled() -> bool:
    """Whether warm ranks may be used here (Linux-like ``fork``, Unix sockets, not switched off)."""
    if os.environ.get(ENV_WARM, "1").strip().lower() in ("0", "no", "off", "false"):
        return False
    return hasattr(os, "fork") and hasattr(socket, "AF_UNIX") and hasattr(socket, "SOCK_SEQPACKET") \
        and sys.platform.startswith("linux")


def key_of(env: Dict[str, str], index: int) -> Tuple:
    """What a zygote must agree on with a rank to fork it: the rank index and the start-up variables."""
    return (index,) + tuple(sorted((k, v) for k, v in env.items() if k.startswith(KEY_PREFIXES)))


def pytest_args(cmd: Sequence[str]) -> Optional[List[str]]:
    """The arguments of ``[sys.executable, "-m", "pytest", ...]``; None for any other command."""
    if len(cmd) >= 3 and cmd[0] == sys.executable and cmd[1] == "-m" and cmd[2] == "pytest":
        return list(cmd[3:])
    return None


class WarmProcess:
    """A rank forked by a zygote: the part of :class:`subprocess.Popen` that the plugin uses."""

    def __init__(self, pid: int, zygote: "Zygote") -> None:
        self.pid = pid
        self.returncode: Optional[int] = None
        self._zygote = zygote

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.returncode = self._zygote.status(self.pid)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(["warm rank", str(self.pid)], timeout or 0)
            time.sleep(0.02)
        return self.returncode  # type: ignore[return-value]


class Zygote:
    """One zygote process, seen from the pytest process that started it."""

    def __init__(self, env: Dict[str, str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        zenv = dict(env)
        zenv[ENV_SOCKET] = str(theirs.fileno())
        try:
            self.proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__)], env=zenv, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, pass_fds=(theirs.fileno(),),
                start_new_session=True, cwd="/",
            )
        finally:
            theirs.close()
        self.sock = ours
        self._cond = threading.Condition()
        self._ready = False
        self._closed = False
        self._exits: Dict[int, int] = {}
        self._forked: Dict[int, int] = {}  # request number -> pid
        self._errors: Dict[int, str] = {}
        self._pids: List[int] = []
        self._next = 0
        self._send_lock = threading.Lock()
        threading.Thread(target=self._read, name="hangdoc-zygote-reader", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(_MSG)
            except OSError:
                data = b""
            if not data:
                break
            try:
                msg = json.loads(data.decode("utf-8"))
            except ValueError:
                continue
            with self._cond:
                if msg.get("ready"):
                    self._ready = True
                elif "exit" in msg:
                    self._exits[int(msg["exit"])] = int(msg["code"])
                elif "forked" in msg:
                    self._forked[int(msg["req"])] = int(msg["forked"])
                elif "error" in msg:
                    self._errors[int(msg["req"])] = str(msg["error"])
                self._cond.notify_all()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    @property
    def alive(self) -> bool:
        return not self._closed and self.proc.poll() is None

    def wait_ready(self, timeout: float) -> bool:
        with self._cond:
            self._cond.wait_for(lambda: self._ready or self._closed, timeout)
            return self._ready and not self._closed

    def fork(self, argv: List[str], env: Dict[str, str], cwd: Optional[str], fds: Sequence[int],
             control_env: str, timeout: float = 30.0) -> Optional[WarmProcess]:
        """A rank running ``python -m pytest *argv``; ``fds``: its output file, then its control
        pipe's read end (passed over the socket, as ``pass_fds`` would), whose number the rank finds
        in ``control_env``. None if the zygote failed."""
        with self._cond:
            req = self._next
            self._next += 1
        msg = json.dumps({"req": req, "argv": argv, "env": env, "cwd": cwd or os.getcwd(),
                          "control_env": control_env}).encode("utf-8")
        if len(msg) > _MSG:
            return None
        try:
            with self._send_lock:
                self.sock.sendmsg([msg], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        except OSError:
            return None
        with self._cond:
            self._cond.wait_for(lambda: req in self._forked or req in self._errors or self._closed, timeout)
            pid = self._forked.get(req)
        if pid is None:
            return None
        self._pids.append(pid)
        return WarmProcess(pid, self)

    def status(self, pid: int) -> Optional[int]:
        """The exit code of a rank as ``Popen.returncode`` gives it (-N: killed by signal N), None
        while it runs. A rank whose zygote is gone is reaped by someone else: -9 once it is gone."""
        with self._cond:
            if pid in self._exits:
                return self._exits[pid]
            closed = self._closed
        if closed and not _exists(pid):
            return -9
        return None

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def _exists(pid: int) -> bool:
    """Whether ``pid`` is a live process (not a zombie); in the pytest process, never in a zygote."""
    from hangdoc.proctree import stat

    try:
        return stat(pid)[0] not in ("Z", "X")
    except OSError:
        return False


class Pool:
    """The zygotes of one pytest process, one per (rank index, start-up environment)."""

    def __init__(self) -> None:
        self._zygotes: Dict[Tuple, Zygote] = {}
        self._lock = threading.Lock()

    def prepare(self, envs: Sequence[Dict[str, str]]) -> None:
        """Start, all at once, the zygotes that ranks with these environments (index = rank) need."""
        for i, env in enumerate(envs):
            self._get(key_of(env, i), env)

    def _get(self, key: Tuple, env: Dict[str, str]) -> Optional[Zygote]:
        with self._lock:
            z = self._zygotes.get(key)
            if z is not None and not z.alive:
                z.close()
                del self._zygotes[key]
                z = None
            if z is None:
                while len(self._zygotes) >= MAX_ZYGOTES:
                    self._zygotes.pop(next(iter(self._zygotes))).close()
                try:
                    z = self._zygotes[key] = Zygote(env)
                except OSError:
                    return None
            return z

    def spawn(self, index: int, cmd: Sequence[str], env: Dict[str, str], cwd: Optional[str],
              fds: Sequence[int], control_env: str) -> Optional[WarmProcess]:
        """Rank ``index`` running ``cmd`` forked from its zygote; None: start it cold instead."""
        argv = pytest_args(cmd)
        if argv is None:
            return None
        z = self._get(key_of(env, index), env)
        if z is None or not z.wait_ready(READY_TIMEOUT):
            return None
        return z.fork(argv, env, cwd, fds, control_env)

    def close(self) -> None:
        with self._lock:
            for z in self._zygotes.values():
                z.close()
            self._zygotes.clear()


_POOL: Optional[Pool] = None


def pool() -> Pool:
    """This process's zygotes (created on first use)."""
    global _POOL
    if _POOL is None:
        _POOL = Pool()
    return _POOL


# --- the zygote process ---------------------------------------------------------------------------


def _exit_code(status: int) -> int:
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def _send(sock: socket.socket, **msg) -> None:
    try:
        sock.send(json.dumps(msg).encode("utf-8"))
    except OSError:
        pass


def serve(sock: socket.socket) -> Optional[Tuple[Dict, List[int]]]:
    """The zygote's loop. Returns only in a forked rank: its request and file descriptors."""
    for name in ("torch", "torch.distributed", "pytest", "_pytest.config", "_pytest.main", "_pytest.python",
                 "_pytest.fixtures", "_pytest.runner", "_pytest.assertion.rewrite"):
        try:
            __import__(name)
        except Exception:  # a rank that needs it will fail the same way, and say so in its own output
            pass
    _send(sock, ready=True, pid=os.getpid())
    while True:
        try:
            readable, _, _ = select.select([sock], [], [], 0.05)
        except InterruptedError:
            readable = []
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            _send(sock, exit=pid, code=_exit_code(status))
        if not readable:
            continue
        try:
            data, anc, _, _ = sock.recvmsg(_MSG, socket.CMSG_SPACE(16 * array.array("i").itemsize))
        except OSError:
            data, anc = b"", []
        fds: List[int] = []
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                a = array.array("i")
                a.frombytes(payload[: len(payload) - len(payload) % a.itemsize])
                fds += list(a)
        if not data:  # the pytest process is gone: so are we (its ranks have guards of their own)
            os._exit(0)
        try:
            req = json.loads(data.decode("utf-8"))
        except ValueError:
            for fd in fds:
                os.close(fd)
            continue
        try:
            pid = os.fork()
        except OSError as e:
            _send(sock, req=req.get("req"), error=str(e))
            for fd in fds:
                os.close(fd)
            continue
        if pid == 0:
            sock.close()
            return req, fds
        for fd in fds:
            os.close(fd)
        _send(sock, req=req.get("req"), forked=pid)


def _run_rank(req: Dict, fds: List[int]) -> None:
    """In the forked child: take the rank's output, control pipe, environment, directory and
    arguments, then run ``python -m pytest`` as the cold command would."""
    import runpy

    if len(fds) < 2:  # a request without its output file and pipe: nothing to run it with
        os._exit(70)
    os.setsid()
    out, control = fds[0], fds[1]
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    for fd in (null, out):
        if fd > 2:
            os.close(fd)
    os.set_inheritable(control, True)
    env = {str(k): str(v) for k, v in dict(req.get("env") or {}).items()}
    env[str(req.get("control_env") or "HANGDOC_TESTING_CONTROL_FD")] = str(control)
    os.environ.clear()
    os.environ.update(env)
    cwd = str(req.get("cwd") or "/")
    os.chdir(cwd)
    sys.path.insert(0, cwd)  # as `python -m` puts the working directory first
    sys.argv = ["pytest"] + [str(a) for a in req.get("argv") or []]
    runpy.run_module("pytest", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    sys.path.pop(0)  # this file's directory: its modules must not shadow what torch imports
    _fd = int(os.environ.pop(ENV_SOCKET))
    _job = serve(socket.socket(fileno=_fd))
    if _job is not None:
        _run_rank(_job[0], _job[1])
