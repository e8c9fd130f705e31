"""The drainer: prefixes each line read from the job's pipes and writes it to the original
descriptor, under a lock per destination, never blocking on a write (a stalled reader of one
destination holds up no other). :mod:`hangdoc.runtime.prefix` runs it in a process of its own (or,
where none can be started, in a thread of the job).

This file is the drainer process's program: it is loaded by path in a bare interpreter (``-S``,
no site), so it imports nothing outside the standard library at module level (examples: see
:class:`Prefixer`).
"""

from __future__ import annotations

import os
import select
import time

try:
    import fcntl
except ImportError:  # not Linux: no flock, default pipe size
    fcntl = None  # type: ignore[assignment]

PIPE_SIZE = 1 << 20  # room for C++ threads' bursts (NCCL's timeout lines) while the drainer writes
READ_SIZE = 1 << 16
MAX_HELD = 1 << 16  # an unfinished segment longer than this is written as it is
# A pipe that brings reads of < COALESCE_BELOW bytes less than COALESCE_WITHIN s apart, while the
# other has been QUIET s, is left to gather for COALESCE_FOR s: one wake-up per tqdm redraw cost the
# drainer ~6 us, and the job as much where the two share a core.
COALESCE_BELOW, COALESCE_WITHIN, COALESCE_FOR, QUIET = 1024, 0.001, 0.0003, 0.05


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
# A destination (terminal, log file, pipe to tee) whose reader stalls must stall nobody else: not the
# other destination of this job, not another job on the node that writes elsewhere. So writes never
# block (a pending buffer per destination, POLLOUT in the poll loop), the lock that keeps ranks'
# lines whole is per destination, is never waited for long and never held across a blocking write.
LOCK_WAIT = 0.25  # the most a drainer waits for another's lock on a destination, then writes without it
LOCK_SKIP = 1.0  # after such a wait, the lock is not tried for this long (its holder may be stopped)
LOCK_HOLD = 0.1  # the most a drainer keeps a destination's lock while a line is written only in part
MAX_PENDING = 1 << 20  # a destination's backlog beyond which its pipes are left unread: the job's
#                        writes block on the full pipe, as they would on the stalled destination itself


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:  # someone set O_NONBLOCK on a shared terminal: wait, as a writer would
            waiter = select.poll()
            waiter.register(fd, select.POLLOUT)
            waiter.poll(1000)


def dest_lock_path(base: str, dev: int, ino: int) -> str:
    """The lock of one destination: printflock's lock file name plus the destination's identity, so
    ranks that share a terminal or a log file share a lock, and unrelated destinations never do."""
    stem = base[:-5] if base.endswith(".lock") else base
    return f"{stem}-{dev}-{ino}.lock"


