"""``hangdoc dump``: take the stacks of every Python process on this node, tagged with its rank.

The py-spy recipe of the big training jobs, done properly: find the processes (the current user's
Python processes, or one launcher's process tree), dump each with py-spy (a subprocess with an
argument list, never a shell, with a timeout per process), and put a ``hangdoc.tags`` line in front
of each dump naming host, pid, ppid, rank, local rank and world size as read from
``/proc/PID/environ``, and the role (:func:`identify`: launcher, rank or DataLoader worker, from
the environment, what the command line executes, the process tree and the stacks). A process that
cannot be dumped is not skipped: it gets a tag line with ``status=unresponsive reason=...`` so the
report can say so; one that exited meanwhile gets a ``# hangdoc exited`` line instead, which blames
it for nothing. Fallbacks, in order: py-spy; the watchdog signal of a hangdoc-wrapped process (its
faulthandler writes into a file we read back); gdb (``py-bt``, else ``bt``; both are read by
:mod:`hangdoc.readers.gdb`).

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
import stat
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from hangdoc.runtime.identity import _LOCAL_RANK_VARS, _RANK_VARS, _WORLD_VARS, _first_int, short_hostname
from hangdoc.cmdline import PYTHON_NAME as _PYTHON_NAME
from hangdoc.cmdline import launcher_name, program_of
from hangdoc.proctree import stat as proc_stat
from hangdoc.dumpsignal import SIGNAL_WAIT, Attempt, open_signal_file, signal_dump, signal_file  # noqa: F401
from hangdoc.tags import defang, format_exited, format_tag

#: seconds py-spy / gdb may take on one process
DEFAULT_TIMEOUT = 10.0


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
    #: start time (clock ticks after boot, /proc/PID/stat field 22): tells a reused pid apart
    start: int = 0

    @property
    def is_python(self) -> bool:
        names = [os.path.basename(self.exe)] + [os.path.basename(a) for a in self.cmdline[:1]]
        return any(_PYTHON_NAME.match(n or "") for n in names)


def multiprocessing_kind(cmdline: Sequence[str]) -> str:
    """``spawn`` for a child started by multiprocessing's spawn method (a DataLoader worker with
    ``multiprocessing_context="spawn"``, or a rank of ``torch.multiprocessing.spawn``), ``helper``
    for its resource tracker or forkserver, else ``""`` (a forked child keeps its parent's command
    line: nothing here says it is one).

    >>> multiprocessing_kind(["python", "-c", "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5, pipe_handle=7)", "--multiprocessing-fork"])
    'spawn'
    """
    kind, what, rest = program_of(cmdline)
    if kind != "code":
        return ""
    if "multiprocessing.spawn" in what or "--multiprocessing-fork" in rest:
        return "spawn"
    if re.search(r"multiprocessing\.(forkserver|resource_tracker|semaphore_tracker)", what):
        return "helper"
    return ""


# What a dump's frames say about its process, in any format hangdoc dump writes (py-spy's
# "func (file:line)", faulthandler's and gdb py-bt's 'File "file", line N, in func').
_WORKER_FRAME = re.compile(r"\b_worker_loop\b.*torch/utils/data/_utils/worker\.py|torch/utils/data/_utils/worker\.py.*\b_worker_loop\b")
_SPAWN_FILE = "torch/multiprocessing/spawn.py"


def stack_evidence(text: str) -> str:
    """``worker`` (a DataLoader worker's loop), ``spawn-rank`` (the function a
    ``torch.multiprocessing.spawn`` rank runs), ``spawn-parent`` (waiting for such ranks) or ``""``.

    >>> stack_evidence("    join (torch/multiprocessing/spawn.py:140)")
    'spawn-parent'
    """
    if not text:
        return ""
    if _WORKER_FRAME.search(text):
        return "worker"
    spawn = [line for line in text.splitlines() if _SPAWN_FILE in line]
    if any(re.search(r"\b_wrap\b", line) for line in spawn):
        return "spawn-rank"
    return "spawn-parent" if spawn else ""


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def gone(info: ProcessInfo) -> Optional[str]:
    """Why ``info``'s process is no longer there to be dumped (it exited; it is a zombie, exited and
    not yet reaped; its pid now names another process), or None while it lives."""
    try:
        state, _, start = proc_stat(info.pid)
    except OSError:
        return "exited"
    if info.start and start and start != info.start:
        return "exited (its pid is now another process's)"
    if state in ("Z", "X"):
        return "exited (a zombie: its parent has not reaped it yet)"
    return None


def describe(pid: int) -> Optional[ProcessInfo]:
    """/proc facts about ``pid``; None when it is gone. Unreadable parts are left empty."""
    base = f"/proc/{pid}"
    try:
        st = proc_stat(pid)
        st_uid = os.stat(base).st_uid
    except OSError:
        return None
    info = ProcessInfo(pid=pid, ppid=st[1], uid=st_uid, state=st[0], start=st[2])
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
    return [infos[p] for p in pids if p in infos and p not in ancestors and infos[p].is_python
            and not _is_own_helper(infos[p])]


def _is_own_helper(info: ProcessInfo) -> bool:
    """hangdoc's own process inside a job (the output prefixer's drainer): not part of the job."""
    return any("hangdoc_prefix_drainer" in a for a in info.cmdline[1:5])


@dataclass
class Identity:
    """Who a process is in its job, as :func:`identify` reads it."""

    #: ``launcher``, ``rank``, ``dataloader-worker``, or ``""`` when nothing here is sure (the
    #: readers then decide from the stack: ``_worker_loop`` makes a worker, anything else a rank)
    role: str = ""
    rank: Optional[int] = None
    local_rank: Optional[int] = None
    world_size: Optional[int] = None
    #: the rank a DataLoader worker belongs to, when known
    parent_rank: Optional[int] = None


def _torch_rank_vars(env: Dict[str, str]) -> Tuple[Optional[str], Optional[str]]:
    return env.get("RANK"), env.get("LOCAL_RANK")


def identify(info: ProcessInfo, parent: Optional[ProcessInfo] = None,
             children: Sequence[Tuple[ProcessInfo, str]] = (), text: str = "", parent_text: str = "") -> Identity:
    """Role and rank of a process from its environment, its command line, its place in the process
    tree (``parent`` and its dump; ``children`` with their dumps) and its own dump (``text``):

    * a **launcher** is what runs a launcher (:func:`launcher_name`) unless its environment names a
      rank (``RANK``/``LOCAL_RANK``) that all its children share, or a process waiting in
      ``torch.multiprocessing.spawn`` for ranks it started;
    * a **DataLoader worker** is one whose stack is in ``_worker_loop``, or a child of a rank that
      has no rank of its own (the same ``RANK`` inherited, or none and multiprocessing's traits: a
      fork with the parent's command line, ``spawn_main``, a forkserver or resource tracker);
    * a **rank** has a rank of its own (a ``RANK`` differing from its parent's, or a parent with
      none), or runs ``torch.multiprocessing.spawn``'s ``_wrap`` (or was spawned by a process
      waiting in ``torch.multiprocessing.spawn``): then an identity equal to its parent's is the
      parent's (``SLURM_PROCID`` of an ``srun`` step), not its own.

    >>> torchrun = ProcessInfo(pid=10, cmdline=["python", "/venv/bin/torchrun", "train.py"])
    >>> rank = ProcessInfo(pid=11, ppid=10, cmdline=["python", "/home/u/accelerate/train.py"], environ={"RANK": "1"})
    >>> identify(torchrun, children=[(rank, "")]).role, identify(rank, torchrun)
    ('launcher', Identity(role='rank', rank=1, local_rank=None, world_size=None, parent_rank=None))
    >>> worker = ProcessInfo(pid=12, ppid=11, cmdline=rank.cmdline, environ={"RANK": "1"})
    >>> identify(worker, rank)
    Identity(role='dataloader-worker', rank=None, local_rank=None, world_size=None, parent_rank=1)
    """
    env = info.environ
    rank = _first_int(env, _RANK_VARS)
    local = _first_int(env, _LOCAL_RANK_VARS)
    world = _first_int(env, _WORLD_VARS)
    python_parent = parent is not None and parent.is_python
    penv = parent.environ if python_parent and parent is not None else {}
    # the parent's rank, when the parent is a rank (or a rank's helper): a launcher's own RANK is
    # no rank of this process's job
    prank = None if not python_parent or launcher_name(parent.cmdline) is not None else _first_int(penv, _RANK_VARS)
    forked = python_parent and parent is not None and info.cmdline == parent.cmdline
    mp_kind = multiprocessing_kind(info.cmdline)
    evidence = stack_evidence(text)

    if evidence not in ("worker", "spawn-rank"):
        if evidence == "spawn-parent" or any(stack_evidence(t) == "spawn-rank" for _, t in children):
            return Identity("launcher", world_size=world)
        if launcher_name(info.cmdline) is not None:
            own = _torch_rank_vars(env)
            launched = any(c.is_python and _torch_rank_vars(c.environ) != own for c, _ in children)
            if own == (None, None) or launched:
                return Identity("launcher", world_size=world)
    if evidence == "worker":
        return Identity("dataloader-worker", world_size=world, parent_rank=rank if rank is not None else prank)
    if (evidence == "spawn-rank" and not forked) or (evidence == "" and mp_kind == "spawn"
                                                     and stack_evidence(parent_text) == "spawn-parent"):
        def own(value: Optional[int], names: Sequence[str]) -> Optional[int]:
            return None if value is not None and value == _first_int(penv, names) else value
        return Identity("rank", own(rank, _RANK_VARS), own(local, _LOCAL_RANK_VARS), own(world, _WORLD_VARS))
    if prank is not None and (rank == prank or (rank is None and (forked or mp_kind))):
        return Identity("dataloader-worker", world_size=world, parent_rank=prank)
    if mp_kind == "helper":
        return Identity("launcher", world_size=world)  # a forkserver / resource tracker of a non-rank
    if rank is not None:
        return Identity("rank", rank, local, world)
    return Identity("", local_rank=local, world_size=world)


def tag_fields(info: ProcessInfo, host: Optional[str] = None, parent: Optional[ProcessInfo] = None,
               children: Sequence[Tuple[ProcessInfo, str]] = (), text: str = "", parent_text: str = "",
               **extra: object) -> Dict[str, object]:
    """The fields of a process's tag line: host and pid, who it is (:func:`identify`), then ``extra``."""
    env = info.environ
    who = identify(info, parent, children, text, parent_text)
    fields: Dict[str, object] = dict(
        host=host or env.get("HANGDOC_HOST") or short_hostname(),
        pid=info.pid,
        ppid=info.ppid,
        rank=who.rank,
        local_rank=who.local_rank,
        world_size=who.world_size,
        parent_rank=who.parent_rank,
    )
    if who.role:
        fields["role"] = who.role
    if env.get("SLURM_JOB_ID"):
        fields["slurm_job"] = env["SLURM_JOB_ID"]
    fields["source"] = "hangdoc-dump"
    fields.update(extra)
    return fields


