"""Rank-prefixed output: every line this process writes to stdout/stderr starts with ``[host:rank] ``.

It works at the file-descriptor level, so it covers ``print``, logging, warnings, tracebacks,
faulthandler's crash reports and lines written by C extensions (NCCL, gloo, glog) straight to
fd 1/2. fd 1 and fd 2 are replaced by pipes (ONE pipe for both where they go to the same file, so
their lines keep the job's order), drained by a small separate process (the *drainer*) that prefixes
each line and writes it to the original descriptor, under a lock per destination, never blocking on
a write (a stalled reader of one destination holds up no other).

    >>> restore = prefix_output()          # doctest: +SKIP
    >>> print("hello")                     # doctest: +SKIP
    [node7:3] hello
    >>> restore()                          # doctest: +SKIP

Templates accept torchrun's ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` names (``${role_name}``,
``${rank}``, ``${local_rank}``) and ``{host}``, ``{rank}``, ``{local_rank}``, ``{world_size}``,
``{pid}``, ``{role_name}`` in either spelling; other text is kept as it is:

    >>> from hangdoc.runtime.identity import Identity
    >>> ident = Identity(host="n1", rank=3, local_rank=1, world_size=8, local_world_size=4, pid=42)
    >>> render_prefix("[${role_name}${rank}|{host}] ", ident, role_name="trainer")
    '[trainer3|n1] '

Why a process and not a thread of the job: a thread dies with the job, so whatever is still in
the pipe when the job segfaults, aborts, calls ``os._exit`` or is killed (faulthandler's report
first of all) would be lost, and a forked child that outlives the job would block on a full pipe.
The drainer ignores SIGINT/SIGTERM/SIGHUP/SIGQUIT/SIGUSR1/SIGUSR2 and runs until every writer (the
job and any child that inherited fd 1/2) has closed its end; it is started once (``sys.executable -S``, ~10 ms) and needs
no GIL of the job. Where it cannot be started, or is killed, a thread of the job does the same work
(one warning); the job keeps its own read ends, so no writer meets EPIPE while the job lives.

Lines are kept whole: a segment is what ends in ``\\n`` or ``\\r``; the unfinished last segment is
held until its end comes, or written as it is after ``idle_flush`` seconds without output (the
last words before a freeze matter more than a tidy line), its continuation not prefixed again.
A ``\\r`` (progress bars) starts a new segment that gets the prefix too, so a bar reads
``[host:rank]  50%|###`` at every redraw.

The drainer itself (the line prefixer, the locked non-blocking writes) is
:mod:`hangdoc.runtime.drainer`, loaded by path in a bare interpreter.
"""

from __future__ import annotations

import _thread
import os
import sys
import time

try:
    import fcntl
except ImportError:  # not Linux: no flock, default pipe size
    fcntl = None  # type: ignore[assignment]

from hangdoc.runtime import drainer as _drainer
from hangdoc.runtime.drainer import _BOOT, PIPE_SIZE, Prefixer, _Drainer

TYPE_CHECKING = False  # typing costs ~4 ms to import; type checkers read this as True
if TYPE_CHECKING:
    from typing import Callable

    from hangdoc.runtime.identity import Identity

__all__ = ["prefix_output", "render_prefix", "DEFAULT_TEMPLATE", "active", "Prefixer"]

START_TIMEOUT = 5.0  # the most prefix_output waits for the drainer to report ready

DEFAULT_TEMPLATE = "[{host}:{rank}] "
#: ``process`` (default) or ``thread``: who drains the pipes
MODE_ENV = "HANGDOC_PREFIX_MODE"

_lock = _thread.allocate_lock()
_active: "_Session | None" = None
_name_re = None


def render_prefix(template: "str | None", ident: "Identity | None" = None, role_name: "str | None" = None) -> str:
    """Expand ``template`` (default ``[{host}:{rank}] ``) for ``ident`` (default: this process)."""
    global _name_re
    import re

    from hangdoc.runtime.identity import identity

    if _name_re is None:
        _name_re = re.compile(r"\$\{(\w+)\}|\{(\w+)\}")
    ident = ident or identity()
    values = {
        "host": ident.host,
        "rank": str(ident.rank),
        "local_rank": str(ident.local_rank),
        "world_size": str(ident.world_size),
        "pid": str(ident.pid),
        "role_name": role_name if role_name is not None else os.environ.get("ROLE_NAME", "default"),
    }

    def sub(m: "re.Match[str]") -> str:
        name = m.group(1) or m.group(2)
        return values.get(name, m.group(0))

    return _name_re.sub(sub, DEFAULT_TEMPLATE if template is None else template)


