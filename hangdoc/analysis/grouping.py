"""Groups, the merged tree and missing ranks: a :class:`~hangdoc.model.Job` in, a :class:`~hangdoc.model.Report` out.

A *group* is the set of processes whose main threads have the identical stack (compared without
locals, at the chosen granularity). Groups come largest first; the merged prefix tree (root =
outermost frame) refers to groups, not processes, so its size grows with the number of distinct
stacks, not with the number of processes. The other threads are grouped the same way, separately.

The work per process is a dictionary look-up keyed on the identity of its (interned) stack tuple;
everything else runs once per distinct stack. The result does not depend on the order of the
processes or of the input files.

    >>> from hangdoc.model import Frame, Job, Process, Thread
    >>> def proc(rank, *functions):
    ...     frames = tuple(Frame(f, "train.py", i + 1) for i, f in enumerate(functions))
    ...     return Process(host="node1", pid=100 + rank, rank=rank, threads=[Thread("1", "MainThread", frames, is_main=True)])
    >>> job = Job(processes=[proc(0, "main", "step"), proc(1, "main", "load"), proc(2, "main", "step")], world_size=4)
    >>> report = build_report(job)
    >>> [(g.count, g.ranks, g.summary) for g in report.groups]
    [(2, [0, 2], 'step (train.py:2)'), (1, [1], 'load (train.py:2)')]
    >>> report.missing_ranks
    [3]
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Dict, Hashable, Iterable, List, Optional, Sequence, Tuple

from hangdoc.model import STATUS_OK, Frame, Group, Job, Process, Report, TreeNode
from hangdoc.ranges import RankSet

GRANULARITIES = ("function+line", "function")

#: rank None sorts after every real rank.
_NO_RANK = 1 << 62


def build_report(job: Job, granularity: str = "function+line") -> Report:
    """Group ``job``'s processes by main-thread stack, build the merged tree, list missing ranks.

    ``granularity="function"`` ignores line numbers, so ranks stopped on different lines of the
    same function group together; a group's stack then keeps a line only where all members agree.

        >>> build_report(Job()).groups
        []
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"unknown granularity {granularity!r}; choose from {', '.join(GRANULARITIES)}")
    with_line = granularity == "function+line"
    keyer = _StackKeyer(with_line)

    # status/key -> (raw stacks seen, members); the key of a stack is computed once per distinct tuple.
    main: Dict[Hashable, Tuple[Dict[int, Tuple[Frame, ...]], List[Process], str]] = {}
    others: Dict[Hashable, Tuple[Dict[int, Tuple[Frame, ...]], Dict[int, Process], List[str], List[int]]] = {}
    for p in job.processes:
        threads = p.threads
        main_thread = p.main_thread
        frames = main_thread.frames if main_thread is not None else ()
        k = (p.status, keyer.key(frames))
        slot = main.get(k)
        if slot is None:
            slot = main[k] = ({}, [], p.status)
        slot[0][id(frames)] = frames
        slot[1].append(p)
        if len(threads) > 1:
            for t in threads:
                if t is main_thread:
                    continue
                tk = keyer.key(t.frames)
                tslot = others.get(tk)
                if tslot is None:
                    tslot = others[tk] = ({}, {}, [], [0])
                tslot[0][id(t.frames)] = t.frames
                tslot[1][id(p)] = p
                if t.name:
                    tslot[2].append(t.name)
                tslot[3][0] += 1

    groups = [
        Group(stack=keyer.representative(list(raw.values())), members=_sorted_members(members), status=status)
        for raw, members, status in main.values()
    ]
    groups.sort(key=_group_order)
    for g in groups:
        g.summary = summarize(g.stack, g.status, g.members)

    thread_groups = [
        Group(
            stack=keyer.representative(list(raw.values())),
            members=_sorted_members(list(procs.values())),
            thread_names=sorted(set(names)),
            threads=n[0],
        )
        for raw, procs, names, n in others.values()
    ]
    thread_groups.sort(key=lambda g: (-g.threads,) + _group_order(g))
    for g in thread_groups:
        g.summary = summarize(g.stack, g.status, g.members)

    return Report(
        job=job,
        groups=groups,
        tree=merge_tree(groups, with_line=with_line),
        missing_ranks=missing_ranks(job),
        granularity=granularity,
        thread_groups=thread_groups,
    )