def tag_for(info: ProcessInfo, host: Optional[str] = None, parent: Optional[ProcessInfo] = None,
            children: Sequence[Tuple[ProcessInfo, str]] = (), text: str = "", parent_text: str = "",
            **extra: object) -> str:
    """The tag line of one process (:func:`tag_fields`).

    A child of a rank with the rank's own RANK (a forked DataLoader worker inherits the
    environment) is that rank's worker, not a second process of the same rank.
    """
    return format_tag(**tag_fields(info, host, parent, children, text, parent_text, **extra))


def _one_line(text: str, limit: int = 200) -> str:
    """A reason fit for a tag value: one line, no spaces (the tag format splits on them)."""
    line = " ".join(text.split())[:limit]
    return line.replace(" ", "_") or "unknown"


# -- dumpers -----------------------------------------------------------------------------------
def find_pyspy() -> Optional[str]:
    """py-spy on PATH, else the one beside this interpreter (``pip install py-spy`` into a venv
    puts it in the venv's ``bin``, which a ``/path/venv/bin/python -m hangdoc dump`` run from
    cron, sudo or a job script often does not have on PATH): gdb's stacks lose thread names."""
    found = shutil.which("py-spy")
    if found:
        return found
    here = os.path.join(os.path.dirname(os.path.abspath(sys.executable or "")), "py-spy")
    try:
        st = os.stat(here)
    except OSError:
        return None
    return here if stat.S_ISREG(st.st_mode) and os.access(here, os.X_OK) else None


