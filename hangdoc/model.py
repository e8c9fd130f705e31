"""The one vocabulary of hangdoc's offline side.

Readers turn sources (dump files, record files) into these objects; analysis reads them and adds
groups, a merged tree and findings; renderers only display them. Nothing here parses or prints.

Conventions that every stage relies on:

* ``Thread.frames`` is ordered **outermost first** (``frames[0]`` is ``<module>``, ``frames[-1]`` is
  the innermost frame), whatever order the dump format printed them in.
* ``Frame`` equality ignores ``locals`` so that identical code paths group together even when the
  argument values differ from rank to rank.
* Every identity field (``host``, ``pid``, ``rank``) may be ``None`` when the evidence does not say.

Example::

    >>> from hangdoc.model import Frame, Thread, Process
    >>> t = Thread(ident="1", name="MainThread", frames=(Frame("<module>", "train.py", 3),))
    >>> p = Process(host="node1", pid=42, rank=0, threads=[t])
    >>> p.main_thread.top.function
    '<module>'
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

#: Roles a process can have in a job.
ROLE_RANK = "rank"  #: a training process (one torch.distributed rank)
ROLE_WORKER = "dataloader-worker"  #: a DataLoader worker process forked by a rank
ROLE_LAUNCHER = "launcher"  #: torchrun / elastic agent / srun wrapper
ROLE_UNKNOWN = "unknown"

#: Process status: was a usable stack taken?
STATUS_OK = "ok"
STATUS_UNRESPONSIVE = "unresponsive"  #: the dumper could not read it (py-spy error, timeout)
STATUS_TRUNCATED = "truncated"  #: the dump of this process is cut off
STATUS_STOPPED = "stopped"  #: the process is stopped (SIGSTOP, state T) or a zombie
STATUS_EXITED = "exited"  #: gone before it could be dumped (``hangdoc dump``'s exited line): no stack
STATUS_LOG = "log-only"  #: known only from what a console log said of it: no stack was taken


@dataclass(frozen=True)
class Frame:
    """One stack frame. ``file`` is already normalised by the reader (see analysis.normalize)."""

    function: str
    file: str = ""
    line: Optional[int] = None
    #: True for C/C++ frames (py-spy --native, gdb, pystack native).
    native: bool = False
    #: ``(name, value)`` pairs from py-spy --locals / pystack --locals; ignored by equality.
    locals: Tuple[Tuple[str, str], ...] = field(default=(), compare=False, hash=False)

    def label(self, with_line: bool = True) -> str:
        """``function (file:line)``, the way py-spy prints a frame."""
        if not self.file:
            return self.function
        if with_line and self.line is not None:
            return f"{self.function} ({self.file}:{self.line})"
        return f"{self.function} ({self.file})"

    def local(self, name: str) -> Optional[str]:
        for k, v in self.locals:
            if k == name:
                return v
        return None


@dataclass
class Thread:
    """One thread of a process. ``frames`` is outermost first."""

    ident: str = ""
    name: Optional[str] = None
    frames: Tuple[Frame, ...] = ()
    #: as the dumper said it: "active", "idle", "active+gil", "current", or None.
    state: Optional[str] = None
    is_main: bool = False

    @property
    def top(self) -> Optional[Frame]:
        """The innermost frame (where the thread is now)."""
        return self.frames[-1] if self.frames else None


@dataclass
class Process:
    """One dumped process, with where its dump came from."""

    host: Optional[str] = None
    pid: Optional[int] = None
    rank: Optional[int] = None
    local_rank: Optional[int] = None
    ppid: Optional[int] = None
    role: str = ROLE_UNKNOWN
    threads: List[Thread] = field(default_factory=list)
    status: str = STATUS_OK
    #: why the status is not ok (the dumper's own error line, say).
    status_detail: str = ""
    #: the file and 1-based line where this process's dump starts.
    source: str = ""
    source_line: int = 0
    #: the dump format it was read from ("py-spy", "py-spy-json", "faulthandler", ...).
    format: str = ""
    #: command line / Python version when the dump names them.
    command: str = ""
    #: for a DataLoader worker, the rank that owns it when the evidence allows.
    parent_rank: Optional[int] = None
    #: anything else a reader learnt (environment tags of ``hangdoc dump``, say).
    meta: Dict[str, Any] = field(default_factory=dict)

    @property
    def main_thread(self) -> Optional[Thread]:
        for t in self.threads:
            if t.is_main:
                return t
        return self.threads[0] if self.threads else None

    @property
    def key(self) -> Tuple[str, int, int]:
        """A stable sort key: host, then rank, then pid."""
        return (self.host or "", -1 if self.rank is None else self.rank, self.pid or 0)

    def culprit(self) -> "Culprit":
        return Culprit(host=self.host, pid=self.pid, rank=self.rank)

    def describe(self) -> str:
        """``rank 3 (node1 pid 42)``: how reports name a process."""
        who = f"rank {self.rank}" if self.rank is not None else (self.role if self.role != ROLE_UNKNOWN else "process")
        where = " ".join(x for x in (self.host or "", f"pid {self.pid}" if self.pid is not None else "") if x)
        return f"{who} ({where})" if where else who


#: calls whose ranks pass tensors or objects of different sizes by design (uneven all_to_all splits,
#: one pickled object per rank): their shapes are no part of what must match across the ranks
RANK_SHAPED = frozenset({"all_to_all", "all_to_all_single", "gather_object", "all_gather_object",
                         "scatter_object_list"})


@dataclass
class CollectiveRecord:
    """One recorded torch.distributed call on one rank (see hangdoc.runtime.recorder)."""

    rank: int
    #: per-process-group sequence number on this rank, from 0.
    seq: int
    op: str
    group: str = "default_pg"
    #: global ranks in the group (empty = the whole world).
    group_ranks: Tuple[int, ...] = ()
    shapes: Tuple[Tuple[int, ...], ...] = ()
    dtypes: Tuple[str, ...] = ()
    #: src/dst of rooted collectives, as a global rank.
    root: Optional[int] = None
    #: the other side of a send/recv, as a global rank.
    peer: Optional[int] = None
    async_op: bool = False
    #: ``file:line:function`` of the first frame outside torch and hangdoc.
    call_site: str = ""
    stream: Optional[str] = None
    phase: Optional[str] = None
    time_issued: Optional[float] = None
    time_completed: Optional[float] = None
    #: "issued", "completed" or "failed".
    state: str = "issued"
    host: Optional[str] = None
    pid: Optional[int] = None
    #: where the record came from ("hangdoc", "flight-recorder").
    origin: str = "hangdoc"

    def signature(self) -> Tuple[Any, ...]:
        """What must agree across the ranks of a group for the call to match (not the shapes of a
        call whose ranks pass different sizes by design: RANK_SHAPED)."""
        return (self.op, () if self.op in RANK_SHAPED else self.shapes, self.dtypes, self.root)

    def describe(self) -> str:
        """``broadcast([8] float32, src=0)``."""
        shapes = ", ".join("[" + ",".join(str(d) for d in s) + "]" for s in self.shapes)
        dt = ",".join(sorted(set(self.dtypes)))
        parts = [p for p in (shapes, dt) if p]
        inner = " ".join(parts)
        if self.root is not None:
            inner += f", {'src' if self.op in ('broadcast', 'scatter', 'broadcast_object_list', 'scatter_object_list', 'recv', 'irecv') else 'dst'}={self.root}"
        if self.peer is not None:
            inner += f", peer={self.peer}"
        return f"{self.op}({inner.strip(', ')})"

    def to_json(self) -> Dict[str, Any]:
        # Every field is a scalar but these three: a shallow copy (asdict deep-copies each value,
        # ten times the cost, which a dump of 100,000 records paid at the job's exit).
        d = {name: getattr(self, name) for name in self.__dataclass_fields__}
        d["group_ranks"] = list(self.group_ranks)
        d["shapes"] = [list(s) for s in self.shapes]
        d["dtypes"] = list(self.dtypes)
        return d

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "CollectiveRecord":
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        known["group_ranks"] = tuple(int(r) for r in known.get("group_ranks") or ())
        known["shapes"] = tuple(tuple(int(x) for x in s) for s in known.get("shapes") or ())
        known["dtypes"] = tuple(str(x) for x in known.get("dtypes") or ())
        return cls(**known)


@dataclass(frozen=True)
class ParseError:
    """One problem in one source, reported as ``file:line: message`` and otherwise skipped."""

    source: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.source}:{self.line}: {self.message}"


#: What a console log can say about a rank (``LogEvent.kind``); see docs/formats.md.
EVENT_KINDS = (
    "timeout",         # a collective timed out: group, seq, op, numel_in/out, timeout_ms
    "watchdog-state",  # "last enqueued / last completed work" when the watchdog saw the failure
    "exception",       # a Python exception a rank raised: exc (type: message), at (file:line)
    "exit",            # a rank exited: exitcode and/or signal (elastic table, SIGABRT lines)
    "mismatch",        # TORCH_DISTRIBUTED_DEBUG=DETAIL: collective fingerprints of two ranks differ
    "barrier",         # monitoredBarrier: these ranks did not reach it
    "peer-closed",     # gloo: connection closed/reset by a peer (its address)
    "heartbeat",       # the heartbeat monitor: a dump signal, a stuck watchdog
    "missing",         # fr_trace: ranks that did not join a collective the others issued
    "divergence",      # hangdoc run --detect: the in-job divergence verdict (divergence.json)
)


@dataclass
class LogEvent:
    """One thing a job's console said about one rank, with where it was said.

    ``fields`` holds what the kind carries (``seq``, ``op``, ``numel_in``, ``exc``, ``exitcode``,
    ``signal``, ``ranks``, ...); ``time`` is seconds within the year when the line says when
    (a timestamp prefix, glog's ``E1206 18:44:12.71``), comparable within one job's logs.
    """

    kind: str
    source: str = ""
    line: int = 0
    host: Optional[str] = None
    rank: Optional[int] = None
    pid: Optional[int] = None
    time: Optional[float] = None
    fields: Dict[str, Any] = field(default_factory=dict)
    #: the log line itself, cut to 300 characters (for evidence)
    text: str = ""

    @property
    def where(self) -> str:
        return f"{self.source}:{self.line}"

    def to_json(self) -> Dict[str, Any]:
        return {"kind": self.kind, "source": self.source, "line": self.line, "host": self.host,
                "rank": self.rank, "pid": self.pid, "time": self.time, "fields": dict(self.fields),
                "text": self.text}


@dataclass
class Source:
    """One input file and what was read from it."""

    path: str
    processes: int = 0
    records: int = 0
    formats: List[str] = field(default_factory=list)
    errors: List[ParseError] = field(default_factory=list)
    #: log events read from it (:class:`LogEvent`)
    events: int = 0
    #: the file ends in the middle of a line or a block: what it says may be cut short
    truncated: bool = False


@dataclass(frozen=True)
class Culprit:
    host: Optional[str] = None
    pid: Optional[int] = None
    rank: Optional[int] = None

    def to_json(self) -> Dict[str, Any]:
        return {"host": self.host, "pid": self.pid, "rank": self.rank}


#: Finding kinds; each has a page in docs/findings/. Part of the JSON contract.
FINDING_KINDS = (
    "collective-mismatch",
    "dataloader-stall",
    "p2p-cycle",
    "p2p-stall",
    "stream-misplacement",
    "unresponsive-process",
    "missing-rank",
    "collective-wait",
    "rank-failed",
    "no-hang",
)


@dataclass
class Finding:
    """A verdict: what kind of hang, who is to blame, why we think so, what to do next."""

    kind: str
    summary: str
    culprits: List[Culprit] = field(default_factory=list)
    #: the lines that prove the verdict, most telling first: what a terse report shows.
    evidence: List[str] = field(default_factory=list)
    advice: List[str] = field(default_factory=list)
    #: 0..1; findings are sorted by it, highest first, and findings[0] is the headline.
    confidence: float = 0.5
    #: supporting lines a terse report leaves out (``-v`` shows them): every rank's pending call,
    #: what another rule alone said, why an explanation does not hold. JSON has them as ``detail``.
    detail: List[str] = field(default_factory=list)
    #: processes one of which is to blame, where the evidence cannot say which (``culprits`` then
    #: holds only those it can name, often none): named, never blamed.
    candidates: List[Culprit] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.kind not in FINDING_KINDS:
            raise ValueError(f"unknown finding kind {self.kind!r}")

    def to_json(self) -> Dict[str, Any]:
        return {
            "kind": self.kind,
            "summary": self.summary,
            "culprits": [c.to_json() for c in self.culprits],
            "evidence": list(self.evidence),
            "advice": list(self.advice),
            "confidence": round(self.confidence, 3),
            "detail": list(self.detail),
            "candidates": [c.to_json() for c in self.candidates],
        }


@dataclass
class Job:
    """Everything the readers learnt about one hung job: the input of analysis."""

    processes: List[Process] = field(default_factory=list)
    records: List[CollectiveRecord] = field(default_factory=list)
    sources: List[Source] = field(default_factory=list)
    #: what the job's console logs said (timeouts, exceptions, exits, DETAIL mismatches)
    events: List[LogEvent] = field(default_factory=list)
    #: the world size when some evidence says it (records, rank map, hangdoc dumps).
    world_size: Optional[int] = None

    @property
    def errors(self) -> List[ParseError]:
        return [e for s in self.sources for e in s.errors]


@dataclass
class Group:
    """Processes whose main threads have the identical stack (an equivalence class)."""

    stack: Tuple[Frame, ...]
    members: List[Process] = field(default_factory=list)
    #: one line: the innermost frame that is not library plumbing, and the user frame that called it.
    summary: str = ""
    #: the members' status; processes that are not ``ok`` (unresponsive, stopped) form their own groups.
    status: str = STATUS_OK
    #: for a group of non-main threads (``Report.thread_groups``): the thread names seen, sorted.
    thread_names: List[str] = field(default_factory=list)
    #: for a group of non-main threads: how many threads (a process may hold several alike).
    threads: int = 0

    @property
    def count(self) -> int:
        return len(self.members)

    @property
    def ranks(self) -> List[int]:
        return sorted(p.rank for p in self.members if p.rank is not None)


@dataclass
class TreeNode:
    """A node of the merged prefix tree of main-thread stacks (root: ``frame is None``).

    It refers to the groups whose stack passes through it, so the tree grows with distinct
    stacks, not with processes.
    """

    frame: Optional[Frame] = None
    groups: List[Group] = field(default_factory=list)
    children: List["TreeNode"] = field(default_factory=list)

    @property
    def count(self) -> int:
        return sum(g.count for g in self.groups)

    @property
    def members(self) -> List[Process]:
        return [p for g in self.groups for p in g.members]


@dataclass
class Report:
    """The output of analysis and the only input of renderers."""

    job: Job
    groups: List[Group] = field(default_factory=list)
    tree: TreeNode = field(default_factory=TreeNode)
    findings: List[Finding] = field(default_factory=list)
    #: ranks the world size implies but no source mentions (a ``hangdoc.ranges.RankSet`` from
    #: ``build_report``: runs, so a world of a million ranks is never enumerated).
    missing_ranks: List[int] = field(default_factory=list)
    #: "function" or "function+line": how frames were compared when grouping.
    granularity: str = "function+line"
    #: the other (non-main) threads of all processes, grouped by stack like ``groups``.
    thread_groups: List[Group] = field(default_factory=list)
