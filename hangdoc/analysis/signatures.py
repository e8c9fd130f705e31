"""What a stack is waiting in: a collective, a point-to-point transfer, a host sync, a DataLoader...

Two functions, both pure and cached per frame:

* :func:`classify` names one frame (``broadcast`` in ``torch/distributed/distributed_c10d.py`` is a
  collective ``broadcast``; ``cudaStreamSynchronize`` is a host sync; ``wait`` in ``threading.py`` is
  a lock wait) or returns ``None``;
* :func:`classify_stack` reads a whole stack (outermost first, as in :class:`~hangdoc.model.Thread`)
  and returns one :class:`Wait`: the category, the operation, the frame where it waits, the user
  frame that called it, and the peer or root when ``--locals`` showed it.

The signatures are one table (:data:`~hangdoc.analysis.signature_table.SIGNATURES`), matched on the function name (the last dotted
part, so ``Condition.wait`` of Python 3.11+ and ``wait`` of 3.8 are the same) and on the end of the
file path (absolute, ``site-packages``-relative or py-spy's short form all match). They cover
torch 1.x-2.x (with and without the ``c10d_logger`` wrappers), DeepSpeed's ``deepspeed.comm`` and
pipe engine, Megatron's mappings, and the native frames of py-spy ``--native``, gdb and pystack.

Reading a stack: from the innermost frame outwards, every frame that is library code (torch,
the standard library, communication wrappers, native code) or that matches a signature belongs to
the *wait chain*; the first frame outside it is the user call site. In the chain the outermost
operation wins (``broadcast_object_list`` over the ``broadcast`` it calls; DeepSpeed's ``p2p.recv``
over the ``broadcast`` that implements it), and a plain lock, sleep or I/O wait only counts when no
operation encloses it (a DataLoader's queue wait is a DataLoader wait, not a lock wait).

    >>> from hangdoc.model import Frame
    >>> stack = (Frame("<module>", "train.py", 40), Frame("train_step", "train.py", 12),
    ...          Frame("wrapper", "torch/distributed/c10d_logger.py", 83),
    ...          Frame("all_reduce", "torch/distributed/distributed_c10d.py", 2501))
    >>> w = classify_stack(stack)
    >>> (w.category, w.op, w.call_site.label())
    ('collective', 'all_reduce', 'train_step (train.py:12)')
    >>> w.describe()
    'all_reduce at train_step (train.py:12)'
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

from hangdoc.analysis.signature_table import (
    _GLOO_OPS, _HOST_SYNC_NAMES, _LIBRARY, _NCCL_OPS, _RECV_OPS, _ROOTED, _STDLIB, _TABLE,
)
from hangdoc.model import Frame

#: Every category a stack can be in, from most to least specific.
CATEGORIES = (
    "collective",
    "p2p",
    "host-sync",
    "dataloader-wait",
    "dataloader-worker",
    "lock",
    "sleep",
    "io",
    "compute",
    "unknown",
)

#: Categories that wait on another rank (or on the device) rather than on something local.
DISTRIBUTED = frozenset({"collective", "p2p", "host-sync"})
#: Categories that name an enclosing operation; they win over the plain waits inside them.
_OPERATIONS = frozenset({"collective", "p2p", "host-sync", "dataloader-wait"})
#: Plain blocking primitives: only the verdict when nothing encloses them.
PLAIN_WAITS = frozenset({"lock", "sleep", "io"})


@dataclass(frozen=True)
class Signature:
    """What one frame is. ``context`` signatures only count when a plain wait is inside them."""

    category: str
    op: str
    context: bool = False


@dataclass(frozen=True)
class Wait:
    """What a stack is waiting in.

    ``frame`` is the frame that names the wait (``broadcast (torch/distributed/distributed_c10d.py)``),
    ``call_site`` the first frame outside library code around it (the user's line), ``peer`` the other
    rank of a send/recv and ``root`` the source/destination of a rooted collective, both global
    ranks, when ``--locals`` showed them (``peer_is_group_rank`` when only ``group_src``/``group_dst``
    did). ``detail`` says more for DataLoader workers (``idle`` or what the worker is stuck in).
    """

    category: str
    op: str = ""
    frame: Optional[Frame] = None
    call_site: Optional[Frame] = None
    peer: Optional[int] = None
    root: Optional[int] = None
    peer_is_group_rank: bool = False
    detail: str = ""

    @property
    def is_wait(self) -> bool:
        """True when the stack is blocked in something (not computing, not unknown)."""
        return self.category not in ("compute", "unknown")

    def place(self, with_line: bool = True) -> Tuple:
        """A hashable key: same category, operation, waiting frame and call site = same place.

        ``with_line=False`` ignores the line *inside* the waiting frame (the call site's line
        always counts): ranks entering a collective and ranks blocked in it share a place.
        """
        def fk(f: Optional[Frame], line: bool) -> Tuple:
            if f is None:
                return ()
            return (f.function, f.file, f.line if line else None)

        return (self.category, self.op, fk(self.frame, with_line), fk(self.call_site, True), self.peer, self.root, self.detail)

    def describe(self) -> str:
        """``broadcast at _bcast_pipe_scalar (deepspeed/runtime/pipe/engine.py:542)``."""
        what = self.op or self.category
        if self.category == "p2p" and self.peer is not None:
            what += f" {'←' if self.op in _RECV_OPS else '→'} {'group rank ' if self.peer_is_group_rank else 'rank '}{self.peer}"
        elif self.root is not None:
            what += f" (root {'group rank ' if self.peer_is_group_rank else 'rank '}{self.root})"
        if self.category == "dataloader-worker":
            what = f"DataLoader worker {self.detail or 'busy'}"
        if self.category == "dataloader-wait":
            what = "DataLoader wait"
        if self.category == "host-sync":
            what = _HOST_SYNC_NAMES.get(self.op, self.op) + " (host sync)"
        if self.category == "compute":
            what = "compute"
        if self.category == "lock" and self.detail.startswith("waiting for "):
            what = self.detail
        where = self.call_site or self.frame
        if where is None:
            return what
        return f"{what} at {where.label()}"


@functools.lru_cache(maxsize=65536)
def _fn_name(function: str, native: bool) -> str:
    if native:
        return function.strip()
    # Python 3.11+ qualified names: "Condition.wait", "_exception_logger.<locals>.wrapper".
    return function.rsplit(".", 1)[-1].strip()


@functools.lru_cache(maxsize=65536)
def _classify(function: str, file: str, native: bool) -> Optional[Signature]:
    name = _fn_name(function, native)
    path = file.replace("\\", "/")
    for category, op, fn_re, path_re, want_native, context in _TABLE:
        if want_native is not None and want_native != native:
            continue
        if path_re is not None and not path_re.search(path):
            continue
        if not fn_re.fullmatch(name):
            continue
        return Signature(category, _op_name(category, op, name), context)
    return None


def _op_name(category: str, op: str, name: str) -> str:
    if op:
        return op
    if category == "collective":
        m = re.search(r"gloo::(\w+)", name)
        if m:
            return _GLOO_OPS.get(m.group(1), m.group(1))
        m = re.search(r"nccl(\w+)", name)
        if m and not name.startswith("c10d"):
            return _NCCL_OPS.get(m.group(1), m.group(1))
        m = re.search(r"ProcessGroup\w*::(\w+)", name)
        if m:
            return _GLOO_OPS.get(m.group(1), m.group(1))
    return name


def classify(frame: Frame) -> Optional[Signature]:
    """The :class:`Signature` of one frame, or ``None`` when it is not a known wait or operation.

    >>> classify(Frame("broadcast", "/opt/conda/lib/python3.8/site-packages/torch/distributed/distributed_c10d.py", 1191))
    Signature(category='collective', op='broadcast', context=False)
    >>> classify(Frame("Condition.wait", "threading.py", 355)).category
    'lock'
    >>> classify(Frame("cudaStreamSynchronize", "libcudart.so.12", native=True)).op
    'synchronize'
    >>> classify(Frame("train_step", "train.py", 3)) is None
    True
    """
    return _classify(frame.function, frame.file or "", _native(frame))


_NATIVE_FILE = re.compile(r"\.(so(\.[\d.]+)?|dylib|dll|pyd|c|cc|cpp|cxx|h|hpp|cu|cuh|c\.h)$|^\[|^0x")


def _native(frame: Frame) -> bool:
    # A reader that did not flag a native frame still names its shared object or C source
    # (py-spy --native: "poll (libc.so.6)", "select_poll_poll_impl (selectmodule.c:655)").
    return frame.native or frame.function.startswith("0x") or bool(frame.file and _NATIVE_FILE.search(frame.file))


@functools.lru_cache(maxsize=65536)
def _is_library(function: str, file: str, native: bool) -> bool:
    if native:
        return True
    path = file.replace("\\", "/")
    if not path:
        return False
    if _LIBRARY.search(path) or _STDLIB.search(path):
        return True
    return _plumbing(Frame(function, file, None, native))


def _plumbing(frame: Frame) -> bool:
    # The readers' own idea of plumbing (launcher wrappers, ...) when that module is present.
    try:
        from hangdoc.analysis.normalize import is_plumbing
    except Exception:
        return False
    try:
        return bool(is_plumbing(frame))
    except Exception:
        return False


def is_library(frame: Frame) -> bool:
    """True for frames of torch, the standard library, communication wrappers and native code.

    >>> is_library(Frame("get", "/usr/lib/python3.10/queue.py", 179)), is_library(Frame("main", "train.py", 9))
    (True, False)
    """
    return _is_library(frame.function, frame.file or "", _native(frame))


# --- stacks --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Shape:
    """The part of a stack's classification that does not depend on locals (cached)."""

    category: str
    op: str
    frame_index: Optional[int]
    call_site_index: Optional[int]
    detail: str = ""
    chain_start: int = 0


_shape_cache: Dict[Tuple[Frame, ...], _Shape] = {}
_SHAPE_CACHE_MAX = 100_000


def classify_stack(frames: Sequence[Frame], state: Optional[str] = None) -> Wait:
    """What the stack ``frames`` (outermost first) is waiting in; see the module docstring.

    ``state`` is the dumper's thread state (py-spy's ``idle``/``active``): a stack with no wait
    signature is ``compute`` unless the dumper said the thread was idle (then ``unknown``: blocked
    in something that left no recognisable frame, such as a C call without ``--native``).

    >>> from hangdoc.model import Frame
    >>> s = (Frame("<module>", "train.py", 9), Frame("__next__", "torch/utils/data/dataloader.py", 530),
    ...      Frame("_next_data", "torch/utils/data/dataloader.py", 1207),
    ...      Frame("_get_data", "torch/utils/data/dataloader.py", 1163),
    ...      Frame("_try_get_data", "torch/utils/data/dataloader.py", 1011),
    ...      Frame("get", "queue.py", 179), Frame("wait", "threading.py", 306))
    >>> w = classify_stack(s)
    >>> w.category, w.frame.function, w.call_site.label()
    ('dataloader-wait', '_try_get_data', '<module> (train.py:9)')
    >>> classify_stack((Frame("main", "train.py", 3),), state="active").category
    'compute'
    """
    frames = tuple(frames)
    shape = _shape_cache.get(frames)
    if shape is None:
        shape = _shape(frames)
        if len(_shape_cache) >= _SHAPE_CACHE_MAX:
            _shape_cache.clear()
        _shape_cache[frames] = shape
    category = shape.category
    if category == "compute" and state is not None and state.lower().startswith("idle"):
        category = "unknown"
    frame = frames[shape.frame_index] if shape.frame_index is not None else None
    call_site = frames[shape.call_site_index] if shape.call_site_index is not None else None
    peer = root = None
    group_rank = False
    if category in ("p2p", "collective"):
        peer, root, group_rank = _peer(frames[shape.chain_start:], shape.op)
        if category == "collective" and shape.op not in _ROOTED:
            root = None
    detail = shape.detail
    if category == "dataloader-worker" and detail == "busy" and state is not None and state.lower().startswith("idle"):
        detail = "blocked"  # idle inside the user's dataset code: a C-level wait such as a lock
    if category == "unknown" and frames and _BACKWARD.fullmatch(_fn_name(frames[-1].function, False)) \
            and _BACKWARD_FILE.search((frames[-1].file or "").replace("\\", "/")):
        # Idle (not on a CPU) inside autograd's engine: backward computes on the calling thread on
        # CPU, so an idle one waits, and what backward waits on is the gradient reduction that
        # DDP's and FSDP's hooks issue inside it (or, on GPUs, device work behind it)
        site = next((f for f in reversed(frames) if not is_library(f)), None)
        return Wait("collective", BACKWARD_OP, frames[-1], site, None, None, False,
                    "idle inside autograd's backward: the gradient collectives of DDP's or FSDP's hooks run there")
    if category in ("compute", "unknown") and frames and not is_library(frames[-1]):
        # Python frames hide a C-level wait (``with LOCK:``, ``os.waitpid``): the source line says it
        from hangdoc.analysis.source_waits import blocking_call, request_wait

        req = request_wait(frames[-1].file or "", frames[-1].line)
        if req is not None:  # ``req.wait()`` on a request of isend/irecv or an async collective
            return Wait(req[0], req[1], frames[-1], frames[-1], None, None, False, f"waiting for its request (`{req[2]}`)")
        found = blocking_call(frames[-1].file or "", frames[-1].line)
        if found is not None:
            return Wait("lock", "", frames[-1], frames[-1], None, None, False, f"waiting for {found[0]} (`{found[1]}`)")
    return Wait(category, shape.op, frame, call_site, peer if category == "p2p" else None, root,
                group_rank, detail)


#: the op of a main thread idle in autograd's backward (:func:`classify_stack`)
BACKWARD_OP = "backward (gradient collectives)"
_BACKWARD = re.compile(r"_engine_run_backward|run_backward|backward")
_BACKWARD_FILE = re.compile(r"torch/(autograd/(graph|__init__)|_tensor)\.py$")


def _shape(frames: Tuple[Frame, ...]) -> _Shape:
    if not frames:
        return _Shape("unknown", "", None, None)
    sigs = [classify(f) for f in frames]
    n = len(frames)

    # A DataLoader worker process: its own category, whatever it is doing inside.
    for i, s in enumerate(sigs):
        if s is not None and s.category == "dataloader-worker":
            # what it does: the frames inside its innermost _worker_loop frame, shaped once (a stack
            # of 10,000 _worker_loop frames recursed 10,000 deep, each level classifying the rest)
            last = max(j for j in range(i, n) if sigs[j] is not None and sigs[j].category == "dataloader-worker")
            inner = _shape(frames[last + 1:]) if last + 1 < n else _Shape("unknown", "", None, None)
            user = [j for j in range(i + 1, n) if not is_library(frames[j])]
            if inner.category in _OPERATIONS or inner.category in PLAIN_WAITS:
                idle = not user  # only torch/stdlib frames below _worker_loop: waiting for an index
                detail = "idle" if idle else f"stuck in {inner.category if inner.category != 'lock' else 'a lock'}"
            else:
                detail = "busy" if user else "idle"
            site = user[-1] if user else None
            at = (inner.frame_index + last + 1) if inner.frame_index is not None else (user[-1] if user else i)
            return _Shape("dataloader-worker", "worker", at, site, detail, i)

    # The wait chain: innermost frames that are library code or that a signature names.
    start = n
    while start > 0 and (sigs[start - 1] is not None or is_library(frames[start - 1])):
        start -= 1
    call_site = start - 1 if start > 0 else None

    op_at: Optional[int] = None
    plain_at: Optional[int] = None
    for j in range(n - 1, start - 1, -1):  # innermost first
        s = sigs[j]
        if s is None:
            continue
        if s.category in PLAIN_WAITS:
            if plain_at is None:
                plain_at = j
            continue
        if s.context and plain_at is None and op_at is None:
            continue  # e.g. _next_data with no wait inside: a single-process loader computing
        op_at = j  # outermost operation wins: keep overwriting while walking outwards
    if op_at is not None:
        s = sigs[op_at]
        assert s is not None
        if s.context:
            # A context signature names the wait; point at the innermost frame of its kind.
            for j in range(n - 1, op_at - 1, -1):
                t = sigs[j]
                if t is not None and t.category == s.category:
                    op_at = j
                    break
        return _Shape(s.category, s.op, op_at, call_site, "", start)
    if plain_at is not None:
        s = sigs[plain_at]
        assert s is not None
        # The outermost stdlib frame of the chain names the wait best (queue.get over Condition.wait).
        return _Shape(s.category, s.op, plain_at, call_site, "", start)
    inner = n - 1
    return _Shape("compute", "", inner, call_site if call_site is not None else inner, "", start)


_KW_RE = re.compile(r"""['"](src|dst|group_src|group_dst|src_rank|dest_rank|dst_rank)['"]\s*:\s*(-?\d+|None)""")
_GLOBAL_NAMES = ("src", "dst", "src_rank", "dest_rank", "dst_rank")
_GROUP_NAMES = ("group_src", "group_dst")


def _int(v: Optional[str]) -> Optional[int]:
    if v is None:
        return None
    v = v.strip()
    try:
        return int(v)
    except ValueError:
        return None


def _peer(chain: Sequence[Frame], op: str) -> Tuple[Optional[int], Optional[int], bool]:
    """(peer, root, is_group_rank) from the locals of the chain's frames, innermost first."""
    glob: Optional[int] = None
    grp: Optional[int] = None
    for f in reversed(chain):
        if not f.locals:
            continue
        for name in _GLOBAL_NAMES:
            v = _int(f.local(name))
            if v is not None and glob is None:
                glob = v
        for name in _GROUP_NAMES:
            v = _int(f.local(name))
            if v is not None and grp is None:
                grp = v
        kw = f.local("kwargs")
        if kw:
            for m in _KW_RE.finditer(kw):
                v = _int(m.group(2))
                if v is None:
                    continue
                if m.group(1) in _GROUP_NAMES:
                    grp = grp if grp is not None else v
                else:
                    glob = glob if glob is not None else v
        if glob is not None:
            break
    if glob is not None:
        return glob, glob, False
    if grp is not None:
        return grp, grp, True
    return None, None, False


_LAUNCHER_FILE = re.compile(r"torch/distributed/elastic/agent/|(^|/)torch/distributed/(run|launch)\.py$|deepspeed/launcher/|accelerate/commands/launch\.py$")
_SPAWN_FILE = re.compile(r"torch/multiprocessing/spawn\.py$")


def is_launcher_stack(frames: Sequence[Frame]) -> bool:
    """True for torchrun's elastic agent, ``torch.distributed.launch``, DeepSpeed's and accelerate's
    launchers, and the parent of ``torch.multiprocessing.spawn``: processes that wait for ranks,
    not ranks.

    >>> is_launcher_stack((Frame("main", "torch/distributed/run.py", 9), Frame("_invoke_run", "torch/distributed/elastic/agent/server/api.py", 908)))
    True
    """
    spawn_parent = False
    for f in frames:
        if f.native or not f.file:
            continue
        path = f.file.replace("\\", "/")
        if _LAUNCHER_FILE.search(path):
            return True
        if _SPAWN_FILE.search(path):
            name = _fn_name(f.function, False)
            if name == "_wrap":
                return False  # a child of mp.spawn: a rank
            if name in ("join", "start_processes", "spawn"):
                spawn_parent = True
    return spawn_parent


def wait_of(process) -> Wait:
    """The :class:`Wait` of a process's main thread (``unknown`` when it has none).

    >>> from hangdoc.model import Process, Thread
    >>> wait_of(Process(threads=[Thread("1", "MainThread", (Frame("main", "t.py", 1),), state="idle")])).category
    'unknown'
    """
    t = process.main_thread
    if t is None or not t.frames:
        return Wait("unknown")
    w = classify_stack(t.frames, t.state)
    if w.category == "host-sync" and w.op == "wait" and len(process.threads) > 1:
        # Native-only dumps (gdb) show the main thread in Work::wait; with gloo the collective
        # itself runs on a "pt_gloo_runloop" thread, whose stack names it.
        ops = {}
        for other in process.threads:
            if other is t:
                continue
            for f in other.frames:
                m = _GLOO_RUNLOOP_OP.search(f.function)
                if m:
                    ops.setdefault(_GLOO_OPS.get(m.group(1), m.group(1)), f)
                    break
        if len(ops) == 1:
            (op, frame), = ops.items()
            w = Wait("collective", op, frame, w.call_site, None, w.root, False, "from the gloo worker thread")
    elif (w.category in PLAIN_WAITS or w.op == BACKWARD_OP) and len(process.threads) > 1 and not any(_native(f) for f in t.frames):
        # The main thread waits on a queue or a lock for a communication thread (DeepSpeed's and
        # FSDP's overlap, a hand-made comm thread) that is itself in a collective: that collective
        # is what the rank waits in. Likewise a main thread idle in backward waits for autograd's
        # device thread, which runs the hooks (ZeRO-3's all_gather in backward).
        from hangdoc.analysis.normalize import is_hangdoc_thread

        side = []
        for other in process.threads:
            if other is t or not other.frames or is_hangdoc_thread(other.frames):
                continue
            o = classify_stack(other.frames, other.state)
            if o.category in ("collective", "p2p") and not (o.frame is not None and _native(o.frame)):
                side.append((other, o))
        if len({(o.category, o.op) for _, o in side}) == 1:
            other, o = side[0]
            w = Wait(o.category, o.op, o.frame, o.call_site, o.peer, o.root, o.peer_is_group_rank,
                     f"on its {other.name or 'side'} thread, which the main thread waits for ({w.describe()})")
    return w



_GLOO_RUNLOOP_OP = re.compile(r"gloo::(?:\(anonymous namespace\)::)?(allreduce|broadcast|allgatherv?|barrier|reduce_scatter|reduce|gather|scatter|alltoallv?)\(")


@functools.lru_cache(maxsize=4096)
def in_loop(file: str, line: int) -> Optional[bool]:
    """Whether ``file:line`` sits inside a ``for``/``while`` loop, when the source is readable here.

    Returns ``None`` when the file cannot be read or parsed (the usual case for dumps taken on
    another machine): then nobody knows. The name comes from a dump, so it is read as input: a
    regular file only (a FIFO would block, ``/dev/zero`` never end) and at most
    :data:`hangdoc.analysis.source_waits.MAX_SOURCE` bytes (:func:`~hangdoc.analysis.source_waits.source_bytes`).
    """
    from hangdoc.analysis.source_waits import source_tree

    tree = source_tree(file)
    if tree is None:
        return None
    found = False

    def visit(node: ast.AST, looped: bool) -> None:
        nonlocal found
        if found:
            return
        looped_here = looped or isinstance(node, (ast.For, ast.While, ast.AsyncFor))
        for child in ast.iter_child_nodes(node):
            start = getattr(child, "lineno", None)
            end = getattr(child, "end_lineno", start)
            if start is not None and end is not None and start <= line <= end:
                if isinstance(child, ast.stmt) and start == line and looped_here and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    found = True
                    return
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                    visit(child, False)
                else:
                    visit(child, looped_here)
            elif start is None:
                visit(child, looped_here)

    try:
        visit(tree, False)
    except RecursionError:  # a source nested deeper than Python's stack: nobody knows
        return None
    return found