def pyspy_dump(pid: int, native: bool = False, locals_: bool = False, nonblocking: bool = False,
               timeout: float = DEFAULT_TIMEOUT, pyspy: Optional[str] = None) -> Attempt:
    exe = pyspy or find_pyspy()
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
    """Run a dumper in a session of its own; past ``timeout`` the whole session is killed (a
    dumper's own children must not keep the pipes open, nor the dump waiting)."""
    try:
        p = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                             start_new_session=True)
    except OSError as e:
        return Attempt(False, how=how, reason=f"{how}: {e}")
    try:
        stdout, stderr = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            p.communicate(timeout=5)
        except subprocess.TimeoutExpired:  # something outside the session holds the pipes
            p.kill()
            for f in (p.stdout, p.stderr):
                if f is not None:
                    f.close()
            p.wait()
        return Attempt(False, how=how, reason=f"{how} timed out after {timeout:g}s")
    out = stdout.decode("utf-8", "replace")
    if p.returncode != 0 or not out.strip():
        err = stderr.decode("utf-8", "replace").strip().splitlines()
        return Attempt(False, how=how, reason=f"{how} exit {p.returncode}: {err[-1] if err else 'no output'}")
    return Attempt(True, out, how=how)


def gdb_dump(pid: int, timeout: float = DEFAULT_TIMEOUT) -> Attempt:
    """gdb's ``thread apply all py-bt`` (Python frames, from the interpreter's own gdb extension),
    else ``thread apply all bt`` (C frames); :mod:`hangdoc.readers.gdb` reads both."""
    exe = shutil.which("gdb")
    if not exe:
        return Attempt(False, how="gdb", reason="gdb not installed")
    # the interpreter's own gdb extension (py-bt) is only auto-loaded from a trusted path
    base = [exe, "-p", str(pid), "-batch", "-nx", "-iex", "set auto-load safe-path /", "-ex", "set pagination off"]
    # py-bt prints Python frames only: no C++ name needs demangling, and demangling libtorch's
    # symbols was most of the attach (a gloo rank in a barrier: 6.5 s, 2.8 s without, the same
    # output). bt's C frames keep their names.
    quick = ["-iex", "set demangle-style none"]
    first = _run(base + quick + ["-ex", "thread apply all py-bt"], timeout, "gdb")
    if first.ok and "Traceback (most recent call first)" in first.text:
        return first
    if not first.ok and "timed out" in first.reason:
        return first  # the same attach would time out again
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