# -- the line splitter -----------------------------------------------------------------------------
# -- the job's side ---------------------------------------------------------------------------------
class _NoDrainer(Exception):
    pass


def _python_ok(exe: str) -> bool:
    name = os.path.basename(exe)
    return bool(exe) and name.startswith(("python", "pypy")) and os.access(exe, os.X_OK)


def _spawn(pipes: "list[tuple[int, int, int]]", prefix: bytes, idle_flush: float, lock_base: str):
    """Start the drainer process; returns the job's end of the control socket once it is ready."""
    import socket
    import subprocess

    exe = sys.executable or ""
    source = os.path.abspath(getattr(_drainer, "__file__", None) or "")
    if not _python_ok(exe):
        raise _NoDrainer(f"no python to start the drainer process with (sys.executable={exe!r})")
    if not os.path.isfile(source):
        raise _NoDrainer(f"no file to start the drainer process from ({source!r})")
    ours, theirs = socket.socketpair()
    fd = theirs.fileno()
    args = [exe, "-S", "-c", _BOOT, source, str(fd), lock_base, repr(idle_flush), prefix.hex()]
    args += [f"{i}:{r}:{o}" for i, r, o in pipes]
    try:
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, close_fds=True,
                                pass_fds=sorted({fd, *(x for _, r, o in pipes for x in (r, o))}),
                                env=_drainer_env())
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        ours.close()
        theirs.close()
        raise _NoDrainer(f"{type(e).__name__}: {e}") from None
    theirs.close()
    try:
        ours.settimeout(START_TIMEOUT)
        ready = ours.recv(16)
    except OSError:
        ready = b""
    if ready != b"R":
        proc.kill()  # the first child, if still there; its drainer (if forked) finds EOF and leaves
    try:
        proc.wait(1.0)  # the first child exits right after its fork (a drainer that could not fork stays)
    except subprocess.TimeoutExpired:
        _orphans.append(proc)
    if ready != b"R":
        ours.close()  # a drainer that starts after all finds EOF everywhere and leaves
        raise _NoDrainer(f"the drainer process did not start (exit status {proc.returncode})")
    ours.settimeout(None)
    return ours


_orphans: list = []  # Popen objects kept alive, so that no ResourceWarning fires at exit


def _drainer_env() -> "dict[str, str]":
    # Without the launcher's rank variables: `hangdoc dump` must not take the drainer (a Python
    # process in the job's process group) for a second process of this rank.
    from hangdoc.runtime import identity as ident

    names = {*ident._RANK_VARS, *ident._LOCAL_RANK_VARS, *ident._WORLD_VARS, *ident._LOCAL_WORLD_VARS}
    return {k: v for k, v in os.environ.items() if k not in names}


