"""Rank-prefixed output: every line this process writes to stdout/stderr starts with ``[host:rank] ``.

It works at the file-descriptor level, so it covers ``print``, logging, warnings, tracebacks,
faulthandler's crash reports and lines written by C extensions (NCCL, gloo, glog) straight to
fd 1/2. Each of fd 1 and fd 2 is replaced by a pipe, drained by a small separate process (the
*drainer*) that prefixes each line and writes it to the original descriptor.

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
no GIL of the job, so lines reach the console in the order the job wrote them, as far as two pipes
allow. Where it cannot be started, a thread of the job does the same work (one warning).

Lines are kept whole: a segment is what ends in ``\\n`` or ``\\r``; the unfinished last segment is
held until its end comes, or written as it is after ``idle_flush`` seconds without output (the
last words before a freeze matter more than a tidy line), its continuation not prefixed again.
A ``\\r`` (progress bars) starts a new segment that gets the prefix too, so a bar reads
``[host:rank]  50%|###`` at every redraw.

This file is also the drainer's program: it is loaded by path in a bare interpreter, so it imports
nothing outside the standard library at module level.
"""

from __future__ import annotations

import _thread
import os
import select
import sys
import time

try:
    import fcntl
except ImportError:  # not Linux: no flock, default pipe size
    fcntl = None  # type: ignore[assignment]

TYPE_CHECKING = False  # typing costs the drainer process ~4 ms to import; type checkers read this as True
if TYPE_CHECKING:
    from typing import Callable

    from hangdoc.runtime.identity import Identity

__all__ = ["prefix_output", "render_prefix", "DEFAULT_TEMPLATE", "active", "Prefixer"]

DEFAULT_TEMPLATE = "[{host}:{rank}] "
#: ``process`` (default) or ``thread``: who drains the pipes
MODE_ENV = "HANGDOC_PREFIX_MODE"

PIPE_SIZE = 1 << 20  # room for C++ threads' bursts (NCCL's timeout lines) while the drainer writes
READ_SIZE = 1 << 16
MAX_HELD = 1 << 16  # an unfinished segment longer than this is written as it is
START_TIMEOUT = 5.0  # the most prefix_output waits for the drainer to report ready
# A pipe that brings reads of < COALESCE_BELOW bytes less than COALESCE_WITHIN s apart, while the
# other has been QUIET s, is left to gather for COALESCE_FOR s: one wake-up per tqdm redraw cost the
# drainer ~6 us, and the job as much where the two share a core.
COALESCE_BELOW, COALESCE_WITHIN, COALESCE_FOR, QUIET = 1024, 0.001, 0.0003, 0.05

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
class Prefixer:
    """Turns a byte stream into prefixed segments; holds the unfinished last segment.

    A segment ends in ``\\n`` or ``\\r``. Every line gets the prefix (an empty one too); after a
    ``\\r`` the next segment gets it only if it has text (``\\r\\n`` stays one line end). Work is
    linear in the bytes fed, however they are chunked.

        >>> p = Prefixer(b"[0] ")
        >>> p.feed(b"a\\nb") + p.feed(b"c\\n") + p.finish()
        b'[0] a\\n[0] bc\\n'
        >>> p.feed(b"\\r 10%|#") + p.feed(b"\\r 20%|##") + p.feed(b"\\n")
        b'\\r[0]  10%|#\\r[0]  20%|##\\n'
    """

    def __init__(self, prefix: bytes) -> None:
        self.prefix = prefix
        self.held = 0  # bytes of the unfinished segment, not yet written
        self._held: "list[bytes]" = []
        self._line_tagged = False  # the line since the last \n shows the prefix already
        self._seg_tagged = False  # the segment since the last \n or \r was written in part, prefix included

    def feed(self, data: bytes) -> bytes:
        end = max(data.rfind(b"\n"), data.rfind(b"\r")) + 1
        if not end:
            if data:
                self._held.append(data)
                self.held += len(data)
            return b""
        if self._held:
            self._held.append(data[:end])
            text = b"".join(self._held)
        else:
            text = data[:end]
        rest = data[end:]
        self._held = [rest] if rest else []
        self.held = len(rest)
        return self._segments(text)

    def finish(self) -> bytes:
        """The unfinished segment, prefixed unless its start was written already."""
        if not self.held:
            return b""
        text = b"".join(self._held)
        self._held, self.held = [], 0
        out = text if self._seg_tagged else self.prefix + text
        self._seg_tagged = self._line_tagged = True
        return out

    def _segments(self, text: bytes) -> bytes:
        # ``text`` ends in \n or \r. The prefix goes before a segment that has text, or before an
        # empty line that shows no prefix yet; never twice into one segment.
        prefix = self.prefix
        if b"\r" not in text:  # the common case: whole lines, one pass in C
            first = not self._seg_tagged and (not self._line_tagged or text[0] != 10)
            self._line_tagged = self._seg_tagged = False
            return (prefix if first else b"") + text[:-1].replace(b"\n", b"\n" + prefix) + b"\n"
        out: "list[bytes]" = []
        lines = text.split(b"\n")
        tail = lines.pop()  # after the last \n: segments ending in \r, or nothing
        for line in lines:
            self._line(line, True, out)
        if tail:
            self._line(tail[:-1], False, out)
        return b"".join(out)

    def _line(self, line: bytes, newline: bool, out: "list[bytes]") -> None:
        # ``line``: segments separated by \r; the last ends in \n (``newline``) or \r.
        segs = line.split(b"\r")
        last = len(segs) - 1
        for i, seg in enumerate(segs):
            nl = newline and i == last
            if not self._seg_tagged and (seg or (nl and not self._line_tagged)):
                out.append(self.prefix)
                self._line_tagged = True
            out.append(seg)
            out.append(b"\n" if nl else b"\r")
            self._seg_tagged = False
            if nl:
                self._line_tagged = False