#: what became of one process: dumped, or why not
DUMPED, STOPPED, UNRESPONSIVE, EXITED = "", "stopped", "unresponsive", "exited"


@dataclass
class Taken:
    """The outcome of dumping one process."""

    info: ProcessInfo
    #: the dump, when one was taken
    text: str = ""
    #: the dumper that took it, when not py-spy
    how: str = ""
    #: DUMPED, or STOPPED (read as it is, or not at all), UNRESPONSIVE, EXITED (gone before or
    #: while it was dumped: nothing to read, and nothing to blame it for as unresponsive)
    status: str = DUMPED
    reasons: List[str] = field(default_factory=list)


def take(info: ProcessInfo, options: Options) -> Taken:
    """Dump one process with py-spy, else the watchdog signal, else gdb; say why when none could."""
    if info.state in ("Z", "X"):
        return Taken(info, status=EXITED, reasons=["exited (a zombie: its parent has not reaped it yet)"])
    stopped = info.state in ("T", "t")
    # a stopped process cannot be paused by py-spy; read its memory as it is
    attempt = pyspy_dump(info.pid, options.native, options.locals, options.nonblocking or stopped, options.timeout,
                         options.pyspy)
    reasons: List[str] = []
    dumpers = []
    if options.use_signal:
        dumpers.append(lambda: signal_dump(info.pid, uid=info.uid if info.uid >= 0 else None))
    if options.use_gdb:
        dumpers.append(lambda: gdb_dump(info.pid, options.timeout))
    for fallback in [None] + dumpers:
        if fallback is not None:
            attempt = fallback()
        if attempt.ok:
            return Taken(info, attempt.text, "" if attempt.how == "py-spy" else attempt.how,
                         STOPPED if stopped else DUMPED, [f"state {info.state}"] if stopped else [])
        if attempt.reason != "not hangdoc-wrapped":
            reasons.append(attempt.reason)
        why = gone(info)
        if why is not None:
            # a process that is gone failed every dumper for that reason alone
            return Taken(info, status=EXITED, reasons=[why])
    if stopped:
        reasons.insert(0, f"stopped (state {info.state})")
    return Taken(info, status=STOPPED if stopped else UNRESPONSIVE, reasons=reasons)


