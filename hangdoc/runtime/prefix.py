"""Rank-prefixed output: every line this process writes to stdout/stderr starts with ``[host:rank] ``.

It works at the file-descriptor level, so it covers ``print``, logging, warnings, tracebacks and
lines written by C extensions (NCCL, gloo, glog) straight to fd 1/2. Each of fd 1 and fd 2 is
replaced by a pipe; a daemon reader thread prefixes each complete line and writes it to the
original descriptor. The original descriptors are restored by the returned callable, and at exit.

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

Why it never blocks the job: the reader thread contains its own exceptions and, should it fail,
puts the original descriptor back and keeps draining the pipe, so writers never wait on a full
pipe. A partial line (no newline yet) is held until its newline comes; if nothing arrives for
``idle_flush`` seconds it is written as it is (the last words before a freeze matter more than a
tidy line), and its continuation is not prefixed again.
"""

from __future__ import annotations

import atexit
import os
import re
import select
import struct
import sys
import threading
import time
from typing import Callable, Dict, List, Optional

from hangdoc.runtime.identity import Identity, identity
from hangdoc.runtime.printflock import PREFIX_PIPES_ENV, locked_write

__all__ = ["prefix_output", "render_prefix", "DEFAULT_TEMPLATE", "active", "Prefixer"]

DEFAULT_TEMPLATE = "[{host}:{rank}] "
_NAME_RE = re.compile(r"\$\{(\w+)\}|\{(\w+)\}")

_lock = threading.Lock()
_active: Optional["_Session"] = None