class _Session:
    """The job's side: the pipes in place of fd 1/2, the saved originals, the control socket.

    Where fd 1 and fd 2 go to the same file (a terminal, ``2>&1``, SLURM's output file), both get
    the write end of ONE pipe, so the lines come out in exactly the order the job wrote them.
    The job keeps its own read end of each pipe (close-on-exec, closed in forked children): no
    writer meets EPIPE while the job lives, and if the drainer process dies, a thread of the job
    drains the same pipes on, nothing in them lost.
    """

    def __init__(self, prefix: bytes, fds: "list[int]", idle_flush: float, mode: str) -> None:
        import threading

        from hangdoc.runtime.printflock import PREFIX_PIPES_ENV

        self.pid = os.getpid()
        self.fds = fds
        self.prefix = prefix
        self.idle_flush = idle_flush
        self.saved: "dict[int, int]" = {}
        self.saved_ids: "dict[int, str]" = {}
        self.pipe_of: "dict[int, int]" = {}  # fd -> pipe index
        self.outs: "dict[int, int]" = {}  # pipe index -> the saved descriptor its lines go to
        self.reads: "dict[int, int]" = {}  # pipe index -> this process's read end (while it owns it)
        self.writes: "dict[int, int]" = {}
        self.pipe_ids: "dict[int, str]" = {}
        self.thread_reads: "dict[int, str]" = {}  # read ends a drainer thread of this process owns
        self.restored = False
        self.sock = None
        self.sock_id = ""
        self.flushed = threading.Event()
        self.watcher: "threading.Thread | None" = None
        self.line_buffering: "dict[int, bool]" = {}
        self.lock_base = ""
        _flush_python_streams()
        try:
            for fd in fds:
                self.saved[fd] = os.dup(fd)  # not inheritable: only the drainer gets a copy
                self.saved_ids[fd] = _file_id(self.saved[fd])
            self._make_pipes()
            self.mode = self._start_drainer(mode, prefix, idle_flush)
        except BaseException:
            for fd in [*self.reads.values(), *self.writes.values(), *self.saved.values()]:
                _close(fd)
            raise
        for fd in fds:  # dup2 keeps fd inheritable, so child processes are prefixed too
            os.dup2(self.writes[self.pipe_of[fd]], fd)
        for w in self.writes.values():
            os.close(w)
        self.writes.clear()
        if hasattr(os, "register_at_fork"):
            # A forked child must not keep the read ends: once this process and its drainer are
            # gone, the child would block on a full pipe instead of meeting EPIPE.
            os.register_at_fork(after_in_child=self._after_fork_in_child)
        self.saved_env = os.environ.get(PREFIX_PIPES_ENV)
        pipes = [p for p in (self.saved_env or "").split(",") if p] + list(self.pipe_ids.values())
        os.environ[PREFIX_PIPES_ENV] = ",".join(pipes)
        # Line-buffer Python's own streams so the last lines before a freeze or a crash reach the pipe.
        for fd, stream in ((1, sys.stdout), (2, sys.stderr)):
            if fd in fds and stream is not None and hasattr(stream, "reconfigure"):
                try:
                    self.line_buffering[fd] = stream.line_buffering
                    stream.reconfigure(line_buffering=True)
                except (AttributeError, ValueError, OSError):
                    pass

    def _make_pipes(self) -> None:
        for fd in [*self.reads.values(), *self.writes.values()]:
            _close(fd)
        self.reads.clear()
        self.writes.clear()
        self.pipe_of.clear()
        self.outs.clear()
        self.pipe_ids.clear()
        by_target: "dict[str, int]" = {}
        for fd in self.fds:
            target = self.saved_ids[fd]
            if target and target in by_target:  # the same file as an earlier fd: the same pipe
                self.pipe_of[fd] = by_target[target]
                continue
            index = len(self.reads)
            r, w = os.pipe()  # both close-on-exec
            self.reads[index], self.writes[index] = r, w
            try:
                fcntl.fcntl(w, getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_SIZE)
            except Exception:
                pass
            self.pipe_ids[index] = _file_id(w)
            self.pipe_of[fd] = by_target[target] = index
            self.outs[index] = self.saved[fd]

    def _start_drainer(self, mode: str, prefix: bytes, idle_flush: float) -> str:
        import threading
        import warnings

        from hangdoc.runtime import printflock

        self.lock_base = "" if printflock._disabled else printflock.lock_path()
        if mode == "process":
            pipes = [(i, r, self.outs[i]) for i, r in self.reads.items()]
            try:
                self.sock = _spawn(pipes, prefix, idle_flush, self.lock_base)
            except _NoDrainer as e:
                warnings.warn(f"hangdoc.prefix_output: {e}; prefixing in a thread of this process instead (output "
                              "still in the pipe when the process dies is lost)", RuntimeWarning, stacklevel=5)
                # Fresh pipes: a drainer that starts after all must not read the thread's share.
                self._make_pipes()
            else:
                self.sock_id = _file_id(self.sock.fileno())
                self.watcher = threading.Thread(target=self._watch, name="hangdoc-prefix-watch", daemon=True)
                self.watcher.start()
                return "process"
        self._start_thread(dict(self.reads))
        self.reads.clear()  # the thread owns them now
        return "thread"

    def _start_thread(self, reads: "dict[int, int]") -> None:
        import socket
        import threading

        sock, theirs = socket.socketpair()
        pipes = [(i, r, os.dup(self.outs[i])) for i, r in reads.items()]
        drainer = _Drainer(pipes, self.prefix, self.idle_flush, theirs.detach(), self.lock_base)
        self.thread_reads = {r: self.pipe_ids[i] for i, r in reads.items()}
        self.sock, self.sock_id = sock, _file_id(sock.fileno())
        threading.Thread(target=drainer.run, name="hangdoc-prefix", daemon=True).start()

    def _after_fork_in_child(self) -> None:
        if _active is not self:
            return
        for i, r in list(self.reads.items()):
            if _file_id(r) == self.pipe_ids[i]:
                _close(r)
        for r, pid in self.thread_reads.items():
            if _file_id(r) == pid:
                _close(r)
        self.reads, self.thread_reads = {}, {}

    def _sock_ok(self) -> bool:
        # The program may have closed the socket's descriptor (closerange) and opened a file of its
        # own under the same number: then the number is not ours to use or close.
        sock = self.sock
        if sock is None:
            return False
        try:
            fd = sock.fileno()
        except OSError:
            return False
        if fd >= 0 and _file_id(fd) == self.sock_id:
            return True
        if fd >= 0:
            sock.detach()  # so that its finaliser does not close the program's descriptor
        return False

    def _watch(self) -> None:
        # The drainer process answers flush requests here and says which pipe has lost its reader;
        # EOF means it is gone.
        sock = self.sock
        carry = b""
        while self._sock_ok():
            try:
                msg = sock.recv(64)
            except InterruptedError:
                continue
            except OSError:
                msg = b""
            if not msg:
                break
            if b"D" in msg:
                self.flushed.set()
            carry += msg.replace(b"D", b"")
            while b"\n" in carry:
                line, carry = carry.split(b"\n", 1)
                if line.startswith(b"E") and line[1:].isdigit():
                    self._pipe_broken(int(line[1:]))
        self.flushed.set()
        if not self.restored:
            self._take_over()

    def _pipe_broken(self, index: int) -> None:
        # The destination's reader is gone and the drainer has closed its read end: close ours,
        # so that the job's next write meets EPIPE.
        with _lock:
            r = self.reads.pop(index, None)
            if r is not None and _file_id(r) == self.pipe_ids[index]:
                _close(r)

    def _take_over(self) -> None:
        # The drainer process is gone (SIGKILL) while the job runs: drain the same pipes in a thread
        # of this process. What the drainer had read but not written is lost; nothing in the pipes.
        with _lock:
            if self.restored or os.getpid() != self.pid:
                return
            reads = {i: r for i, r in self.reads.items()
                     if _file_id(r) == self.pipe_ids[i] and _file_id(self.outs[i]) == self._out_id(i)}
            for i, r in self.reads.items():
                if i not in reads:
                    _close(r) if _file_id(r) == self.pipe_ids[i] else None
            self.reads = {}
            if self._sock_ok():
                self.sock.close()
            self.sock = None
            self.watcher = None
            if not reads:
                return
            self._start_thread(reads)
            self.mode = "thread"
        try:
            os.write(2, b"hangdoc.prefix_output: the drainer process is gone; prefixing in a thread of this process "
                        b"now (output still in the pipe when the process dies is lost)\n")
        except OSError:
            pass

    def _out_id(self, index: int) -> str:
        return next(self.saved_ids[fd] for fd, i in self.pipe_of.items() if i == index)

    def _ours(self, fd: int) -> bool:
        return _file_id(fd) == self.pipe_ids[self.pipe_of[fd]]

    def _saved_intact(self, fd: int) -> bool:
        return _file_id(self.saved[fd]) == self.saved_ids[fd]

    def restore(self, timeout: float = 2.0) -> None:
        _flush_python_streams()
        if os.getpid() != self.pid:
            # A forked child at exit: its output still goes through the drainer; nothing is its to undo.
            return
        with _lock:
            if self.restored:
                return
            self.restored = True
        from hangdoc.runtime.printflock import PREFIX_PIPES_ENV

        if self.saved_env is None:
            os.environ.pop(PREFIX_PIPES_ENV, None)
        else:
            os.environ[PREFIX_PIPES_ENV] = self.saved_env
        for fd, saved in self.saved.items():
            if not self._saved_intact(fd):  # the program closed it (closerange); the number may be reused
                continue
            try:
                if self._ours(fd):  # not where the program put something else there since
                    os.dup2(saved, fd)  # closes this process's write end of the pipe
                os.close(saved)
            except OSError:
                pass
        with _lock:
            sock, watcher = self.sock, self.watcher
        if sock is not None and self._sock_ok():
            self._ask_flush(sock, watcher, timeout)
            self._close_ctl(sock, watcher)
        with _lock:
            for i, r in self.reads.items():  # the drainer has what it needs; children still write to it
                if _file_id(r) == self.pipe_ids[i]:
                    _close(r)
            self.reads = {}
        for fd, stream in ((1, sys.stdout), (2, sys.stderr)):
            if fd in self.line_buffering and stream is not None:
                try:
                    stream.reconfigure(line_buffering=self.line_buffering[fd])
                except (AttributeError, ValueError, OSError):
                    pass

    def _ask_flush(self, sock, watcher, timeout: float) -> None:
        # Children (DataLoader workers, a compile pool) may keep the pipes open, so EOF can be far
        # off: wait only until what this process wrote is forwarded, and never long.
        self.flushed.clear()
        try:
            sock.sendall(b"F")
        except OSError:
            return
        if watcher is not None:
            self.flushed.wait(timeout)
            return
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            sock.settimeout(left)
            try:
                msg = sock.recv(64)
            except OSError:
                return
            if not msg or b"D" in msg:
                return

    def _close_ctl(self, sock, watcher) -> None:
        import socket

        try:
            sock.shutdown(socket.SHUT_RDWR)  # wakes the watcher; the drainer sees EOF
        except OSError:
            pass
        if watcher is not None:
            watcher.join(1.0)
        if self._sock_ok():
            sock.close()


