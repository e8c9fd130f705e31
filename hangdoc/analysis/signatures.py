"""What a stack is waiting in: a collective, a point-to-point transfer, a host sync, a DataLoader...

Two functions, both pure and cached per frame:

* :func:`classify` names one frame (``broadcast`` in ``torch/distributed/distributed_c10d.py`` is a
  collective ``broadcast``; ``cudaStreamSynchronize`` is a host sync; ``wait`` in ``threading.py`` is
  a lock wait) or returns ``None``;
* :func:`classify_stack` reads a whole stack (outermost first, as in :class:`~hangdoc.model.Thread`)
  and returns one :class:`Wait`: the category, the operation, the frame where it waits, the user
  frame that called it, and the peer or root when ``--locals`` showed it.

The signatures are one table (:data:`SIGNATURES`), matched on the function name (the last dotted
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
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

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


_HOST_SYNC_NAMES = {"item": ".item()", "synchronize": "CUDA synchronize", "wait": "Work.wait"}


# --- the table -----------------------------------------------------------------------------------

_C10D = r"torch/distributed/(distributed_c10d|c10d_logger|_functional_collectives|_functional_collectives_impl|device_mesh)\.py"
_COLLECTIVE_OPS = (
    "broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base",
    "all_gather_coalesced", "all_reduce_coalesced", "reduce_scatter", "reduce_scatter_tensor",
    "_reduce_scatter_base", "all_to_all", "all_to_all_single", "gather", "scatter", "barrier",
    "monitored_barrier", "broadcast_object_list", "all_gather_object", "gather_object",
    "scatter_object_list", "broadcast_multigpu", "all_reduce_multigpu", "all_gather_multigpu",
    "reduce_multigpu", "reduce_scatter_multigpu", "all_reduce_inplace", "all_gather_tensor",
    "reduce_scatter_tensor_coalesced", "all_gather_into_tensor_coalesced",
)
_P2P_OPS = ("send", "recv", "isend", "irecv", "batch_isend_irecv", "send_object_list", "recv_object_list")
_RECV_OPS = frozenset({"recv", "irecv", "recv_object_list"})
_ROOTED = frozenset({"broadcast", "reduce", "gather", "scatter", "broadcast_object_list", "gather_object",
                     "scatter_object_list", "broadcast_multigpu", "reduce_multigpu"})
#: Rooted one-to-many collectives: with gloo the receivers may finish before the root does.
ONE_TO_MANY = frozenset({"broadcast", "scatter", "broadcast_object_list", "scatter_object_list", "broadcast_multigpu"})

_GLOO_OPS = {
    "allreduce": "all_reduce", "broadcast": "broadcast", "allgather": "all_gather", "allgatherv": "all_gather",
    "barrier": "barrier", "reduce": "reduce", "gather": "gather", "scatter": "scatter", "alltoall": "all_to_all",
    "alltoallv": "all_to_all", "reduce_scatter": "reduce_scatter", "_allgather_base": "all_gather",
}
_NCCL_OPS = {
    "AllReduce": "all_reduce", "Broadcast": "broadcast", "AllGather": "all_gather", "ReduceScatter": "reduce_scatter",
    "Reduce": "reduce", "Send": "send", "Recv": "recv",
}

# (category, op, function regex, file regex or None, native: True/False/None, context)
# op "" means "the function name"; ops that are not known collective names keep the table's op.
_Row = Tuple[str, str, str, Optional[str], Optional[bool], bool]
SIGNATURES: List[_Row] = [
    # torch.distributed, every version: the API functions (and torch 2.x's wrappers around them).
    ("collective", "", "|".join(_COLLECTIVE_OPS), _C10D, False, False),
    ("p2p", "", "|".join(_P2P_OPS), _C10D, False, False),
    ("collective", "", "|".join(_COLLECTIVE_OPS), r"torch/distributed/_functional_collectives\.py", False, False),
    # Group creation: every rank must call new_group (a store rendezvous), so it is waited in like
    # a collective of the whole job.
    ("collective", "new_group", r"new_group|new_subgroups(_by_enumeration)?|_new_group_with_tag|_new_process_group_helper|_store_based_barrier",
     _C10D, False, False),
    # torch._C._distributed_c10d.Work.wait as a Python frame (pystack), and the future of a p2p op.
    ("host-sync", "wait", r"wait|_wait|wait_tensor", r"torch/distributed/_functional_collectives(_impl)?\.py", False, False),
    # DeepSpeed's communication layer and its torch backend; Megatron's mappings.
    ("collective", "", "|".join(_COLLECTIVE_OPS + ("inference_all_reduce", "all_gather_base", "reduce_scatter_base", "allgather_fn", "reduce_scatter_fn")),
     r"deepspeed/comm/(comm|torch|backend|ccl)\.py", False, False),
    ("p2p", "", "|".join(_P2P_OPS), r"deepspeed/comm/(comm|torch|backend|ccl)\.py", False, False),
    ("p2p", "", "send|recv|isend|irecv|send_obj|recv_obj|_send|_recv", r"deepspeed/runtime/pipe/p2p\.py", False, False),
    ("collective", "all_reduce", r"_reduce|_reduce_scatter_along_first_dim", r"megatron/(core/tensor_parallel|mpu)/mappings\.py", False, False),
    ("collective", "all_gather", r"_gather|_gather_along_first_dim|_gather_along_last_dim", r"megatron/(core/tensor_parallel|mpu)/mappings\.py", False, False),
    ("p2p", "", r"_communicate|_batched_p2p_ops|_p2p_ops|send_forward|recv_forward|send_backward|recv_backward|send_forward_recv_backward|send_backward_recv_forward",
     r"megatron/(core/pipeline_parallel/)?p2p_communication\.py", False, False),
    # Host-side waits for device work (NCCL collectives are asynchronous to the host).
    ("host-sync", "synchronize", r"synchronize", r"torch/cuda/(__init__|streams)\.py", False, False),
    ("host-sync", "wait", r"wait", r"torch/futures/__init__\.py", False, False),
    # DataLoader, main side: waiting for the next batch from the workers (torch 1.0 named it _get_batch).
    ("dataloader-wait", "next batch", r"_try_get_data|_get_data|_get_batch", r"torch/utils/data/dataloader\.py", False, False),
    ("dataloader-wait", "next batch", r"_next_data|__next__", r"torch/utils/data/dataloader\.py", False, True),
    # DataLoader, worker side.
    ("dataloader-worker", "worker", r"_worker_loop", r"torch/utils/data/_utils/worker\.py", False, False),
    # Locks, sleeps and I/O in the standard library.
    ("lock", "lock", r"wait|acquire|join|_wait_for_tstate_lock|wait_for|__enter__", r"(^|/)threading\.py", False, False),
    ("lock", "lock", r"acquire|__enter__|wait", r"multiprocessing/(synchronize|managers)\.py", False, False),
    ("lock", "queue", r"get|put|join", r"(^|/)queue\.py", False, False),
    ("io", "io", r"select|poll|_poll|wait|recv|_recv|_recv_bytes|recv_bytes|recv_into|readinto|read|accept|connect|create_connection|sendall|send|readline|_readline",
     r"(^|/)(selectors|socket|ssl|multiprocessing/connection|multiprocessing/queues|subprocess|http/client|asyncio/[a-z_]+)\.py", False, False),
    ("sleep", "sleep", r"sleep", r"(^|/)asyncio/tasks\.py", False, False),
    # Native frames: py-spy --native, gdb, pystack --native.
    ("collective", "", r"(c10d::)?ProcessGroup(Gloo|NCCL|MPI|UCC)?::(allreduce|broadcast|allgather|_allgather_base|reduce_scatter|_reduce_scatter_base|alltoall|alltoall_base|barrier|reduce|gather|scatter)\b.*", None, True, False),
    ("p2p", "recv", r"(c10d::)?ProcessGroup\w*::(RecvWork|recv|recvAnysource)\b.*", None, True, False),
    ("p2p", "send", r"(c10d::)?ProcessGroup\w*::(SendWork|send)\b.*", None, True, False),
    ("host-sync", "synchronize", r"(c10d::)?ProcessGroupNCCL::WorkNCCL::(synchronize|wait|synchronizeStreams)\b.*", None, True, False),
    ("collective", "", r"gloo::(allreduce|broadcast|allgather|allgatherv|barrier|reduce|gather|scatter|alltoall|alltoallv|reduce_scatter)\b.*", None, True, False),
    ("collective", "gloo", r"gloo::.*", None, True, False),
    ("collective", "", r"nccl(AllReduce|Broadcast|AllGather|ReduceScatter|Reduce|Send|Recv)\b.*", None, True, False),
    ("collective", "nccl", r"ncclGroupEnd|ncclCommInitRank\w*|ncclCommAbort|ncclCommDestroy", None, True, False),
    ("host-sync", "synchronize", r"cuda(Stream|Device|Event)Synchronize\w*|cudaMemcpy|cudaMemcpy2D|cu(Stream|Ctx|Event)Synchronize\w*|cuMemcpyDtoH\w*|hip(Stream|Device|Event)Synchronize\w*|hipMemcpy|c10::cuda::device_synchronize|THCPModule_cudaSynchronize|c10::cuda::stream_synchronize\w*", None, True, False),
    ("host-sync", "item", r"(at::native::)?_local_scalar_dense\w*|(at::)?_ops::_local_scalar_dense\b.*|THPVariable_item|at::Tensor::item\b.*", None, True, False),
    ("host-sync", "wait", r"(c10d::)?Work::wait\b.*|c10::ivalue::Future::wait\b.*", None, True, False),
    ("dataloader-worker", "worker", r"_worker_loop", None, True, False),
    ("lock", "lock", r"PyThread_acquire_lock\w*|acquire_timed|lock_PyThread_acquire_lock|pthread_mutex_\w*lock|pthread_cond_\w*wait|__pthread_cond_wait\w*|sem_\w*wait|__new_sem_wait\w*|do_futex_wait\w*|__futex_abstimed_wait\w*|futex_wait\w*|std::condition_variable::wait\w*|std::mutex::lock|take_gil|drop_gil|_PyMutex_LockTimed|PyMUTEX_LOCK|PyCOND_\w*WAIT", None, True, False),
    # a process that signalled itself (os.kill(os.getpid(), SIGSTOP)) and is now stopped
    ("sleep", "stopped by a signal", r"kill|tgkill|raise|pthread_kill|os_kill\w*|__pthread_kill\w*", None, True, False),
    ("sleep", "sleep", r"sleep|pysleep|time_sleep|_{0,2}clock_nanosleep\w*|_{0,2}nanosleep\w*|usleep|std::this_thread::sleep_for\b.*", None, True, False),
    ("io", "io", r"_{0,2}(libc_)?(select|poll|epoll_wait|epoll_pwait|recv|recvfrom|recvmsg|read|accept4?|connect|ppoll|pselect6?)\w*|select|poll|epoll_wait|recv|read|accept", None, True, False),
]


def _compile(rows: Iterable[_Row]):
    out = []
    for category, op, fn, path, native, context in rows:
        out.append((category, op, re.compile(rf"(?:{fn})"), re.compile(rf"(?:{path})$") if path else None, native, context))
    return out


_TABLE = _compile(SIGNATURES)

#: Library code: its frames are part of the wait chain even when no signature names them.
_LIBRARY = re.compile(
    r"(^|/)(torch|torchvision|torchaudio|triton|deepspeed/comm|deepspeed/utils|deepspeed/runtime/pipe/p2p\.py|deepspeed/runtime/comm"
    r"|megatron/(core/)?(tensor_parallel|mpu)/mappings\.py|megatron/core/parallel_state\.py|megatron/core/pipeline_parallel/p2p_communication\.py"
    r"|accelerate/utils/operations\.py|lightning/fabric/utilities/distributed\.py|pytorch_lightning/utilities/distributed\.py"
    r"|hangdoc/runtime|multiprocessing|concurrent|asyncio|importlib|logging|http|email|json|encodings|collections|contextlib\.py"
    r"|threading\.py|queue\.py|selectors\.py|socket\.py|ssl\.py|subprocess\.py|functools\.py|runpy\.py|weakref\.py|typing\.py|typing_extensions\.py"
    r")(?=/|$)"
)
_STDLIB = re.compile(r"/lib/python3\.\d+/(?!site-packages|dist-packages)|^<frozen |^<string>")


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
    if category in ("compute", "unknown") and frames and not is_library(frames[-1]):
        # Python frames hide a C-level wait (``with LOCK:``, ``os.waitpid``): the source line says it
        from hangdoc.analysis.source_waits import blocking_call

        found = blocking_call(frames[-1].file or "", frames[-1].line)
        if found is not None:
            return Wait("lock", "", frames[-1], frames[-1], None, None, False, f"waiting for {found[0]} (`{found[1]}`)")
    return Wait(category, shape.op, frame, call_site, peer if category == "p2p" else None, root,
                group_rank, detail)


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
    elif w.category in PLAIN_WAITS and len(process.threads) > 1 and not any(_native(f) for f in t.frames):
        # The main thread waits on a queue or a lock for a communication thread (DeepSpeed's and
        # FSDP's overlap, a hand-made comm thread) that is itself in a collective: that collective
        # is what the rank waits in.
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
    from hangdoc.analysis.source_waits import source_bytes

    source = source_bytes(file)
    if source is None:
        return None
    try:
        tree = ast.parse(source.decode("utf-8", "replace"))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
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