def undumpable_block(info: ProcessInfo, reasons: Sequence[str], status: str = "unresponsive",
                     host: Optional[str] = None, parent: Optional[ProcessInfo] = None, parent_text: str = "") -> str:
    """The block of a process no dumper could read: its tag line with ``status`` and ``reason``,
    then one ``Error: ...`` line, the form py-spy prints its own failures in, which the readers
    take as an unresponsive process.

    >>> print(undumpable_block(ProcessInfo(pid=7, ppid=1), ["py-spy timed out after 10s"], host="n1"), end="")
    # hangdoc process host=n1 pid=7 ppid=1 source=hangdoc-dump status=unresponsive reason=py-spy_timed_out_after_10s
    Error: py-spy timed out after 10s
    """
    message = " ".join("; ".join(reasons).split()) or "no dumper could read it"
    return (tag_for(info, host, parent, parent_text=parent_text, status=status, reason=_one_line(message))
            + "\nError: " + message + "\n")


def exited_block(info: ProcessInfo, reason: str = "exited", host: Optional[str] = None,
                 parent: Optional[ProcessInfo] = None, parent_text: str = "") -> str:
    """The line of a process that exited before it could be dumped (:data:`hangdoc.tags.EXITED_PREFIX`).

    It is no tag line and no dump follows it: the readers make it a process with status
    ``exited`` and no stack (not unresponsive); an exited rank is a ``missing-rank`` finding.

    >>> print(exited_block(ProcessInfo(pid=7, ppid=1, environ={"RANK": "1"}), host="n1"), end="")
    # hangdoc exited host=n1 pid=7 ppid=1 rank=1 role=rank source=hangdoc-dump reason=exited
    """
    return format_exited(**tag_fields(info, host, parent, parent_text=parent_text, reason=_one_line(reason))) + "\n"


def block(taken: Taken, host: Optional[str] = None, parent: Optional[ProcessInfo] = None,
          children: Sequence[Tuple[ProcessInfo, str]] = (), parent_text: str = "") -> str:
    """One process's block: tag line, then the dump (or the reasons it could not be taken).
    ``children`` (with their dumps) and ``parent_text`` (the parent's dump) help say who it is."""
    info = taken.info
    if taken.status == EXITED:
        return exited_block(info, "; ".join(taken.reasons), host, parent, parent_text)
    if not taken.text:
        return undumpable_block(info, taken.reasons, taken.status, host, parent, parent_text)
    extra: Dict[str, object] = {}
    if taken.status == STOPPED:
        extra = {"status": STOPPED, "reason": f"state_{info.state}"}
    if taken.how:
        extra["dumper"] = taken.how
    # what a dumper printed comes from the process (py-spy prints its command line, faulthandler its
    # file names): none of it may read as a tag line of hangdoc's own
    text = defang(taken.text if taken.text.endswith("\n") else taken.text + "\n")
    return tag_for(info, host, parent, children, taken.text, parent_text, **extra) + "\n" + text


def dump_process(info: ProcessInfo, options: Options, parent: Optional[ProcessInfo] = None) -> str:
    """One process's block, dumped now (:func:`take`, :func:`block`)."""
    return block(take(info, options), options.host, parent)


def dump(processes: Iterable[ProcessInfo], options: Optional[Options] = None, workers: int = 4) -> str:
    """The dumps of ``processes`` in pid order, one block each, separated by a blank line.

    All are dumped first: who a process is may depend on its relatives' stacks (the parent of
    ``torch.multiprocessing.spawn`` ranks is their launcher, and they are its ranks).
    """
    options = options or Options()
    procs = sorted(processes, key=lambda i: i.pid)
    if not procs:
        return ""
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(procs)))) as pool:
        taken = list(pool.map(lambda i: take(i, options), procs))
    by_pid = {i.pid: i for i in procs}
    texts = {t.info.pid: t.text for t in taken}
    children: Dict[int, List[Tuple[ProcessInfo, str]]] = {}
    for t in taken:
        children.setdefault(t.info.ppid, []).append((t.info, t.text))
    parents: Dict[int, Optional[ProcessInfo]] = {}
    blocks = []
    for t in taken:
        ppid = t.info.ppid
        if ppid not in parents:
            parents[ppid] = by_pid.get(ppid) or describe(ppid)
        blocks.append(block(t, options.host, parents[ppid], children.get(t.info.pid, ()), texts.get(ppid, "")))
    return "\n".join(blocks)


def default_output(host: Optional[str] = None) -> str:
    return f"trace-{host or short_hostname()}.out"