def _file_id(fd: int) -> str:
    try:
        st = os.fstat(fd)
    except OSError:
        return ""
    return f"{st.st_dev}:{st.st_ino}"


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _flush_python_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass


def active() -> bool:
    """Whether this process's output is being prefixed now."""
    return _active is not None


def prefix_output(template: "str | None" = None, fds=(1, 2), idle_flush: float = 0.5,
                  mode: "str | None" = None) -> "Callable[[], None]":
    """Prefix every line written to ``fds`` (stdout and stderr) with the rendered ``template``.

    ``template`` defaults to ``$HANGDOC_PREFIX_TEMPLATE`` or ``[{host}:{rank}] ``. ``mode``
    (default ``$HANGDOC_PREFIX_MODE`` or ``process``) says who drains the pipes: a drainer process
    that survives the job's crash, or (``thread``) a thread of the job. Returns a callable that
    restores the original descriptors (also run at exit). Calling it again while active changes
    nothing and returns a no-op; where descriptors cannot be replaced, nothing happens.

        import hangdoc
        restore = hangdoc.prefix_output("[${role_name}${rank}] ")
        print("hello")            # -> "[default0] hello"
        restore()
    """
    global _active
    if mode is None:
        mode = os.environ.get(MODE_ENV) or "process"
        if mode not in ("process", "thread"):
            import warnings

            warnings.warn(f"hangdoc.prefix_output: ${MODE_ENV}={mode!r} is neither 'process' nor 'thread'; "
                          "using 'process'", RuntimeWarning, stacklevel=2)
            mode = "process"
    elif mode not in ("process", "thread"):
        raise ValueError(f"prefix_output: mode must be 'process' or 'thread', not {mode!r}")
    with _lock:
        if _active is not None:
            return lambda: None
        template = template if template is not None else os.environ.get("HANGDOC_PREFIX_TEMPLATE")
        prefix = render_prefix(template).encode("utf-8", "replace")
        try:
            session = _Session(prefix, list(fds), idle_flush, mode)
        except OSError as e:  # no fd 1 (daemonised), fd limit: run unprefixed
            import warnings

            warnings.warn(f"hangdoc.prefix_output: not prefixing ({e})", RuntimeWarning, stacklevel=2)
            return lambda: None
        _active = session

    def restore() -> None:
        global _active
        with _lock:
            if _active is session:
                _active = None
        session.restore()
        try:
            import atexit

            atexit.unregister(restore)
        except Exception:
            pass

    import atexit

    atexit.register(restore)
    return restore
