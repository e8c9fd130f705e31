"""``hangdoc dump``: take the stacks of every Python process on this node, tagged with its rank.

The py-spy recipe of the big training jobs, done properly: find the processes (the current user's
Python processes, or one launcher's process tree), dump each with py-spy (a subprocess with an
argument list, never a shell, with a timeout per process), and put a ``hangdoc.tags`` line in front
of each dump naming host, pid, ppid, rank, local rank and world size as read from
``/proc/PID/environ``. A process that cannot be dumped is not skipped: it gets a tag line with
``status=unresponsive reason=...`` so the report can say so. Fallbacks, in order: py-spy; the
watchdog signal of a hangdoc-wrapped process (its faulthandler writes into a file we read back);
gdb (``py-bt``, else ``bt``).

    >>> import os
    >>> me = describe(os.getpid())
    >>> me.pid == os.getpid() and me.is_python
    True
    >>> tag_for(me).startswith("# hangdoc process host=")
    True
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence

from hangdoc.runtime.identity import _LOCAL_RANK_VARS, _RANK_VARS, _WORLD_VARS, _first_int, short_hostname
from hangdoc.tags import format_tag

#: seconds py-spy / gdb may take on one process
DEFAULT_TIMEOUT = 10.0
#: seconds to wait for a hangdoc-wrapped process's faulthandler to write after its signal
SIGNAL_WAIT = 3.0

_SIGNAL_FILE = re.compile(r"hangdoc-signal-(\d+)-(SIG\w+)-")
_LAUNCHERS = ("torch.distributed.run", "torchrun", "torch.distributed.launch", "deepspeed.launcher", "accelerate")


@dataclass
class ProcessInfo:
    """What /proc says about one process."""

    pid: int
    ppid: int = 0
    uid: int = -1
    state: str = "?"
    cmdline: List[str] = field(default_factory=list)
    environ: Dict[str, str] = field(default_factory=dict)
    exe: str = ""

    @property
    def is_python(self) -> bool:
        names = [os.path.basename(self.exe)] + [os.path.basename(a) for a in self.cmdline[:1]]
        return any(re.match(r"^(python|pypy)[\d.]*m?$", n or "") for n in names)

    @property
    def role(self) -> str:
        cmd = " ".join(self.cmdline)
        if any(x in cmd for x in _LAUNCHERS):
            return "launcher"
        if "from multiprocessing" in cmd or "multiprocessing.spawn" in cmd or "multiprocessing.forkserver" in cmd:
            return "dataloader-worker"
        return ""


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def describe(pid: int) -> Optional[ProcessInfo]:
    """/proc facts about ``pid``; None when it is gone. Unreadable parts are left empty."""
    base = f"/proc/{pid}"
    try:
        stat = _read(f"{base}/stat").decode("utf-8", "replace")
        st_uid = os.stat(base).st_uid
    except OSError:
        return None
    # the command name in (...) may itself contain spaces and parentheses
    rest = stat[stat.rfind(")") + 2:].split()
    info = ProcessInfo(pid=pid, ppid=int(rest[1]) if len(rest) > 1 else 0, uid=st_uid, state=rest[0] if rest else "?")
    try:
        info.cmdline = [a.decode("utf-8", "replace") for a in _read(f"{base}/cmdline").split(b"\0") if a]
    except OSError:
        pass
    try:
        for item in _read(f"{base}/environ").split(b"\0"):
            k, sep, v = item.partition(b"=")
            if sep:
                info.environ[k.decode("utf-8", "replace")] = v.decode("utf-8", "replace")
    except OSError:
        pass
    try:
        info.exe = os.readlink(f"{base}/exe")
    except OSError:
        pass
    return info


def all_pids() -> List[int]:
    return sorted(int(n) for n in os.listdir("/proc") if n.isdigit())


def tree(root: int, infos: Dict[int, ProcessInfo]) -> List[int]:
    """``root`` and all its descendants among ``infos``."""
    children: Dict[int, List[int]] = {}
    for info in infos.values():
        children.setdefault(info.ppid, []).append(info.pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in out:
            continue
        out.append(pid)
        todo.extend(children.get(pid, []))
    return sorted(out)


def find_processes(launcher_pid: Optional[int] = None, all_users: bool = False) -> List[ProcessInfo]:
    """The Python processes to dump: this user's on this node, or the launcher's tree.

    hangdoc dump itself and its ancestors (the shell, srun) are left out.
    """
    infos = {pid: info for pid in all_pids() for info in [describe(pid)] if info is not None}
    me = os.getpid()
    ancestors = set()
    pid = me
    while pid > 1 and pid not in ancestors:
        ancestors.add(pid)
        pid = infos[pid].ppid if pid in infos else 0
    if launcher_pid is not None:
        if launcher_pid not in infos:
            raise LookupError(f"no process {launcher_pid}")
        pids = tree(launcher_pid, infos)
    else:
        uid = os.getuid()
        pids = [p for p, i in infos.items() if all_users or i.uid == uid]
    return [infos[p] for p in pids if p in infos and p not in ancestors and infos[p].is_python]


def tag_for(info: ProcessInfo, host: Optional[str] = None, parent: Optional[ProcessInfo] = None, **extra: object) -> str:
    """The tag line of one process: identity from its environment, role from its command line.

    A child of a rank with the rank's own RANK (a forked DataLoader worker inherits the
    environment) is that rank's worker, not a second process of the same rank.
    """
    env = info.environ
    rank = _first_int(env, _RANK_VARS)
    role = info.role
    parent_rank = None
    if parent is not None and parent.is_python and rank is not None and parent.role != "launcher" \
            and _first_int(parent.environ, _RANK_VARS) == rank:
        role, parent_rank, rank = "dataloader-worker", rank, None
    fields: Dict[str, object] = dict(
        host=host or env.get("HANGDOC_HOST") or short_hostname(),
        pid=info.pid,
        ppid=info.ppid,
        rank=None if role == "launcher" else rank,
        local_rank=None if role in ("launcher", "dataloader-worker") else _first_int(env, _LOCAL_RANK_VARS),
        world_size=_first_int(env, _WORLD_VARS),
        parent_rank=parent_rank,
    )
    if role:
        fields["role"] = role
    if env.get("SLURM_JOB_ID"):
        fields["slurm_job"] = env["SLURM_JOB_ID"]
    fields["source"] = "hangdoc-dump"
    fields.update(extra)
    return format_tag(**fields)


def _one_line(text: str, limit: int = 200) -> str:
    """A reason fit for a tag value: one line, no spaces (the tag format splits on them)."""
    line = " ".join(text.split())[:limit]
    return line.replace(" ", "_") or "unknown"


# -- dumpers -----------------------------------------------------------------------------------
@dataclass
class Attempt:
    ok: bool
    text: str = ""
    how: str = ""
    reason: str = ""


def pyspy_dump(pid: int, native: bool = False, locals_: bool = False, nonblocking: bool = False,
               timeout: float = DEFAULT_TIMEOUT, pyspy: Optional[str] = None) -> Attempt:
    exe = pyspy or shutil.which("py-spy")
    if not exe:
        return Attempt(False, how="py-spy", reason="py-spy not installed")
    cmd = [exe, "dump", "--pid", str(pid)]
    if native:
        cmd.append("--native")
    if locals_:
        cmd.append("--locals")
    if nonblocking:
        cmd.append("--nonblocking")
    return _run(cmd, timeout, "py-spy")


def _run(cmd: Sequence[str], timeout: float, how: str) -> Attempt:
    try:
        p = subprocess.run(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                           timeout=timeout, start_new_session=True)
    except subprocess.TimeoutExpired:
        return Attempt(False, how=how, reason=f"{how} timed out after {timeout:g}s")
    except OSError as e:
        return Attempt(False, how=how, reason=f"{how}: {e}")
    out = p.stdout.decode("utf-8", "replace")
    if p.returncode != 0 or not out.strip():
        err = p.stderr.decode("utf-8", "replace").strip().splitlines()
        return Attempt(False, how=how, reason=f"{how} exit {p.returncode}: {err[-1] if err else 'no output'}")
    return Attempt(True, out, how=how)


def signal_file(pid: int) -> Optional[tuple]:
    """(path, signal number) of the faulthandler file of a hangdoc-wrapped process, else None."""
    fd_dir = f"/proc/{pid}/fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return None
    for fd in names:
        try:
            target = os.readlink(os.path.join(fd_dir, fd))
        except OSError:
            continue
        m = _SIGNAL_FILE.search(os.path.basename(target))
        if m and int(m.group(1)) == pid:
            try:
                return target, int(getattr(signal, m.group(2)))
            except AttributeError:
                return None
    return None


def signal_dump(pid: int, wait: float = SIGNAL_WAIT) -> Attempt:
    """Ask a hangdoc-wrapped process for its stacks with its watchdog signal (faulthandler, C level)."""
    found = signal_file(pid)
    if found is None:
        return Attempt(False, how="signal", reason="not hangdoc-wrapped")
    path, signum = found
    try:
        before = os.path.getsize(path)
        os.kill(pid, signum)
    except OSError as e:
        return Attempt(False, how="signal", reason=f"signal: {e}")
    deadline = time.monotonic() + wait
    size = before
    while time.monotonic() < deadline:
        time.sleep(0.05)
        try:
            now = os.path.getsize(path)
        except OSError:
            break
        if now > before and now == size:
            break  # grew, then stayed the same for one tick: written
        size = now
    try:
        with open(path, "rb") as f:
            f.seek(before)
            text = f.read().decode("utf-8", "replace")
    except OSError as e:
        return Attempt(False, how="signal", reason=f"signal: {e}")
    if not text.strip():
        return Attempt(False, how="signal", reason=f"no faulthandler output {wait:g}s after {signal.Signals(signum).name}")
    return Attempt(True, text, how="signal")


def gdb_dump(pid: int, timeout: float = DEFAULT_TIMEOUT) -> Attempt:
    exe = shutil.which("gdb")
    if not exe:
        return Attempt(False, how="gdb", reason="gdb not installed")
    # the interpreter's own gdb extension (py-bt) is only auto-loaded from a trusted path
    base = [exe, "-p", str(pid), "-batch", "-nx", "-iex", "set auto-load safe-path /", "-ex", "set pagination off"]
    first = _run(base + ["-ex", "thread apply all py-bt"], timeout, "gdb")
    if first.ok and "Undefined command" not in first.text and "Traceback" in first.text:
        return first
    return _run(base + ["-ex", "thread apply all bt"], timeout, "gdb")


# -- the dump ----------------------------------------------------------------------------------
@dataclass
class Options:
    native: bool = False
    locals: bool = False
    nonblocking: bool = False
    timeout: float = DEFAULT_TIMEOUT
    use_signal: bool = True
    use_gdb: bool = True
    pyspy: Optional[str] = None
    host: Optional[str] = None


def undumpable_block(info: ProcessInfo, reasons: Sequence[str], status: str = "unresponsive",
                     host: Optional[str] = None, parent: Optional[ProcessInfo] = None) -> str:
    """The block of a process no dumper could read: its tag line with ``status`` and ``reason``,
    then one ``Error: ...`` line, the form py-spy prints its own failures in, which the readers
    take as an unresponsive process.

    >>> print(undumpable_block(ProcessInfo(pid=7, ppid=1), ["py-spy timed out after 10s"], host="n1"), end="")
    # hangdoc process host=n1 pid=7 ppid=1 source=hangdoc-dump status=unresponsive reason=py-spy_timed_out_after_10s
    Error: py-spy timed out after 10s
    """
    message = " ".join("; ".join(reasons).split()) or "no dumper could read it"
    return tag_for(info, host, parent, status=status, reason=_one_line(message)) + "\nError: " + message + "\n"


def dump_process(info: ProcessInfo, options: Options, parent: Optional[ProcessInfo] = None) -> str:
    """One process's block: tag line, then the dump (or the reasons it could not be taken)."""
    if info.state == "Z":
        return undumpable_block(info, ["zombie process (state Z)"], "stopped", options.host, parent)
    extra: Dict[str, object] = {}
    nonblocking = options.nonblocking
    if info.state in ("T", "t"):
        # a stopped process cannot be paused by py-spy; read its memory as it is
        extra = {"status": "stopped", "reason": f"state_{info.state}"}
        nonblocking = True
    reasons: List[str] = []
    attempt = pyspy_dump(info.pid, options.native, options.locals, nonblocking, options.timeout, options.pyspy)
    if not attempt.ok:
        reasons.append(attempt.reason)
        if options.use_signal:
            attempt = signal_dump(info.pid)
            if not attempt.ok and attempt.reason != "not hangdoc-wrapped":
                reasons.append(attempt.reason)
        if not attempt.ok and options.use_gdb:
            attempt = gdb_dump(info.pid, options.timeout)
            if not attempt.ok:
                reasons.append(attempt.reason)
    if not attempt.ok:
        if info.state in ("T", "t"):
            reasons.insert(0, f"stopped (state {info.state})")
        return undumpable_block(info, reasons, "stopped" if extra else "unresponsive", options.host, parent)
    if attempt.how != "py-spy":
        extra["dumper"] = attempt.how
    text = attempt.text if attempt.text.endswith("\n") else attempt.text + "\n"
    return tag_for(info, options.host, parent, **extra) + "\n" + text


def dump(processes: Iterable[ProcessInfo], options: Optional[Options] = None, workers: int = 4) -> str:
    """The dumps of ``processes`` in pid order, one block each, separated by a blank line."""
    options = options or Options()
    procs = sorted(processes, key=lambda i: i.pid)
    if not procs:
        return ""
    by_pid = {i.pid: i for i in procs}
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(procs)))) as pool:
        blocks = list(pool.map(lambda i: dump_process(i, options, by_pid.get(i.ppid) or describe(i.ppid)), procs))
    return "\n".join(blocks)


def default_output(host: Optional[str] = None) -> str:
    return f"trace-{host or short_hostname()}.out"