def render_prefix(template: Optional[str], ident: Optional[Identity] = None, role_name: Optional[str] = None) -> str:
    """Expand ``template`` (default ``[{host}:{rank}] ``) for ``ident`` (default: this process)."""
    ident = ident or identity()
    values: Dict[str, str] = {
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

    return _NAME_RE.sub(sub, DEFAULT_TEMPLATE if template is None else template)


class Prefixer:
    """Turns a byte stream into prefixed lines; holds the partial last line.

        >>> p = Prefixer(b"[0] ")
        >>> p.feed(b"a\\nb") + p.feed(b"c\\n") + p.finish()
        b'[0] a\\n[0] bc\\n'
    """

    def __init__(self, prefix: bytes) -> None:
        self.prefix = prefix
        self.pending = b""
        self.mid_line = False  # a partial line was already written out with its prefix

    def feed(self, data: bytes) -> bytes:
        lines = (self.pending + data).split(b"\n")
        self.pending = lines.pop()
        if not lines:
            return b""
        out = [(b"" if (i == 0 and self.mid_line) else self.prefix) + line + b"\n" for i, line in enumerate(lines)]
        self.mid_line = False
        return b"".join(out)

    def finish(self) -> bytes:
        """Whatever partial line is held, prefixed unless its start was already written."""
        if not self.pending:
            return b""
        out = (b"" if self.mid_line else self.prefix) + self.pending
        self.pending = b""
        self.mid_line = True
        return out


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except InterruptedError:
            continue


def _unread(fd: int) -> int:
    """Bytes waiting in the pipe ``fd`` (-1 where that cannot be asked)."""
    try:
        import fcntl
        import termios

        return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
    except (ImportError, OSError):
        return -1


class _Stream:
    def __init__(self, fd: int, prefix: bytes, idle_flush: float) -> None:
        self.fd = fd
        self.saved = os.dup(fd)
        os.set_inheritable(self.saved, False)
        self.read_end, write_end = os.pipe()
        try:  # room for C++ threads' output (NCCL's timeout lines) while the reader waits for the GIL
            import fcntl

            fcntl.fcntl(write_end, getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
        except Exception:
            pass
        st = os.fstat(write_end)
        self.pipe_id = f"{st.st_dev}:{st.st_ino}"
        self.prefixer = Prefixer(prefix)
        self.idle_flush = idle_flush
        self.restored = False
        self.inflight = False  # the reader holds bytes it has read but not yet written
        os.dup2(write_end, fd)  # dup2 keeps fd inheritable, so child processes are prefixed too
        os.close(write_end)
        self.thread = threading.Thread(target=self._run, name=f"hangdoc-prefix-fd{fd}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while True:
                ready, _, _ = select.select([self.read_end], [], [], self.idle_flush)
                if not ready:
                    if self.prefixer.pending:
                        locked_write(self.saved, self.prefixer.finish())
                    continue
                self.inflight = True
                data = os.read(self.read_end, 1 << 16)
                if not data:
                    break
                out = self.prefixer.feed(data)
                if out:
                    # Under the print lock: other ranks' prefixers write to the same console, and
                    # a pipe keeps writes whole only up to PIPE_BUF bytes.
                    locked_write(self.saved, out)
                self.inflight = False
            locked_write(self.saved, self.prefixer.finish())
            self.inflight = False
        except BaseException:
            self._passthrough()

    def _passthrough(self) -> None:
        # Something failed (e.g. the original stream is gone): stop prefixing, keep the job running.
        try:
            if not self.restored:
                os.dup2(self.saved, self.fd)
        except OSError:
            pass
        while True:
            try:
                data = os.read(self.read_end, 1 << 16)
                if not data:
                    return
                try:
                    _write_all(self.saved, data)
                except OSError:
                    pass  # nowhere to write: drop it rather than block the writers
            except InterruptedError:
                continue
            except OSError:
                return

    def restore(self, timeout: float) -> None:
        if self.restored:
            return
        self.restored = True
        # Pointing fd back at the original closes this process's write end of the pipe; the reader
        # sees EOF once child processes that inherited it are gone too, or gives up after timeout.
        os.dup2(self.saved, self.fd)
        deadline = time.monotonic() + timeout
        while self.thread.is_alive() and time.monotonic() < deadline:
            self.thread.join(0.01)
            # A child process (a DataLoader worker, a compile pool) may keep the pipe open, so EOF
            # can be far off: once what this process wrote is forwarded, stop waiting.
            if not self.inflight and not self.prefixer.pending and _unread(self.read_end) == 0:
                break
        if not self.thread.is_alive():
            os.close(self.read_end)
            os.close(self.saved)


class _Session:
    def __init__(self, prefix: bytes, fds: List[int], idle_flush: float) -> None:
        self.streams: List[_Stream] = []
        self.line_buffering: Dict[int, bool] = {}
        _flush_python_streams()
        try:
            for fd in fds:
                self.streams.append(_Stream(fd, prefix, idle_flush))
        except OSError:
            for s in self.streams:
                s.restore(0.5)
            raise
        self.saved_env = os.environ.get(PREFIX_PIPES_ENV)
        pipes = [p for p in (self.saved_env or "").split(",") if p] + [s.pipe_id for s in self.streams]
        os.environ[PREFIX_PIPES_ENV] = ",".join(pipes)
        # Line-buffer Python's own streams so the last lines before a freeze reach the reader.
        for fd, stream in ((1, sys.stdout), (2, sys.stderr)):
            if fd in fds and stream is not None and hasattr(stream, "reconfigure"):
                try:
                    self.line_buffering[fd] = stream.line_buffering
                    stream.reconfigure(line_buffering=True)
                except (AttributeError, ValueError, OSError):
                    pass

    def restore(self, timeout: float = 2.0) -> None:
        _flush_python_streams()
        if self.saved_env is None:
            os.environ.pop(PREFIX_PIPES_ENV, None)
        else:
            os.environ[PREFIX_PIPES_ENV] = self.saved_env
        for s in self.streams:
            try:
                s.restore(timeout)
            except OSError:
                pass
        for fd, stream in ((1, sys.stdout), (2, sys.stderr)):
            if fd in self.line_buffering and stream is not None:
                try:
                    stream.reconfigure(line_buffering=self.line_buffering[fd])
                except (AttributeError, ValueError, OSError):
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


def prefix_output(template: Optional[str] = None, fds=(1, 2), idle_flush: float = 0.5) -> Callable[[], None]:
    """Prefix every line written to ``fds`` (stdout and stderr) with the rendered ``template``.

    ``template`` defaults to ``$HANGDOC_PREFIX_TEMPLATE`` or ``[{host}:{rank}] ``. Returns a callable
    that restores the original descriptors (also run at exit). Calling it again while active
    changes nothing and returns a no-op; where descriptors cannot be replaced, nothing happens.

        import hangdoc
        restore = hangdoc.prefix_output("[${role_name}${rank}] ")
        print("hello")            # -> "[default0] hello"
        restore()
    """
    global _active
    with _lock:
        if _active is not None:
            return lambda: None
        template = template if template is not None else os.environ.get("HANGDOC_PREFIX_TEMPLATE")
        prefix = render_prefix(template).encode("utf-8", "replace")
        try:
            session = _Session(prefix, list(fds), idle_flush)
        except OSError as e:  # no fd 1 (daemonised), fd limit: run unprefixed
            import warnings

            warnings.warn(f"hangdoc.prefix_output: not prefixing ({e})", RuntimeWarning, stacklevel=2)
            return lambda: None
        _active = session

    def restore() -> None:
        global _active
        with _lock:
            if _active is not session:
                return
            _active = None
        session.restore()
        try:
            atexit.unregister(restore)
        except Exception:
            pass

    atexit.register(restore)
    return restore