class _Dest:
    """One original descriptor: the bytes waiting to go there, how to write them without blocking,
    and its lock."""

    __slots__ = ("out", "fd", "own_fd", "sock", "pending", "broken", "lock_fd", "locked", "lock_since",
                 "wait_since", "skip_until", "at_line_end", "kind", "lock_path")

    def __init__(self, out: int, lock_base: str) -> None:
        import stat

        self.out = out
        self.fd = out  # what poll waits on for POLLOUT
        self.own_fd = -1
        self.sock = None
        self.pending = bytearray()
        self.broken = False
        self.lock_fd = -1
        self.locked = False
        self.lock_since = self.wait_since = self.skip_until = 0.0
        self.at_line_end = True
        try:
            st = os.fstat(out)
        except OSError:
            st = None
        mode = st.st_mode if st is not None else stat.S_IFREG
        if stat.S_ISREG(mode) or stat.S_ISBLK(mode):
            self.kind = "file"  # never waits for a reader: plain writes
        elif stat.S_ISSOCK(mode):
            import socket

            dup = -1
            try:
                dup = os.dup(out)
                self.sock = socket.socket(fileno=dup)
                self.fd = self.sock.fileno()
                self.kind = "sock"  # send(MSG_DONTWAIT): no flag of the shared socket is touched
            except OSError:
                if dup >= 0 and self.sock is None:
                    os.close(dup)
                self.kind = "poll"
        else:
            # A pipe or a terminal: an open file description of our own, non-blocking, so that the
            # description shared with the job and other ranks keeps its flags.
            try:
                self.own_fd = os.open(f"/proc/self/fd/{out}",
                                      os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
                self.fd = self.own_fd
                self.kind = "own"
            except OSError:  # no /proc, or a pipe without reader (its first write says EPIPE)
                self.kind = "poll"
        self.lock_path = ""
        if lock_base and fcntl is not None and st is not None:
            self.lock_path = dest_lock_path(lock_base, st.st_dev, st.st_ino)
            self.lock_fd = _open_lock(self.lock_path)

    def send(self, data: bytearray) -> int:
        """Write what can be written now; raises OSError (BrokenPipeError: the reader is gone)."""
        if self.kind == "own":
            return os.write(self.own_fd, data)
        if self.kind == "file":
            return os.write(self.out, data)
        if self.kind == "sock":
            import socket

            return self.sock.send(data, socket.MSG_DONTWAIT)
        waiter = select.poll()  # poll: at least PIPE_BUF bytes fit once POLLOUT says so
        waiter.register(self.out, select.POLLOUT)
        if not waiter.poll(0):
            return 0
        return os.write(self.out, data[:4096])

    def unlock(self) -> None:
        if self.locked:
            self.locked = False
            try:
                fcntl.flock(self.lock_fd, fcntl.LOCK_UN)
            except OSError:
                pass

    def close(self) -> None:
        self.unlock()
        if self.lock_fd >= 0:
            # The last drainer writing there removes the lock file (one per destination ever
            # written to would pile up in /dev/shm): only while it holds it, so a drainer that has it
            # open already sees it unlinked once it gets it (st_nlink 0) and opens the new one.
            try:
                fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                st = os.stat(self.lock_path, follow_symlinks=False)
                mine = os.fstat(self.lock_fd)
                if (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
                    os.unlink(self.lock_path)
            except OSError:
                pass
        for fd in (self.own_fd, self.lock_fd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        if self.sock is not None:
            self.sock.close()


def _open_lock(path: str) -> int:
    """The lock file of a destination in a directory everyone writes to (``/dev/shm``), or -1: never
    through a symlink, and only a regular file of this user's (another's could be held for ever).
    (printflock.open_lock's rule; the drainer process cannot import hangdoc.)"""
    import stat

    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY, 0o600)
    except OSError:
        return -1
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
            return fd
    except OSError:
        pass
    os.close(fd)
    return -1


def _awaits_lock(d: _Dest, now: float) -> bool:
    # Waiting for another drainer's lock (retried every few ms), not for the destination to take
    # more. Once the wait is given up (skip_until), the destination is polled like any other:
    # retrying every few ms then would spin for as long as it is stalled.
    return bool(d.wait_since) and not d.locked and now >= d.skip_until


class _Pipe:
    __slots__ = ("index", "fd", "dest", "prefixer", "last")

    def __init__(self, index: int, fd: int, dest: _Dest, prefix: bytes) -> None:
        self.index = index  # the job's number for this pipe (control messages name it)
        self.fd = fd  # read end
        self.dest = dest
        self.prefixer = Prefixer(prefix)
        self.last = 0.0  # when data last came


class _Drainer:
    """Reads the pipes, writes prefixed segments to the original descriptors, until every pipe is
    at EOF and everything read is written. ``ctl`` (a socket) carries the job's flush request ``F``,
    answered ``D`` once all that was in the pipes is written, and ``E<index>\\n`` to the job when a
    pipe's destination has no reader any more (EPIPE): the drainer closes its read end, the job its
    own, so the job's writers meet EPIPE as they would without hangdoc. Its EOF means the job has
    gone or restored its descriptors."""

    def __init__(self, pipes: "list[tuple[int, int, int]]", prefix: bytes, idle_flush: float, ctl: int,
                 lock_base: str) -> None:
        self.dests: "dict[int, _Dest]" = {}  # by original descriptor
        self.pipes: "dict[int, _Pipe]" = {}  # by read end
        for index, r, out in pipes:
            dest = self.dests.get(out)
            if dest is None:
                dest = self.dests[out] = _Dest(out, lock_base)
            self.pipes[r] = _Pipe(index, r, dest, prefix)
        self.idle_flush = idle_flush
        self.ctl = ctl
        self.live: "dict[int, _Pipe]" = {}
        self.flush_asked = False
        self.masks: "dict[int, int]" = {}

    def run(self) -> None:
        try:
            self._loop()
        except BaseException:
            self._raw()
        finally:
            for fd in [p.fd for p in self.pipes.values()] + list(self.dests) + [self.ctl]:
                try:
                    if fd >= 0:
                        os.close(fd)
                except OSError:
                    pass
            for d in self.dests.values():
                d.close()

    def _loop(self) -> None:
        poller = self.poller = select.poll()
        for fd in self.pipes:
            os.set_blocking(fd, False)
        if self.ctl >= 0:
            os.set_blocking(self.ctl, False)
            poller.register(self.ctl, select.POLLIN)
        live = self.live = dict(self.pipes)
        woke = 0.0
        while live or any(d.pending and not d.broken for d in self.dests.values()):
            self._register()
            events = poller.poll(self._timeout_ms())
            small = None
            for fd, _ in events:
                if fd == self.ctl:
                    self._control()
                elif fd in live:
                    got = self._pump(live[fd])
                    if got < 0:
                        self._drop(live[fd])
                    elif 0 < got < COALESCE_BELOW:
                        small = live[fd] if small is None else False
            self._flush_idle()
            now = time.monotonic()
            self._write_out(now)
            if small and now - woke < COALESCE_WITHIN and all(
                    p is small or now - p.last > QUIET for p in live.values()):
                # Tiny writes in quick succession on one pipe alone (a progress bar redrawn in a
                # tight loop): let a few gather rather than wake for each. Never while another
                # pipe is active, whose order against this one it would blur.
                time.sleep(COALESCE_FOR)
            woke = now

    def _register(self) -> None:
        # Read a pipe unless its destination's backlog is full; wait for a destination to take
        # more only while it has a backlog and is not waiting for its lock.
        want: "dict[int, int]" = {}
        for fd, p in self.live.items():
            if len(p.dest.pending) < MAX_PENDING:
                want[fd] = select.POLLIN
        for d in self.dests.values():
            if d.pending and not d.broken and d.kind != "file" and not _awaits_lock(d, time.monotonic()):
                want[d.fd] = want.get(d.fd, 0) | select.POLLOUT
        for fd in [fd for fd in self.masks if fd not in want]:
            self.poller.unregister(fd)
            del self.masks[fd]
        for fd, mask in want.items():
            if self.masks.get(fd) != mask:
                self.poller.register(fd, mask)
                self.masks[fd] = mask

    def _timeout_ms(self) -> "int | None":
        now = time.monotonic()
        due = [p.last + self.idle_flush for p in self.live.values() if p.prefixer.held]
        for d in self.dests.values():
            if d.pending and not d.broken:
                if d.kind == "file" or _awaits_lock(d, now):
                    due.append(now + 0.002)  # retry the lock (or a write that was refused) soon
                elif d.locked:
                    due.append(d.lock_since + LOCK_HOLD)
        if not due:
            return None
        return max(0, int((min(due) - now) * 1000) + 1)

    def _flush_idle(self) -> None:
        now = time.monotonic()
        for p in self.live.values():
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

    def _drop(self, p: _Pipe) -> None:
        self.live.pop(p.fd, None)
        if p.fd in self.masks:
            self.poller.unregister(p.fd)
            del self.masks[p.fd]

    def _control(self) -> None:
        try:
            msg = os.read(self.ctl, 64)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            msg = b""
        if b"F" in msg:
            # Everything the job wrote before asking is in the pipes now; take it all (bounded:
            # children may write on without pause), and the held segments too; answer once written.
            for p in list(self.live.values()):
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
            self.flush_asked = True
        if not msg:
            self.poller.unregister(self.ctl)
            os.close(self.ctl)
            self.ctl = -1
            for p in self.live.values():  # the job is gone: its last words need no idle wait
                self._emit(p, p.prefixer.finish())

    def _emit(self, p: _Pipe, data: bytes) -> None:
        if data and not p.dest.broken:
            p.dest.pending += data

    def _write_out(self, now: float) -> None:
        for d in self.dests.values():
            if d.pending and not d.broken:
                self._write(d, now)
        if self.flush_asked and not any(d.pending and not d.broken for d in self.dests.values()):
            self.flush_asked = False
            self._tell(b"D")

    def _write(self, d: _Dest, now: float) -> None:
        if not d.locked and d.lock_fd >= 0 and now >= d.skip_until:
            try:
                fcntl.flock(d.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if not os.fstat(d.lock_fd).st_nlink:
                    # removed by the last drainer that wrote here (close): the new one is the lock now
                    os.close(d.lock_fd)
                    d.lock_fd = _open_lock(d.lock_path)
                    if d.lock_fd < 0:
                        raise OSError("no lock file")
                    fcntl.flock(d.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                d.locked, d.lock_since, d.wait_since = True, now, 0.0
            except BlockingIOError:
                if not d.wait_since:
                    d.wait_since = now
                if now - d.wait_since < LOCK_WAIT:
                    return  # its holder never blocks while holding it: try again in a moment
                d.skip_until = now + LOCK_SKIP  # held too long (a stopped process?): write without it
            except OSError:  # no flock on this file system: whole writes without it
                if d.lock_fd >= 0:
                    os.close(d.lock_fd)
                d.lock_fd = -1
        while d.pending:
            try:
                n = d.send(d.pending)
            except (BlockingIOError, InterruptedError):
                n = 0
            except BrokenPipeError:
                self._broken(d, epipe=True)
                return
            except OSError:  # EIO (a hung-up terminal), ENOSPC: drop what comes, keep draining
                self._broken(d, epipe=False)
                return
            if not n:
                break
            d.at_line_end = d.pending[n - 1] in (10, 13)
            del d.pending[:n]
        if not d.pending:
            d.wait_since = 0.0
        # Keep the lock while a line is written only in part (another rank's bytes would land in
        # its middle), but never long: others wait for it at most LOCK_WAIT.
        if d.locked and (not d.pending or d.at_line_end or now - d.lock_since >= LOCK_HOLD):
            d.unlock()

    def _broken(self, d: _Dest, epipe: bool) -> None:
        d.broken = True
        d.pending = bytearray()
        d.unlock()
        if not epipe:
            return
        # Nobody reads there any more: the pipes that go there get no reader either, so that the
        # job's (and its children's) writes meet EPIPE as they would without hangdoc.
        for p in list(self.live.values()):
            if p.dest is d:
                self._drop(p)
                try:
                    os.close(p.fd)
                except OSError:
                    pass
                p.fd = -1
                self._tell(b"E%d\n" % p.index)

    def _tell(self, msg: bytes) -> None:
        if self.ctl >= 0:
            try:
                os.write(self.ctl, msg)
            except OSError:
                pass

    def _raw(self) -> None:
        # Something unforeseen failed: pass the bytes on unprefixed, and never stop reading, so
        # that no writer blocks on a full pipe.
        live = {fd: p for fd, p in self.live.items() if p.fd >= 0} if self.live else {
            fd: p for fd, p in self.pipes.items() if p.fd >= 0}
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
                    _write_all(live[fd].dest.out, data)
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
    """The drainer process: ``ctl lock_base idle_flush prefix_hex index:read_fd:out_fd...``."""
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
    pipes = [(int(i), int(r), int(o)) for i, r, o in (a.split(":") for a in argv[4:])]
    drainer = _Drainer(pipes, bytes.fromhex(argv[3]), float(argv[2]), ctl, argv[1])
    try:
        os.write(ctl, b"R")
    except OSError:
        pass
    drainer.run()
    os._exit(0)