class _StackKeyer:
    """Turns a stack into its grouping key, once per distinct stack object.

    Readers intern stacks, so thousands of processes share one tuple; caching on ``id()`` skips
    re-hashing ~30 frames per process. The tuples stay referenced by their threads for the whole
    run, so an id is never reused while the cache lives.
    """

    def __init__(self, with_line: bool) -> None:
        self.with_line = with_line
        self._by_id: Dict[int, int] = {}
        self._by_key: Dict[Hashable, int] = {}
        self._keep: List[Any] = []

    def key(self, frames: Sequence[Frame]) -> int:
        """A small int naming the stack's equivalence class (hashing an int, not ~30 frames, per process)."""
        k = self._by_id.get(id(frames))
        if k is None:
            if self.with_line:
                full: Hashable = tuple(frames)
            else:
                full = tuple((f.function, f.file, f.native) for f in frames)
            k = self._by_key.setdefault(full, len(self._by_key))
            self._by_id[id(frames)] = k
            self._keep.append(frames)  # keeps the id valid even if the caller dropped the object
        return k

    def representative(self, stacks: List[Tuple[Frame, ...]]) -> Tuple[Frame, ...]:
        """One stack for the group, without locals; at function granularity lines only where all agree."""
        stacks.sort(key=_stack_sort_key)  # deterministic whatever order the raw stacks came in
        first = stacks[0]
        out: List[Frame] = []
        for i, f in enumerate(first):
            line = f.line
            if not self.with_line and line is not None:
                for s in stacks[1:]:
                    if s[i].line != line:
                        line = None
                        break
            out.append(Frame(f.function, f.file, line, f.native) if (f.locals or line != f.line) else f)
        return tuple(out)


def _stack_sort_key(stack: Sequence[Frame]) -> Tuple:
    return tuple((f.function, f.file, -1 if f.line is None else f.line, f.native) for f in stack)


def _member_key(p: Process) -> Tuple:
    return (
        _NO_RANK if p.rank is None else p.rank,
        p.host or "",
        -1 if p.pid is None else p.pid,
        p.source,
        p.source_line,
    )


def _sorted_members(members: List[Process]) -> List[Process]:
    members.sort(key=_member_key)
    return members


def _group_order(g: Group) -> Tuple:
    first = _member_key(g.members[0]) if g.members else ()
    return (-g.count, g.status != STATUS_OK, first, _stack_sort_key(g.stack))


# -- the merged tree ----------------------------------------------------------------------------


def merge_tree(groups: Iterable[Group], with_line: bool = True) -> TreeNode:
    """The prefix tree of the groups' stacks; every node lists the groups passing through it.

    Children come largest first (then by their first member), so the main path reads top-down.
    With ``with_line=False`` (granularity ``function``) frames that differ only in their line share
    a node, whose frame keeps the line only if all of them agree.

        >>> from hangdoc.model import Frame, Group, Process
        >>> a, b, c = Frame("main", "t.py", 1), Frame("step", "t.py", 2), Frame("load", "t.py", 3)
        >>> tree = merge_tree([Group((a, b), [Process(rank=0), Process(rank=1)]), Group((a, c), [Process(rank=2)])])
        >>> [(n.frame.function, n.count) for n in tree.children[0].children]
        [('step', 2), ('load', 1)]
    """
    root = TreeNode(frame=None)
    # node -> its children by frame; kept aside so TreeNode stays a plain data object.
    index: Dict[int, Dict[Hashable, TreeNode]] = {}
    for g in groups:
        root.groups.append(g)
        node = root
        for f in g.stack:
            kids = index.setdefault(id(node), {})
            k: Hashable = f if with_line else (f.function, f.file, f.native)
            child = kids.get(k)
            if child is None:
                child = kids[k] = TreeNode(frame=f)
                node.children.append(child)
            elif child.frame is not None and child.frame.line != f.line:
                child.frame = Frame(f.function, f.file, None, f.native)
            child.groups.append(g)
            node = child
    _order_children(root)
    return root


def _order_children(root: TreeNode) -> None:
    stack = [root]
    while stack:
        node = stack.pop()
        if len(node.children) > 1:
            node.children.sort(key=lambda n: (-n.count, min(_group_order(g)[2] for g in n.groups), _frame_key(n.frame)))
        stack.extend(node.children)


def _frame_key(f: Optional[Frame]) -> Tuple:
    if f is None:
        return ()
    return (f.function, f.file, -1 if f.line is None else f.line, f.native)


# -- missing ranks ------------------------------------------------------------------------------


def missing_ranks(job: Job) -> RankSet:
    """Ranks below ``job.world_size`` that no process and no record names, as runs: a world size
    read from a dump is not enumerated (``world_size=9999999999999`` costs nothing).

        >>> from hangdoc.model import Process
        >>> missing_ranks(Job(processes=[Process(rank=0), Process(rank=2)], world_size=4))
        [1, 3]
    """
    if not job.world_size:
        return []
    seen = {p.rank for p in job.processes if p.rank is not None}
    seen.update(r.rank for r in job.records)
    return RankSet.missing(job.world_size, seen)


# -- summaries ----------------------------------------------------------------------------------


def _load_is_plumbing() -> Callable[[Frame], bool]:
    try:
        from hangdoc.analysis.normalize import is_plumbing

        return is_plumbing
    except Exception:  # normalize not present in this build: a conservative built-in guess
        return _fallback_is_plumbing


_PLUMBING_FUNCTIONS = {"wrapper", "_wrapped_call_impl", "_call_impl", "inner", "decorate_context"}


def _fallback_is_plumbing(frame: Frame) -> bool:
    if frame.native:
        return True
    name = frame.function.rsplit(".", 1)[-1]
    return name in _PLUMBING_FUNCTIONS or frame.file.endswith(("c10d_logger.py", "elastic/multiprocessing/errors/__init__.py"))