# -- the drainer: runs in its own process (or, as a fallback, in a thread of the job) ---------------
def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:  # someone set O_NONBLOCK on a shared terminal: wait, as a writer would
            waiter = select.poll()
            waiter.register(fd, select.POLLOUT)
            waiter.poll(1000)


class _NodeLock:
    """printflock's node-wide flock, taken by the drainer process for each write."""

    def __init__(self, path: str) -> None:
        self.fd = -1
        if path:
            try:
                self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except OSError:
                pass

    def write(self, fd: int, data: bytes) -> None:
        locked = False
        if self.fd >= 0 and fcntl is not None:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX)
                locked = True
            except OSError:  # no flock on this file system: whole writes without it
                os.close(self.fd)
                self.fd = -1
        try:
            _write_all(fd, data)
        finally:
            if locked:
                fcntl.flock(self.fd, fcntl.LOCK_UN)


class _Pipe:
    __slots__ = ("fd", "out", "prefixer", "last", "broken")

    def __init__(self, fd: int, out: int, prefix: bytes) -> None:
        self.fd = fd  # read end
        self.out = out  # the original descriptor
        self.prefixer = Prefixer(prefix)
        self.last = 0.0  # when data last came
        self.broken = False  # ``out`` refused a write: drop what comes, keep draining