_LIBRARY_PREFIXES = ("torch/", "<frozen", "<string")
# the standard library, as normalize_file leaves it (``threading.py``, ``multiprocessing/queues.py``)
_STDLIB = frozenset(getattr(sys, "stdlib_module_names", ())) or frozenset({
    "threading", "queue", "selectors", "socket", "subprocess", "runpy", "multiprocessing", "concurrent",
    "asyncio", "importlib", "contextlib", "functools", "ssl", "weakref", "logging", "pickle", "json",
})


def is_library(frame: Frame) -> bool:
    """True for frames of torch, the standard library and installed packages (not the user's code).

        >>> is_library(Frame("broadcast", "torch/distributed/distributed_c10d.py", 1))
        True
        >>> is_library(Frame("train", "train.py", 3))
        False
    """
    try:
        from hangdoc.analysis import normalize

        fn = getattr(normalize, "is_library", None)
        if fn is not None:
            return bool(fn(frame))
    except Exception:
        pass
    f = frame.file
    if not f:
        return frame.native
    if f.startswith(_LIBRARY_PREFIXES) or "site-packages/" in f or "dist-packages/" in f or "/lib/python" in f:
        return True
    if f.startswith("hangdoc/") or "/hangdoc/runtime/" in f:
        return True  # hangdoc's own in-job wrappers (the collective recorder) are not the user's code
    if f[0] in "/~.":
        return False  # a path of the user's own tree
    head = f.split("/", 1)[0]
    return (head[:-3] if head.endswith(".py") else head) in _STDLIB


def summarize(stack: Sequence[Frame], status: str = STATUS_OK, members: Sequence[Process] = ()) -> str:
    """One line for a group: ``broadcast ← _bcast_pipe_scalar (engine.py:123)``.

    The innermost frame that is not plumbing (Python frames preferred over native ones), then,
    when that frame is library code, the innermost user frame that led to it.

        >>> summarize((Frame("main", "train.py", 9), Frame("broadcast", "torch/distributed/distributed_c10d.py", 2)))
        'broadcast ← main (train.py:9)'
    """
    if status != STATUS_OK and not stack:
        detail = next((p.status_detail for p in members if p.status_detail), "")
        return f"{status}: {detail}" if detail else f"{status}: no stack"
    if not stack:
        return "no stack"
    plumbing = _load_is_plumbing()
    prefix = f"{status}: " if status != STATUS_OK else ""
    python = [f for f in stack if not f.native]
    if not python:
        native = _native_summary(stack)
        if native:
            return prefix + native
        python = list(stack)
    inner_i = None
    for i in range(len(python) - 1, -1, -1):
        if not _safe(plumbing, python[i]):
            inner_i = i
            break
    if inner_i is None:
        inner_i = len(python) - 1
    inner = python[inner_i]
    if not is_library(inner):
        return prefix + _where(inner)
    # A forked child (a DataLoader worker) carries its parent's frames below its own start; the
    # parent's code did not call what the child waits in, so look no further out than that start.
    start = 0
    for i in range(inner_i - 1, -1, -1):
        if python[i].file.endswith(_CHILD_START):
            start = i + 1
            break
    for f in reversed(python[start:inner_i]):
        if not is_library(f) and not _safe(plumbing, f):
            return f"{prefix}{inner.function} ← {_where(f)}"
    if start:  # no user code in the child: name the child's own entry (``_worker_loop``)
        entry = next((f for f in python[start:inner_i] if not _safe(plumbing, f)), None)
        if entry is not None:
            return f"{prefix}{inner.function} ← {_where(entry)}"
    return prefix + _where(inner)


#: files whose frames mark where a forked child process begins.
_CHILD_START = ("multiprocessing/process.py", "multiprocessing/popen_fork.py", "multiprocessing/spawn.py")


def _native_summary(stack: Sequence[Frame]) -> str:
    """For C-only stacks (gdb): the frame the diagnosis signatures recognise, not libc's futex wait."""
    try:
        from hangdoc.analysis.signatures import classify_stack

        w = classify_stack(tuple(stack))
    except Exception:  # signatures absent or confused: fall back to the plain rule
        return ""
    if w.frame is None:
        return ""
    text = _where(Frame(_strip_args(w.frame.function), w.frame.file, w.frame.line, True))
    if w.call_site is not None and w.call_site is not w.frame:
        text = f"{_strip_args(w.frame.function)} ← {_where(Frame(_strip_args(w.call_site.function), w.call_site.file, w.call_site.line))}"
    return text


def _strip_args(function: str) -> str:
    """``c10d::Work::wait(std::chrono::duration<...>)`` → ``c10d::Work::wait``."""
    i = function.find("(")
    return function[:i] if i > 0 else function


def _safe(pred: Callable[[Frame], bool], f: Frame) -> bool:
    try:
        return bool(pred(f))
    except Exception:
        return False


def _where(f: Frame) -> str:
    if not f.file:
        return f.function
    base = os.path.basename(f.file) or f.file
    return f"{f.function} ({base}:{f.line})" if f.line is not None else f"{f.function} ({base})"