class _Drainer:
    """Reads the pipes, writes prefixed segments to the original descriptors, until every pipe is
    at EOF. ``ctl`` (a socket) carries the job's flush request ``F``, answered ``D`` once all that
    was in the pipes is written; its EOF means the job has gone or restored its descriptors."""

    def __init__(self, pipes: "list[tuple[int, int]]", prefix: bytes, idle_flush: float, ctl: int,
                 write: "Callable[[int, bytes], None]") -> None:
        self.pipes = {r: _Pipe(r, out, prefix) for r, out in pipes}
        self.idle_flush = idle_flush
        self.ctl = ctl
        self.write = write

    def run(self) -> None:
        try:
            self._loop()
        except BaseException:
            self._raw()
        finally:
            for fd in [p.fd for p in self.pipes.values()] + [p.out for p in self.pipes.values()] + [self.ctl]:
                try:
                    if fd >= 0:
                        os.close(fd)
                except OSError:
                    pass

    def _loop(self) -> None:
        poller = select.poll()
        for fd in self.pipes:
            os.set_blocking(fd, False)
            poller.register(fd, select.POLLIN)
        if self.ctl >= 0:
            os.set_blocking(self.ctl, False)
            poller.register(self.ctl, select.POLLIN)
        live = dict(self.pipes)
        woke = 0.0
        while live:
            events = poller.poll(self._timeout_ms(live))
            small = None
            for fd, _ in events:
                if fd == self.ctl:
                    self._control(poller)
                elif fd in live:
                    got = self._pump(live[fd])
                    if got < 0:
                        poller.unregister(fd)
                        del live[fd]
                    elif 0 < got < COALESCE_BELOW:
                        small = live[fd] if small is None else False
            self._flush_idle(live)
            now = time.monotonic()
            if small and now - woke < COALESCE_WITHIN and all(
                    p is small or now - p.last > QUIET for p in live.values()):
                # Tiny writes in quick succession on one pipe alone (a progress bar redrawn in a
                # tight loop): let a few gather rather than wake for each. Never while another
                # pipe is active, whose order against this one it would blur.
                time.sleep(COALESCE_FOR)
            woke = now

    def _timeout_ms(self, live: "dict[int, _Pipe]") -> "int | None":
        due = [p.last + self.idle_flush for p in live.values() if p.prefixer.held]
        if not due:
            return None
        return max(0, int((min(due) - time.monotonic()) * 1000) + 1)

    def _flush_idle(self, live: "dict[int, _Pipe]") -> None:
        now = time.monotonic()
        for p in live.values():
            if p.prefixer.held and now - p.last >= self.idle_flush:
                self._emit(p, p.prefixer.finish())

    def _pump(self, p: _Pipe) -> int:
        """One read of ``p``: the bytes read, -1 at EOF."""
        try:
            data = os.read(p.fd, READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return 0
        if not data:
            self._emit(p, p.prefixer.finish())
            return -1
        p.last = time.monotonic()
        out = p.prefixer.feed(data)
        if p.prefixer.held > MAX_HELD:
            out += p.prefixer.finish()
        if out:
            self._emit(p, out)
        return len(data)

    def _control(self, poller: "select.poll") -> None:
        try:
            msg = os.read(self.ctl, 64)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            msg = b""
        if b"F" in msg:
            # Everything the job wrote before asking is in the pipes now; take it all (bounded:
            # children may write on without pause), and the held segments too.
            for p in self.pipes.values():
                budget = 4 * PIPE_SIZE
                while budget > 0:
                    try:
                        data = os.read(p.fd, READ_SIZE)
                    except (BlockingIOError, InterruptedError, OSError):
                        break
                    if not data:
                        break
                    budget -= len(data)
                    self._emit(p, p.prefixer.feed(data))
                self._emit(p, p.prefixer.finish())
            try:
                os.write(self.ctl, b"D")
            except OSError:
                pass
        if not msg:
            poller.unregister(self.ctl)
            os.close(self.ctl)
            self.ctl = -1
            for p in self.pipes.values():  # the job is gone: its last words need no idle wait
                self._emit(p, p.prefixer.finish())

    def _emit(self, p: _Pipe, data: bytes) -> None:
        if data and not p.broken:
            try:
                self.write(p.out, data)
            except OSError:
                p.broken = True

    def _raw(self) -> None:
        # Something unforeseen failed: pass the bytes on unprefixed, and never stop reading, so
        # that no writer blocks on a full pipe.
        live = dict(self.pipes)
        poller = select.poll()
        for fd in live:
            poller.register(fd, select.POLLIN)
        while live:
            try:
                ready = [fd for fd, _ in poller.poll()]
            except InterruptedError:
                continue
            except BaseException:
                ready = list(live)
                time.sleep(0.01)
            for fd in ready:
                try:
                    data = os.read(fd, READ_SIZE)
                except (BlockingIOError, InterruptedError):
                    continue
                except BaseException:
                    data = b""
                if not data:
                    live.pop(fd, None)
                    try:
                        poller.unregister(fd)
                    except BaseException:
                        pass
                    continue
                try:
                    _write_all(live[fd].out, data)
                except BaseException:
                    pass


# The drainer process: a bare interpreter (no site: ~20 ms less) that loads this file by path (its
# cached bytecode where there is one), so it needs neither hangdoc on sys.path nor the job's working
# directory; importlib.machinery is loaded at startup anyway (importlib.util would add ~3 ms). The
# command line names it: hangdoc_prefix_drainer.
_BOOT = ("import sys, importlib.machinery as m; p = sys.argv[1]; "
         "l = (m.SourcelessFileLoader if p.endswith('.pyc') else m.SourceFileLoader)('hangdoc_prefix_drainer', p); "
         "g = {'__name__': l.name, '__file__': p}; exec(l.get_code(l.name), g); g['_drain_main'](sys.argv[2:])")


def _drain_main(argv: "list[str]") -> None:
    """The drainer process: ``ctl lock_path idle_flush prefix_hex read_fd:out_fd...``."""
    try:
        import _signal as signal  # `signal` would import enum: ~3 ms
    except ImportError:
        import signal  # type: ignore[no-redef]
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2"):
        # Ctrl-C, Ctrl-\ and a launcher's SIGTERM go to the job's whole process group, a dump
        # signal sent by name (pkill -USR1 python) may reach it too: the drainer must stay to write
        # the job's last words (its KeyboardInterrupt traceback) and leaves at EOF.
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    # Fork once more and let the first child exit at once: the job reaps it now, and the drainer
    # is nobody's child (no zombie in the job, not killed by a job that kills its children at exit),
    # still in the job's process group, so job control and kill-the-group reach it.
    try:
        if os.fork():
            os._exit(0)
    except OSError:
        pass
    try:
        os.chdir("/")  # not to keep the job's directory busy (an unmount) while children write on
    except OSError:
        pass
    ctl = int(argv[0])
    pipes = [(int(r), int(o)) for r, o in (a.split(":") for a in argv[4:])]
    drainer = _Drainer(pipes, bytes.fromhex(argv[3]), float(argv[2]), ctl, _NodeLock(argv[1]).write)
    try:
        os.write(ctl, b"R")
    except OSError:
        pass
    drainer.run()
    os._exit(0)


# -- the job's side ---------------------------------------------------------------------------------
class _NoDrainer(Exception):
    pass


def _python_ok(exe: str) -> bool:
    name = os.path.basename(exe)
    return bool(exe) and name.startswith(("python", "pypy")) and os.access(exe, os.X_OK)


def _spawn(pipes: "list[tuple[int, int]]", prefix: bytes, idle_flush: float, lock_path: str):
    """Start the drainer process; returns the job's end of the control socket once it is ready."""
    import socket
    import subprocess

    exe = sys.executable or ""
    source = os.path.abspath(__file__) if "__file__" in globals() else ""
    if not _python_ok(exe):
        raise _NoDrainer(f"no python to start the drainer process with (sys.executable={exe!r})")
    if not os.path.isfile(source):
        raise _NoDrainer(f"no file to start the drainer process from ({source!r})")
    ours, theirs = socket.socketpair()
    fd = theirs.fileno()
    args = [exe, "-S", "-c", _BOOT, source, str(fd), lock_path, repr(idle_flush), prefix.hex()]
    args += [f"{r}:{o}" for r, o in pipes]
    try:
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, close_fds=True,
                                pass_fds=[fd] + [x for pair in pipes for x in pair], env=_drainer_env())
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
    def __init__(self, prefix: bytes, fds: "list[int]", idle_flush: float, mode: str) -> None:
        import threading

        from hangdoc.runtime.printflock import PREFIX_PIPES_ENV

        self.pid = os.getpid()
        self.fds = fds
        self.saved: "dict[int, int]" = {}
        self.reads: "dict[int, int]" = {}
        self.writes: "dict[int, int]" = {}
        self.pipe_ids: "dict[int, str]" = {}
        self.saved_ids: "dict[int, str]" = {}
        self.restored = False
        self.sock = None
        self.flushed = threading.Event()
        self.watcher: "threading.Thread | None" = None
        self.line_buffering: "dict[int, bool]" = {}
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
            os.dup2(self.writes[fd], fd)
            os.close(self.writes[fd])
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
        for fd in self.fds:
            r, w = os.pipe()
            self.reads[fd], self.writes[fd] = r, w
            try:
                fcntl.fcntl(w, getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_SIZE)
            except Exception:
                pass
            self.pipe_ids[fd] = _file_id(w)

    def _start_drainer(self, mode: str, prefix: bytes, idle_flush: float) -> str:
        import socket
        import threading
        import warnings

        from hangdoc.runtime import printflock

        if mode == "process":
            pipes = [(self.reads[fd], self.saved[fd]) for fd in self.fds]
            lock = "" if printflock._disabled else printflock.lock_path()
            try:
                self.sock = _spawn(pipes, prefix, idle_flush, lock)
            except _NoDrainer as e:
                warnings.warn(f"hangdoc.prefix_output: {e}; prefixing in a thread of this process instead (output "
                              "still in the pipe when the process dies is lost)", RuntimeWarning, stacklevel=5)
                # Fresh pipes: a drainer that starts after all must not read the thread's share.
                self._make_pipes()
            else:
                for fd in self.fds:
                    os.close(self.reads.pop(fd))
                self.watcher = threading.Thread(target=self._watch, name="hangdoc-prefix-watch", daemon=True)
                self.watcher.start()
                return "process"
        self.sock, theirs = socket.socketpair()
        pipes = [(self.reads[fd], os.dup(self.saved[fd])) for fd in self.fds]
        drainer = _Drainer(pipes, prefix, idle_flush, theirs.detach(), _locked_write)
        reads = [r for r, _ in pipes]
        self.reads.clear()  # the thread owns them now
        if hasattr(os, "register_at_fork"):
            # A forked child must not keep the read ends: once this process and its thread are
            # gone, the child would block on a full pipe instead of meeting EPIPE.
            os.register_at_fork(after_in_child=lambda: [_close(r) for r in reads] if _active is self else None)
        threading.Thread(target=drainer.run, name="hangdoc-prefix", daemon=True).start()
        return "thread"

    def _watch(self) -> None:
        # The drainer process answers flush requests here; EOF means it is gone.
        sock = self.sock
        while True:
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
        self.flushed.set()
        if not self.restored:
            self._drainer_gone()

    def _drainer_gone(self) -> None:
        # Killed (SIGKILL) while the job runs: give the job its descriptors back before a write
        # meets a pipe without a reader.
        global _active
        with _lock:
            if self.restored or os.getpid() != self.pid:
                return
            self.restored = True
            if _active is self:
                _active = None
        moved = False
        for fd, saved in self.saved.items():
            if self._ours(fd) and self._saved_intact(fd):
                try:
                    os.dup2(saved, fd)
                    moved = True
                except OSError:
                    pass
        if moved:
            try:
                os.write(2, b"hangdoc.prefix_output: the drainer process is gone; output is no longer prefixed\n")
            except OSError:
                pass

    def _ours(self, fd: int) -> bool:
        return _file_id(fd) == self.pipe_ids[fd]

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
        self._ask_flush(timeout)
        self._close_ctl()
        for fd, stream in ((1, sys.stdout), (2, sys.stderr)):
            if fd in self.line_buffering and stream is not None:
                try:
                    stream.reconfigure(line_buffering=self.line_buffering[fd])
                except (AttributeError, ValueError, OSError):
                    pass

    def _ask_flush(self, timeout: float) -> None:
        # Children (DataLoader workers, a compile pool) may keep the pipes open, so EOF can be far
        # off: wait only until what this process wrote is forwarded, and never long.
        self.flushed.clear()
        try:
            self.sock.sendall(b"F")
        except OSError:
            return
        if self.watcher is not None:
            self.flushed.wait(timeout)
            return
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self.sock.settimeout(left)
            try:
                msg = self.sock.recv(64)
            except OSError:
                return
            if not msg or b"D" in msg:
                return

    def _close_ctl(self) -> None:
        import socket

        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the watcher; the drainer sees EOF
        except OSError:
            pass
        if self.watcher is not None:
            self.watcher.join(1.0)
        self.sock.close()


def _file_id(fd: int) -> str:
    try:
        st = os.fstat(fd)
    except OSError:
        return ""
    return f"{st.st_dev}:{st.st_ino}"


def _locked_write(fd: int, data: bytes) -> None:
    from hangdoc.runtime.printflock import locked

    with locked():  # other ranks' prefixers write to the same console
        _write_all(fd, data)


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
