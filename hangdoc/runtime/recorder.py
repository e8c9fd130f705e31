"""The collective recorder: what each rank actually issued to torch.distributed, in order.

``enable()`` wraps every torch.distributed communication entry point of the running torch
(discovered from ``torch.distributed.distributed_c10d``, with a floor of known names) so that each
call leaves one record in a bounded ring buffer: per-process-group sequence number, group name and
global ranks, op, input shapes and dtypes, root/peer as *global* ranks, async flag, the first user
call site, CUDA stream (CUDA tensors only), phase, time issued and completion state.

It never issues a collective, never synchronises, and contains its own exceptions: a failure
inside the recorder is reported once on stderr and the user's call goes ahead unrecorded.

    >>> from hangdoc.runtime import recorder
    >>> rec = recorder.enable(capacity=1000)        # doctest: +SKIP
    >>> with recorder.phase("backward"):            # doctest: +SKIP
    ...     torch.distributed.all_reduce(grad)
    >>> rec.records()[-1].describe()                # doctest: +SKIP
    'all_reduce([1024] float32)'
    >>> rec.dump()                                  # doctest: +SKIP
    'hangdoc-out/collectives-node1-r0-4242.jsonl'

What is and is not seen is documented in docs/recorder.md.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import functools
import gc
import json
import os
import sys
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

__all__ = ["enable", "disable", "get", "phase", "Recorder", "intercepted"]

# Record layout: a plain tuple per call, materialised into CollectiveRecord only when someone asks
# (records(), dump()). Tuples of ints, strings, code objects and dtypes are untracked by the garbage
# collector after their first collection, so a full ring buffer costs the GC nothing; a list (or a
# torch.Size) per record would make every full collection walk 100,000 of them. Completion of a
# host-synchronous call replaces the tuple in place (deque[-1] = ... for the common case: O(1)); a
# CUDA call's record is never rewritten: its stream's watermark says (Recorder._resolved).
_SEQ, _OP, _GROUP, _SHAPES, _DTYPES, _ROOT, _PEER, _ASYNC, _SITE, _STREAM, _PHASE, _T0, _T1, _STATE = range(14)

# Parameters that carry the tensors whose shapes must agree across ranks, in order of preference.
# Output-only arguments (gather_list on the root, say) are deliberately not recorded: they differ
# by rank by design and would read as mismatches.
_INPUT_PARAMS = (
    "tensor",
    "input_tensor",
    "input",
    "input_tensor_list",
    "input_list",
    "tensors",
    "tensor_list",
    "object_list",
    "scatter_object_output_list",
    "obj",
    "output_tensor",
    "output",
)
_ROOT_PARAMS = ("src", "dst")
_GROUP_ROOT_PARAMS = ("group_src", "group_dst")
_P2P_OPS = frozenset({"send", "recv", "isend", "irecv", "send_object_list", "recv_object_list"})
_OBJECT_PARAMS = frozenset({"object_list", "obj", "scatter_object_output_list"})

#: Known communication entry points: always wrapped when present, whatever discovery finds.
KNOWN = (
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_coalesced",
    "all_gather_into_tensor", "all_gather_object", "all_to_all", "all_to_all_single", "barrier",
    "monitored_barrier", "broadcast", "broadcast_object_list", "gather", "gather_object", "reduce",
    "reduce_scatter", "reduce_scatter_tensor", "scatter", "scatter_object_list", "send", "recv",
    "isend", "irecv", "send_object_list", "recv_object_list", "batch_isend_irecv",
    "_all_gather_base", "_reduce_scatter_base",
)
#: Bindings of torch.distributed that DDP/FSDP call at construction (C++ functions, no signature to
#: discover): name -> (op, parameter names in order).
BINDINGS = {
    "_broadcast_coalesced": ("broadcast_coalesced", ["group", "tensors", "buffer_size", "src"]),
    "_verify_params_across_processes": ("verify_params_across_processes", ["group", "tensors", "logger"]),
}
# Public functions with a ``group`` parameter that manage groups or query them: no communication
# worth a record (group creation is tracked through the group registry instead).
_NOT_COMM = frozenset({
    "get_rank", "get_world_size", "get_backend", "get_backend_config", "get_process_group_ranks",
    "get_global_rank", "get_group_rank", "destroy_process_group", "new_group", "new_subgroups",
    "new_subgroups_by_enumeration", "split_group", "shrink_group", "init_process_group",
    "is_initialized", "get_pg_count", "get_node_local_rank", "supports_complex",
})


class _Spec:
    """Per-function metadata computed once at wrap time, so the hot path does no introspection."""

    __slots__ = ("op", "tensor", "group", "root", "group_root", "async_op", "p2p", "objects", "always_async", "extract")

    def __init__(self, op: str, params: List[str]):
        def where(name: str) -> Optional[Tuple[int, str]]:
            return (params.index(name), name) if name in params else None

        self.op = op
        self.tensor = next((where(n) for n in _INPUT_PARAMS if n in params), None)
        self.objects = self.tensor is not None and self.tensor[1] in _OBJECT_PARAMS
        self.group = where("group")
        self.root = next((where(n) for n in _ROOT_PARAMS if n in params), None)
        self.group_root = next((where(n) for n in _GROUP_ROOT_PARAMS if n in params), None)
        self.async_op = where("async_op")
        self.p2p = op in _P2P_OPS
        self.always_async = op in ("isend", "irecv")
        self.extract = _make_extractor(self)


def _issue_body(spec: "_Spec", value: str, group: str, root: str, group_root: str, async_op: str) -> List[str]:
    """The statements that build and buffer one record, specialised for one function: they read
    the call's arguments from the expressions given and leave ``_rec`` (None: not recorded) and
    ``_first`` (the first tensor; for a CUDA tensor ``(stream name, stream object)``), plus the
    record's fields as locals (the completion rebuilds the record from them). Needs ``_r`` (the
    Recorder) and ``_frame``/``_hit`` (the caller's frame and its code kind) in scope.

    Dead branches are left out at generation time rather than tested per call.
    """
    op = spec.op
    out = [
        f"_info = _groups.get({group})",
        "if _info is None:",
        f"    _info = _group_info({group})",
        "if _info is None:",
        "    _rec = _first = None",
        "else:",
    ]
    b = [
        "_seqs = _r._seq",
        "_key = _info[0]",
        "_seq = _seqs.get(_key, 0)",
        "_seqs[_key] = _seq + 1",
        f"_root = {root}",
    ]
    if value == "None":
        b += ["_first = None", "_shapes = _dtypes = ()", "_cuda = False"]
    elif spec.objects:
        b += [f"if {value} is None:", "    _first = None", "    _shapes = _dtypes = ()",
              "else:", f"    _shapes, _dtypes, _first = _tensor_meta({value}, True)",
              "_cuda = _first is not None and _first.is_cuda"]
    else:
        # The common case inlined: one tensor of exactly torch.Tensor. Shapes and dtypes are
        # interned (see _SHAPES1): no new tuple per call.
        b += [f"if type({value}) is _Tensor[0]:",
              f"    _first = {value}",
              "    _shapes = _SHAPES1.get(_first.shape) or _intern_shape(_first.shape)",
              "    _dtypes = _DTYPES1.get(_first.dtype) or _intern_dtype(_first.dtype)",
              # torch built without CUDA: an exact torch.Tensor is never a CUDA one
              "    _cuda = _first.is_cuda" if _cuda_built() else "    _cuda = False",
              f"elif {value} is None:",
              "    _first = None", "    _shapes = _dtypes = ()", "    _cuda = False",
              "else:",
              f"    _shapes, _dtypes, _first = _tensor_meta({value}, False)",
              "    _cuda = _first is not None and _first.is_cuda"]
    if group_root != "None":
        b += [f"if _root is None and {group_root} is not None:",
              "    _ranks = _info[1]",
              f"    _root = _ranks[{group_root}] if _ranks and 0 <= {group_root} < len(_ranks) else {group_root}"]
    b += ["_peer, _root = _root, None" if spec.p2p else "_peer = None",
          "_ph = _phase[0]",
          "if _ph is None and _graph_task_id() != -1:",
          "    _ph = 'backward'",
          # (name, stream object) of the caller's current stream, cached per raw stream tuple: one
          # C call per record instead of torch.cuda.current_stream()'s Python.
          "if _cuda:",
          "    _first = _STREAMS.get(_CUR_STREAM[0](_first.get_device())) or _stream_of(_first)",
          "    _stream = _first[0]",
          "else:",
          "    _stream = None",
          "_site = (_hit[2].get(_frame.f_lasti) or _intern_site(_hit, _frame.f_lasti)) if not _hit[1] else _call_site(_frame)",
          "if _site is _NESTED:  # inside another recorded call: it is that call's, not one of its own",
          "    _seqs[_key] = _seq",
          "    _rec = None"]
    tail = ["_async = True" if spec.always_async else
            f"_async = True if {async_op} else False" if async_op != "None" else "_async = False",
            "_t0 = _time()",
            f"_rec = (_seq, {op!r}, _info, _shapes, _dtypes, _root, _peer, _async, _site, _stream, _ph, _t0, None, 'issued')"]
    if not spec.p2p:  # hangdoc.runtime.detect: rolling signature digests of collectives
        tail += ["if _detect is not None:", f"    _detect(_key, {op!r}, _shapes, _dtypes, _root, _rec)"]
    else:  # and per-peer counts of point-to-point calls
        tail += ["if _detect_p2p is not None:", f"    _detect_p2p({op!r}, _peer, _rec)"]
    tail += ["_r._buf.append(_rec)"]
    b += ["else:"] + ["    " + line for line in tail]
    return out + ["    " + line for line in b]


def _cuda_built() -> bool:
    """Whether the imported torch can make CUDA tensors at all (True when unsure)."""
    torch = sys.modules.get("torch")
    try:
        return bool(torch is None or torch._C._has_cuda or getattr(torch.version, "hip", None))
    except Exception:
        return True


def _make_extractor(spec: "_Spec") -> Callable[[tuple, dict, Any, tuple], tuple]:
    """``issue(args, kwargs, frame, hit) -> (record, first tensor)`` specialised for one function:
    argument positions become constant indexes, so there is no signature binding per call. The
    paths that cannot know the signature in advance use it (batch_isend_irecv, C++ bindings)."""
    lines = ["def issue(args, kwargs, _frame, _hit):", "    n = len(args)", "    _r = _recorder"]
    names = {}
    for var, where, default in (("value", spec.tensor, "None"), ("group", spec.group, "None"),
                                ("root", spec.root, "None"), ("group_root", spec.group_root, "None"),
                                ("async_op", spec.async_op, "False")):
        if where is None:
            names[var] = default
        else:
            i, name = where
            lines.append(f"    {var} = args[{i}] if n > {i} else kwargs.get({name!r}, {default})")
            names[var] = var
    lines += ["    " + line for line in _issue_body(spec, **names)]
    lines.append("    return _rec, _first")
    ns: Dict[str, Any] = {}
    exec("\n".join(lines), globals(), ns)  # noqa: S102 - the source is built from parameter names only
    return ns["issue"]


def _make_fast_wrapper(fn: Callable, spec: "_Spec") -> Optional[Callable]:
    """The wrapper of ``fn`` with ``fn``'s own signature and the record-building inlined: no
    ``*args/**kwargs`` packing, no argument lookups, no second Python call, and the host-synchronous
    completion inlined (the common case: a call on CPU tensors is complete when it returns).
    None where the signature cannot be reproduced exactly (C++ bindings, ``*args``)."""
    import inspect

    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    P = inspect.Parameter
    sig: List[str] = []
    call: List[str] = []
    kw_only = False
    defaults: List[Any] = []
    for i, p in enumerate(params):
        if p.kind in (P.VAR_POSITIONAL, P.VAR_KEYWORD) or not p.name.isidentifier() or p.name.startswith("_"):
            return None
        if p.kind is P.KEYWORD_ONLY and not kw_only:
            kw_only = True
            sig.append("*")
        if i and params[i - 1].kind is P.POSITIONAL_ONLY and p.kind is not P.POSITIONAL_ONLY:
            sig.append("/")
        if p.default is P.empty:
            sig.append(p.name)
        else:
            sig.append(f"{p.name}=_d[{len(defaults)}]")
            defaults.append(p.default)
        call.append(f"{p.name}={p.name}" if kw_only else p.name)
    if params and params[-1].kind is P.POSITIONAL_ONLY:
        sig.append("/")
    pos = [c for c in call if "=" not in c]
    kws = [c.split("=")[0] for c in call if "=" in c]
    args_t = "(" + "".join(f"{c}, " for c in pos) + ")"
    kwargs_d = "{" + ", ".join(f"{k!r}: {k}" for k in kws) + "}"
    names = [p.name for p in params]

    def arg(where: Optional[Tuple[int, str]], default: str) -> str:
        if where is None:
            return default
        if where[1] not in names:
            raise LookupError(where[1])
        return where[1]

    try:
        body = _issue_body(spec, arg(spec.tensor, "None"), arg(spec.group, "None"), arg(spec.root, "None"),
                           arg(spec.group_root, "None"), arg(spec.async_op, "False"))
    except LookupError:
        return None
    c = ", ".join(call)
    # The "work" setting catches the backend's Work inside the call: the generic path.
    slow = ("True" if spec.always_async else
            "_stream is not None or _async" if _CUDA_COMPLETION == "work" else "_async")
    fields = "_seq, {op!r}, _info, _shapes, _dtypes, _root, _peer, _async, _site, _stream, _ph, _t0".format(op=spec.op)
    lines = [
        "def factory(_fn, _d):",
        f"    def wrapper({', '.join(sig)}):",
        "        _r = _recorder",
        "        if _r is None:",
        f"            return _fn({c})",
        "        try:",
        "            _frame = _getframe(1)",
        "            _code = _frame.f_code",
        "            _hit = _internal_code.get(id(_code)) or _code_kind(_code)",
        "            if _hit[1] == 2:  # called by another c10d function (broadcast_object_list -> broadcast)",
        "                _rec = None",
        "            else:",
        *("                " + line for line in body),
        "        except _PASS_THROUGH:",
        "            raise",
        "        except Exception as _e:",
        "            _report(_e)",
        "            _rec = None",
        "        if _rec is None:",
        f"            return _fn({c})",
        f"        if {slow}:",
        f"            return _run_tracked(_fn, _rec, _first, {args_t}, {kwargs_d})",
        # After a pause on this stream, an event before this call's launch marks the end of the
        # previous burst: its last calls are then seen completed exactly (see _track_cuda).
        *(["        if _stream is not None:",
           "            _tm = _r._streams.get(_stream)",
           "            try:",
           f"                if _tm is not None and _t0 - _tm.last_call >= {min(_EVENT_GAP, _IDLE_AFTER)!r} and _tm.n != _tm.marked_n:",
           "                    _r._close_burst(_tm, _t0)",
           "            except Exception as _e:",
           "                _report(_e)"] if not spec.always_async else []),
        "        try:",
        f"            _result = _fn({c})",
        "        except BaseException:",
        "            _r = _recorder",
        "            if _r is not None:",
        "                _r._complete(_rec, 'failed')",
        "            raise",
        # A synchronous call on CUDA tensors is queued on its stream, not done: _track_cuda. The
        # common case is inlined: three stores, no CUDA call (an event is due at most once per
        # HANGDOC_CUDA_EVENT_GAP_MS on a stream, see _track_cuda).
        *(["        if _stream is not None:",
           "            try:",
           f"                if _tm is None or _t0 - _tm.last_event >= {_EVENT_GAP!r}:",
           "                    _r._track_cuda(_rec, _first, _t0)",
           "                else:  # _tm.launched(_rec, _t0), inlined",
           "                    _tm.last = _rec",
           "                    _tm.n += 1",
           "                    _tm.last_call = _t0",
           "            except Exception as _e:",
           "                _report(_e)",
           "            return _result"] if not spec.always_async else []),
        "        try:  # free in 3.11+ unless it raises",
        "            _t1 = _time()",
        "            _buf = _r._buf",
        # One new tuple from the locals: cheaper than slicing the issued one and concatenating.
        f"            _done = ({fields}, _t1, 'completed')",
        "            if _buf and _buf[-1] is _rec:",
        "                _buf[-1] = _done",
        "            else:",
        "                _r._replace(_rec, _done)",
        "            _r._progress += 1",
        "            _r._last_t1 = _t1",
        "        except Exception as _e:",
        "            _report(_e)",
        "        return _result",
        "    return wrapper",
    ]
    ns: Dict[str, Any] = {}
    exec("\n".join(lines), globals(), ns)  # noqa: S102 - the source is built from parameter names only
    return ns["factory"](fn, tuple(defaults))


#: torch.Tensor once torch is imported (enable() fills it): the exact-type fast path.
_Tensor: List[Any] = [None]
#: torch.cuda.Event once a CUDA stream was seen: completion markers are events or Work objects.
_Event: List[Any] = [None]


_DTYPE_NAMES: Dict[Any, str] = {}


def _dtype_name(dt: Any) -> str:
    name = _DTYPE_NAMES.get(dt)
    if name is None:
        name = _DTYPE_NAMES[dt] = str(dt).replace("torch.", "")
    return name


class _StreamState:
    """One CUDA stream's completion state (see Recorder._track_cuda). Written by the job's thread
    (the calls) and by sweeps under the recorder's sweep lock (the watermark)."""

    __slots__ = ("obj", "last", "n", "last_call", "last_event", "marked_n", "marks", "sweep_at", "done_n", "history")

    def __init__(self, obj: Any, capacity: int):
        self.obj = obj  # the torch stream: records events, answers idle queries
        self.last: Optional[tuple] = None  # the last call launched on it
        self.n = 0  # calls launched on it
        self.last_call = float("-inf")  # time issued of the last call
        self.last_event = float("-inf")  # time of its last event
        self.marked_n = 0  # n when the last event was recorded or the stream was found idle
        # (marker, last call launched before it, n then), oldest first; popped when done
        self.marks: collections.deque = collections.deque()
        self.sweep_at = _SWEEP_MIN  # markers that trigger the next sweep from the job's thread
        self.done_n = 0  # calls seen completed (the watermark)
        # (last call of a completed batch, time seen completed), oldest first: one entry per
        # batch, and only while its record is still in the ring buffer (Recorder._advance)
        self.history: collections.deque = collections.deque(maxlen=capacity)

    def launched(self, rec: tuple, t0: float) -> None:
        """A synchronous call on this stream returned (its kernels are queued). The generated
        wrappers inline these three stores."""
        self.last = rec
        self.n += 1
        self.last_call = t0


class Recorder:
    """The ring buffer of one process's calls, and its dumps.

    ``progress`` bumps on every completed call and ``last_progress`` is the ``time.monotonic()``
    of the last completion: the watchdog's progress signal. ``pending()`` lists calls issued but
    not seen completed: where this rank is really blocked.
    """

    def __init__(self, capacity: int = 100_000, out_dir: Optional[str] = None):
        self.capacity = capacity
        self.out_dir = out_dir
        self._buf: collections.deque = collections.deque(maxlen=capacity)
        self._progress = 0
        # Wall time of the last completion; ``last_progress`` converts it to the monotonic clock
        # only when read, so the hot path reads one clock, not two.
        self._last_t1 = time.time()
        # id(Work) -> (Work, [records]) for async calls not yet seen completed. The strong reference
        # keeps the id from being reused; entries go as soon as completion is observed.
        self._works: Dict[int, Tuple[Any, List[list]]] = {}
        # CUDA completion without a sync: per stream name, its _StreamState (see _track_cuda).
        # Events are pooled for reuse.
        self._streams: Dict[str, _StreamState] = {}
        self._event_pool: List[Any] = []
        self._sweep_lock = threading.Lock()
        self._works_sweep_at = 256  # pending async Works that trigger a sweep (see _finish)
        # a query thread still inside a CUDA/backend call (see _bounded): no new one meanwhile
        self._query_busy = False
        self._query_lock = threading.Lock()
        self._seq: Dict[Any, int] = {}
        self.errors = 0
        self.dumped_to: Optional[str] = None

    # -- the watchdog's view -------------------------------------------------------------------
    @property
    def last_progress(self) -> float:
        """``time.monotonic()`` of the last completed call (of enable() before any)."""
        return time.monotonic() - max(0.0, time.time() - self._last_t1)

    @property
    def progress(self) -> int:
        self._bounded(self._sweep)
        return self._progress

    def pending(self) -> List[Any]:
        """Records issued but not (yet) seen completed, oldest first."""
        self._bounded(self._sweep)
        return [self._materialise(r) for r in self._resolved() if r[_STATE] == "issued"]

    def records(self) -> List[Any]:
        """A snapshot of the buffer as :class:`~hangdoc.model.CollectiveRecord` objects."""
        self._bounded(self._sweep)
        return [self._materialise(r) for r in self._resolved()]

    def _bounded(self, fn: Callable[[], Any], timeout: float = 1.0) -> Any:
        """``fn()`` (a sweep, a Flight Recorder read), but never blocking the caller for long.

        Once CUDA is in use, these queries (cudaEventQuery, cudaStreamQuery, recording a tail
        event, Work.is_completed(), Flight Recorder's dump) can block behind a CUDA driver or NCCL
        call that the job's own thread is stuck in, and the caller is the watchdog, which must
        dump exactly then. So they run on a short-lived daemon thread and the caller waits at most
        ``timeout``: if it is stuck, the caller goes on with the states known so far, and no new
        query thread starts until the stuck one returns. None when it did not finish.
        """
        if not self._streams:  # no CUDA stream: CPU Work objects and bookkeeping only, inline
            return fn()
        with self._query_lock:
            if self._query_busy:
                return None
            self._query_busy = True
        done = threading.Event()
        out: List[Any] = []

        def query() -> None:
            try:
                out.append(fn())
            except Exception as e:
                _report(e)
            finally:
                with self._query_lock:
                    self._query_busy = False
                done.set()

        try:
            threading.Thread(target=query, name="hangdoc-recorder-query", daemon=True).start()
        except Exception as e:  # no thread to be had (interpreter shutting down)
            with self._query_lock:
                self._query_busy = False
            _report(e)
            return None
        if not done.wait(timeout):
            return None
        return out[0] if out else None

    def _complete(self, rec: tuple, state: str = "completed") -> None:
        if rec[_STATE] == "issued":
            t1 = time.time()
            self._replace(rec, rec[:_T1] + (t1, state))
            if state == "completed":
                self._progress += 1
                self._last_t1 = t1

    def _replace(self, rec: tuple, new: tuple) -> None:
        """Swap ``rec`` for ``new`` in the buffer; recent records are found first."""
        buf = self._buf
        n = len(buf)
        for i in range(n - 1, max(-1, n - 50_000), -1):
            if buf[i] is rec:
                buf[i] = new
                return
        # Not found: evicted from the ring buffer already (or beyond the search window).

    def _sweep(self) -> None:
        """Observe completion of async work and CUDA events: non-blocking queries only."""
        try:
            for key, entry in list(self._works.items()):
                # Complete only an entry this thread removed: the user's wait() (_work_wait)
                # may complete the same one meanwhile, and a second completion of a record
                # already replaced scans the whole buffer for it in vain.
                if entry[0].is_completed() and self._works.pop(key, None) is entry:
                    # A failed Work raises in the user's wait(); is_success()/exception() are
                    # deprecated and warn, so success is not asked here.
                    for rec in entry[1]:
                        self._complete(rec)
            for st in list(self._streams.values()):
                # No tail event here: recording one off the job's thread blocked in
                # cuEventRecord on 2 x H200 while the job's thread spun in cuLaunchKernel behind
                # a hung NCCL kernel. The newest records without an event complete when the
                # stream is idle, or from Flight Recorder (where on) at a dump.
                if st.n != st.done_n and not self._sweep_idle(st):
                    self._sweep_stream(st)
        except Exception as e:  # a torn-down process group must not break the watchdog
            _report(e)

    def _sweep_idle(self, st: "_StreamState") -> bool:
        """A stream with nothing left to run (``cudaStreamQuery``, non-blocking) has completed every
        call launched on it so far: exact at once, no event needed. True when it was idle."""
        query = getattr(st.obj, "query", None)
        if query is None or not self._sweep_lock.acquire(False):
            return False
        try:
            last, n = st.last, st.n  # launched before the query (the job's thread may add more)
            if not query():
                return False
            marks = st.marks
            while marks and marks[0][2] <= n:
                self._pool(marks.popleft()[0])
            self._advance(st, last, n)
            return True
        finally:
            self._sweep_lock.release()

    def _advance(self, st: "_StreamState", last: tuple, n: int) -> None:
        """Every call on ``st`` up to ``last`` (the ``n``-th) is done: the stream's watermark moves.
        No record is touched: their states are read off the watermarks when the buffer is
        (``_resolved``), so completing a batch costs the same for 1 call or 10,000."""
        if n <= st.done_n:
            return
        t1 = time.time()
        history = st.history
        history.append((last, t1))
        # A batch whose last call has left the ring buffer matches no record any more (the calls
        # still there are all newer): drop it, so the history keeps no evicted record alive.
        buf = self._buf
        if buf:
            oldest = buf[0][_T0]
            while len(history) > 1 and history[0][0][_T0] < oldest:
                history.popleft()
        self._progress += n - st.done_n
        st.done_n = n
        self._last_t1 = t1

    def _pool(self, marker: Any) -> None:
        if type(marker) is _Event[0] and len(self._event_pool) < 1024:
            self._event_pool.append(marker)

    def _sweep_stream(self, st: "_StreamState") -> None:
        # The watchdog's thread and the caller's may both sweep: one at a time, the other skips.
        if not self._sweep_lock.acquire(False):
            return
        try:
            self._sweep_stream_locked(st)
        finally:
            self._sweep_lock.release()

    def _sweep_stream_locked(self, st: "_StreamState") -> None:
        # ``st.marks`` holds completion markers (CUDA events or Work objects), each with the last
        # call launched before it, in stream order. In-order completion: binary-search the newest
        # completed marker (O(log n) queries), after asking the newest one first: a GPU keeping
        # up has finished everything (one query).
        marks = list(st.marks)  # the caller's thread may append meanwhile: a snapshot
        lo, hi = 0, len(marks)  # marks[:lo] known complete, marks[hi:] known incomplete
        if hi:
            m = marks[-1][0]
            if (m.query() if type(m) is _Event[0] else m.is_completed()):
                lo = hi
            else:
                hi -= 1
        while lo < hi:
            mid = (lo + hi) // 2
            m = marks[mid][0]
            if (m.query() if type(m) is _Event[0] else m.is_completed()):
                lo = mid + 1
            else:
                hi = mid
        if lo:
            for _ in range(lo):
                self._pool(st.marks.popleft()[0])
            _, last, n = marks[lo - 1]
            self._advance(st, last, n)

    def _track_cuda(self, rec: tuple, stream: Tuple[str, Any], t0: float) -> None:
        """A synchronous call on CUDA tensors returned: it is queued on ``stream``, not done.

        Per stream (``_StreamState``): the last call launched and how many, and CUDA events
        (pooled) recorded after some of them. Work on one stream runs in order, so a completed
        event completes every call launched before it, and a stream found idle (``_sweep``: the
        watchdog's poll, ``pending()``, ``dump()``) completes every call launched so far without
        asking an event. Completion moves the stream's watermark; no record is rewritten. No sync
        is ever added, and no event is recorded off the job's thread.

        Where events go (``_EVENT_GAP``, HANGDOC_CUDA_EVENT_GAP_MS, 1 ms by default; 0 = after
        every call): after a stream's first call; after a call when the stream's last event is at
        least a gap old; and, when a call comes at least a gap after the previous one, before its
        launch (``_close_burst``), which marks the end of the burst before it. So calls a gap
        apart each get their own event (exact states at a hang), a burst is marked at its end,
        and inside a burst there is an event at most once per gap: at most one event per gap per
        stream, whatever the call rate (an event after every call cost ~9-13 µs a call in a tight
        loop of small NCCL calls on 2 x H200, docs/gpu.md). A call after a shorter pause (100 µs)
        first asks whether the stream is idle, as it is after a host sync: then everything
        launched completes with no event. Only calls inside the last gap of a burst that hangs
        mid-way read "issued" though they ran; Flight Recorder, where on, makes them exact at a
        dump.
        """
        st = self._streams.get(stream[0])
        if st is None:
            st = self._stream_state(stream)
        st.launched(rec, t0)
        if t0 - st.last_event >= _EVENT_GAP:
            self._mark(st, t0)

    def _close_burst(self, st: "_StreamState", t0: float) -> None:
        """Before a call's launch, after a pause since the stream's previous call, with calls
        launched after the last event (the callers check both): a stream found idle
        (``cudaStreamQuery``, on the job's thread: a host sync such as ``.item()`` drained it)
        completes them all, exactly and with no event; otherwise, after a pause of a whole gap,
        an event marks the end of the burst before this call. Pauses of ``_IDLE_AFTER`` or more
        only: at most one query per 100 µs."""
        if self._sweep_idle(st):
            st.marked_n = st.n
        elif t0 - st.last_call >= _EVENT_GAP:
            self._mark(st, t0)

    def _mark(self, st: "_StreamState", t0: float) -> None:
        """Record a pooled event on the stream after every call launched so far."""
        pool = self._event_pool
        ev = pool.pop() if len(pool) > _POOL_RESERVE else _new_event()
        _record_event(ev, st.obj)
        st.marks.append((ev, st.last, st.n))
        st.last_event = t0
        st.marked_n = st.n
        self._maybe_sweep(st)

    def _stream_state(self, stream: Tuple[str, Any], warm: bool = True) -> "_StreamState":
        """The state of ``(name, stream object)``, made at the stream's first call (with the event
        pool warmed, unless the caller's markers are the backend's Work objects)."""
        st = self._streams.get(stream[0])
        if st is None:
            st = _StreamState(stream[1], self.capacity)
            if warm:
                self._warm_pool(stream[1])
            self._streams[stream[0]] = st
        return st

    def _warm_pool(self, stream: Any, n: int = 8) -> None:
        """Create a few pooled events up front, in the job's own thread (CUDA creates an event at
        its first record). Only the job's thread creates or records events: both take the
        driver's context lock for writing, and on 2 x H200 a query thread blocked there behind
        the job's thread spinning in cuLaunchKernel (its stream wedged behind a hung NCCL
        kernel), so that rank never dumped."""
        for _ in range(n):
            ev = _new_event()
            _record_event(ev, stream)
            self._event_pool.append(ev)

    def _maybe_sweep(self, st: "_StreamState") -> None:
        # The sweep scans the markers: sweeping again only once they doubled keeps that O(1) per
        # marker even when the CPU runs far ahead of the GPU; the events come back to the pool.
        if len(st.marks) >= st.sweep_at:
            self._sweep_stream(st)
            st.sweep_at = max(_SWEEP_MIN, 2 * len(st.marks))

    def _track_cuda_work(self, rec: tuple, stream: Tuple[str, Any]) -> None:
        """The ``work`` setting: the backend's own Work for this call when c10d's Work.wait()
        handed it over (its end event is already recorded, so completion costs no CUDA call of
        ours), else the event path."""
        cap = _capture
        caught = cap[2]
        if caught is not None and caught[0] is rec:
            cap[2] = None
            st = self._stream_state(stream, warm=False)
            st.launched(rec, rec[_T0])
            st.last_event = rec[_T0]
            st.marks.append((caught[1], rec, st.n))  # held Work objects keep their tensors alive: sweep often
            st.marked_n = st.n
            self._maybe_sweep(st)
            return
        if cap[0] is rec:
            cap[0] = None
        self._track_cuda(rec, stream, rec[_T0])

    def _resolved(self) -> List[tuple]:
        """The buffer, oldest first, with each queued CUDA record's state read off its stream's
        watermarks: a record at or before a watermark is completed (at that watermark's time),
        a newer one is issued. Records are matched by identity, newest first, so a call still
        inside its launch (in the buffer, not yet counted) reads issued."""
        # Watermarks first: each names a record appended to the buffer before it was made.
        marks = {name: list(st.history) for name, st in list(self._streams.items()) if st.history}
        buf = list(self._buf)
        if not marks:
            return buf
        at = {name: len(h) for name, h in marks.items()}  # index of the batch being walked; len: newer than all
        for i in range(len(buf) - 1, -1, -1):
            r = buf[i]
            h = marks.get(r[_STREAM])
            if h is None or r[_ASYNC]:
                continue
            name = r[_STREAM]
            k = at[name]
            if k and r is h[k - 1][0]:
                k = at[name] = k - 1
            if k < len(h) and r[_STATE] == "issued":
                buf[i] = r[:_T1] + (h[k][1], "completed")
        return buf

    # -- output --------------------------------------------------------------------------------
    def _materialise(self, r: list) -> Any:
        from hangdoc.model import CollectiveRecord

        name, ranks = r[_GROUP]
        site = r[_SITE]
        if isinstance(site, tuple):  # (code, f_lasti), one shared tuple per site (_intern_site)
            hit = _SITE_TEXT.get(id(site))
            if hit is None or hit[0] is not site:
                code, lasti = site
                hit = _SITE_TEXT[id(site)] = (site, f"{code.co_filename}:{_line_of(code, lasti)}:{code.co_name}")
            site = hit[1]
        shapes = tuple(tuple(int(d) for d in sh) for sh in r[_SHAPES])
        dtypes = tuple(d if isinstance(d, str) else _dtype_name(d) for d in r[_DTYPES])
        return CollectiveRecord(
            rank=_IDENT[0], seq=r[_SEQ], op=r[_OP], group=name, group_ranks=ranks, shapes=shapes,
            dtypes=dtypes, root=r[_ROOT], peer=r[_PEER], async_op=r[_ASYNC], call_site=site or "",
            stream=r[_STREAM], phase=r[_PHASE], time_issued=r[_T0], time_completed=r[_T1], state=r[_STATE],
            host=_IDENT[1], pid=os.getpid(), origin="hangdoc",
        )

    def default_path(self) -> str:
        _refresh_identity()
        rank, host = _IDENT
        name = f"collectives-{host}-r{rank}-{os.getpid()}.jsonl"
        try:
            from hangdoc.runtime import options

            out = options.output_dir(self.out_dir)
            try:
                name = options.file_name("collectives", None) or name
            except Exception:
                pass
        except Exception:
            out = self.out_dir or os.environ.get("HANGDOC_OUT") or "hangdoc-out"
        return os.path.join(out, name)

    def dump(self, path: Optional[str] = None, limit: Optional[int] = None) -> str:
        """Write the buffer atomically as JSONL (header line, then one record per line); returns the path.

        ``limit``: only the newest ``limit`` records, plus the newest record of every group that
        has none among them (where each rank stands in every group is what a diagnosis aligns
        on); the header's ``tail`` then says so. What the exit dump writes (HANGDOC_EXIT_RECORDS).
        """
        from hangdoc.atomic import write_atomic

        path = path or self.default_path()
        write_atomic(path, self.dump_text(limit))
        self.dumped_to = path
        return path

    def dump_text(self, limit: Optional[int] = None) -> str:
        """What :meth:`dump` writes, as text (the watchdog keeps it in memory when it cannot be written)."""
        _refresh_identity()
        self._bounded(self._sweep)  # completions observed now belong in the header's progress too
        world = _world_size()
        raw = self._resolved()
        header = {"hangdoc": "collectives", "version": 1, "host": _IDENT[1], "rank": _IDENT[0],
                  "pid": os.getpid(), "world_size": world, "capacity": self.capacity,
                  "progress": self._progress, "dropped": 0, "errors": self.errors}
        if limit is not None and len(raw) > limit:
            raw = _tail(raw, limit)
            header["tail"] = limit
        header["dropped"] = max(0, self._total_issued() - len(raw))
        records = [self._materialise(r) for r in raw]
        refined = self._bounded(lambda: _refine_from_flight_recorder(records), timeout=2.0) or 0
        if refined:
            header["refined_by_flight_recorder"] = refined
        lines = [json.dumps(header)]
        lines.extend(json.dumps(r.to_json()) for r in records)
        return "\n".join(lines) + "\n"

    def _total_issued(self) -> int:  # one seq counter per group name
        return sum(self._seq.values())


def flight_recorder_on() -> bool:
    """Whether PyTorch's Flight Recorder records this process's collectives (its buffer size
    environment variables, read when a process group is created)."""
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        value = os.environ.get(name, "").strip()
        if value:
            try:
                return int(value) > 0
            except ValueError:
                return False
    return False


def _refine_from_flight_recorder(records: List[Any]) -> int:
    """Lift records Flight Recorder saw complete (see hangdoc.analysis.refine):
    the recorder's CUDA events are spaced in time, and Flight Recorder's C++ bookkeeping makes
    the calls after the last completed event exact at a dump. Reads this process's buffer only (no collective, no sync); never raises."""
    if not records or not flight_recorder_on():
        return 0
    try:
        c10d = sys.modules.get("torch._C._distributed_c10d")
        if c10d is None:
            return 0
        from hangdoc.analysis.refine import refine_states
        from hangdoc.readers import flight_recorder

        theirs: List[Any] = []
        for name in ("_dump_nccl_trace", "_dump_fr_trace"):
            fn = getattr(c10d, name, None)
            if fn is None:
                continue
            try:
                try:
                    data = fn(includeCollectives=True, includeStackTraces=False, onlyActive=False)
                except TypeError:
                    data = fn()
                theirs.extend(flight_recorder.records_of(flight_recorder.loads(data), records[0].rank))
            except Exception:  # this backend has no buffer (the generic one in an NCCL job)
                continue
        return refine_states(list(records) + theirs) if theirs else 0
    except Exception as e:
        _report(e)
        return 0


# ---------------------------------------------------------------------------------------------
# process-wide state

_recorder: Optional[Recorder] = None
_originals: Dict[Tuple[Any, str], Any] = {}
_wait_original: Optional[Callable] = None
_IDENT: List[Any] = [0, "localhost"]  # rank, host: refreshed when the default group exists
_phase: List[Optional[str]] = [None]
_graph_task_id: Callable[[], int] = lambda: -1
_reported = [False]
_internal_code: Dict[Any, bool] = {}
_internal_prefixes: Tuple[str, ...] = ()
_c10d_file = ""
#: id -> code of hangdoc's own wrappers: a call whose caller chain passes through one is part of
#: another recorded call (torch calling a patched collective from inside one), never a call of its own
_WRAPPER_CODES: Dict[int, Any] = {}
#: what _call_site returns for such a nested call
_NESTED = ("nested", -1)
_groups: Dict[Any, Tuple[str, Tuple[int, ...]]] = {}  # pg (or None) -> (name, global ranks)
_c10d: Any = None
#: hangdoc.runtime.detect's hook, called with each collective's signature (None: off), and the
#: exceptions it may raise that must reach the caller (its abort) instead of being contained.
_detect: Optional[Callable[..., None]] = None
#: its hook for point-to-point calls, called with (op, global peer rank, record) (None: off)
_detect_p2p: Optional[Callable[..., None]] = None
#: hangdoc.runtime.detect's hook, called before destroy_process_group() of the default group: the rank
#: is leaving (its loop ended), said to the others before a destroy that may block (NCCL)
_detect_leaving: Optional[Callable[[], None]] = None
_PASS_THROUGH: Tuple[type, ...] = ()


def _report(e: BaseException) -> None:
    if _recorder is not None:
        _recorder.errors += 1
    if not _reported[0]:
        _reported[0] = True
        try:
            sys.stderr.write(f"hangdoc recorder: {type(e).__name__}: {e} (recording continues; further errors are not shown)\n")
        except Exception:
            pass


def _refresh_identity() -> None:
    try:
        from hangdoc.runtime.identity import identity

        ident = identity()
        _IDENT[0], _IDENT[1] = ident.rank, ident.host
    except Exception as e:
        _report(e)


def _world_size() -> Optional[int]:
    try:
        if _c10d is not None and _c10d.is_initialized():
            return _c10d.get_world_size()
    except Exception:
        pass
    try:
        return int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        return None


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Tag every call issued inside the block with ``name`` (nested blocks: innermost wins).

        >>> from hangdoc.runtime.recorder import phase
        >>> with phase("eval"):
        ...     pass
    """
    prev = _phase[0]
    _phase[0] = name
    try:
        yield
    finally:
        _phase[0] = prev


#: id(site tuple) -> (site, "file:line:function"): the text once per call site, not per record
#: (the line table scan costs ~10 µs). Holds the site so that its id is not reused.
_SITE_TEXT: Dict[int, Tuple[tuple, str]] = {}


def _line_of(code: Any, lasti: int) -> Optional[int]:
    """The line of instruction offset ``lasti`` (what f_lineno computes, paid only at dump time)."""
    try:
        for start, end, line in code.co_lines():
            if start <= lasti < end:
                return line
    except Exception:
        pass
    return code.co_firstlineno


def plumbing_prefixes() -> Tuple[str, ...]:
    """File name prefixes of code that is never the user's call site: torch, hangdoc and the
    stdlib wrappers between them (contextlib, functools, threading), frozen modules."""
    import torch

    import hangdoc

    stdlib = os.path.dirname(contextlib.__file__)
    return (
        os.path.dirname(torch.__file__) + os.sep,
        os.path.dirname(hangdoc.__file__) + os.sep,
        os.path.join(stdlib, "contextlib.py"),
        os.path.join(stdlib, "functools.py"),
        os.path.join(stdlib, "threading.py"),
        "<frozen ",
    )


def _code_kind(code: Any) -> tuple:
    """``(code, kind)``: 0 user code, 1 torch/hangdoc/stdlib plumbing, 2 torch.distributed's own
    c10d module (a call from there is part of another wrapped call, not a call of its own), 3 one of
    hangdoc's wrappers (likewise, reached through other torch modules)."""
    fn = code.co_filename
    kind = (3 if id(code) in _WRAPPER_CODES else 2 if fn == _c10d_file else 1 if fn.startswith(_internal_prefixes)
            else 0)
    # Keyed by id: hashing a code object hashes its bytecode and constants on every call. The
    # value keeps the code alive, so the id cannot be reused by another code object.
    hit = _internal_code[id(code)] = (code, kind, {})
    return hit


def _intern_site(hit: tuple, lasti: int) -> tuple:
    """The call site ``(code, f_lasti)``, one shared tuple per site (``hit[2]``: per code object)."""
    site = hit[2][lasti] = (hit[0], lasti)
    return site


def _call_site(frame: Any) -> Any:
    """The first frame outside torch, hangdoc and stdlib plumbing: (code, f_lasti).

    ``f_lineno`` costs microseconds in a long function (it scans the line table); the offset is
    free and is turned into a line only when the record is read.
    """
    f = frame
    cache = _internal_code
    while f is not None:
        code = f.f_code
        hit = cache.get(id(code)) or _code_kind(code)
        if not hit[1]:
            return hit[2].get(f.f_lasti) or _intern_site(hit, f.f_lasti)
        if hit[1] == 3:
            return _NESTED
        f = f.f_back
    return None


def _group_info(group: Any) -> Optional[Tuple[str, Tuple[int, ...]]]:
    info = _groups.get(group)
    if info is None:
        info = _describe_group(group)
        if info is not None:  # "not initialised yet" must be asked again next time
            # The ranks tuple held from a long-lived table too, so that the GC's first look at the
            # info tuple sees it untracked (see _SHAPES1) and every record stays untracked.
            info = (info[0], _RANKS.setdefault(info[1], info[1]))
            _groups[group] = info
    return info


_RANKS: Dict[Tuple[int, ...], Tuple[int, ...]] = {}


def _describe_group(group: Any) -> Optional[Tuple[str, Tuple[int, ...]]]:
    """(name, global ranks) of a group; None for calls torch itself turns into no-ops or errors
    (no default group yet, a rank outside the group), which are not worth a record."""
    c10d = _c10d
    if not c10d.is_initialized():
        return None
    non_member = getattr(getattr(c10d, "GroupMember", None), "NON_GROUP_MEMBER", object())
    if group is non_member:
        return None
    default = c10d._get_default_group()
    pg = group if group is not None else default
    ranks = tuple(c10d.get_process_group_ranks(pg))
    if pg is default:
        _refresh_identity()
        return ("default_pg", ranks)
    name = getattr(pg, "group_name", None) or f"pg{id(pg)}"
    return (str(name), ranks)


#: Interned single-tensor shapes and dtypes: ``torch.Size`` (or a plain tuple) -> ``((dims...),)``
#: and ``dtype`` -> ``(dtype,)``. A record then holds shared tuples instead of new nested ones.
#: Why: the GC untracks a tuple only when, at the moment it looks at it, nothing inside may be
#: tracked; it looks in list order, and an inner tuple reachable only through its outer one is
#: often moved behind it, so new nested tuples (and every record holding one) tend to stay tracked,
#: get promoted, and trigger full collections as the ring fills. A shared ``(dims,)`` is built
#: only once its ``dims`` were seen untracked (``_SHAPE_KEYS``), so it is untracked at first look,
#: and so are the records. Shared, they also take no memory per record. A torch.Size hashes and
#: compares like the tuple of its dims, so it is the lookup key.
_SHAPES1: Dict[Any, tuple] = {}
_DTYPES1: Dict[Any, tuple] = {}
_SHAPE_KEYS: Dict[tuple, tuple] = {}


def _intern_shape(shape: Any) -> tuple:
    key = tuple(shape)
    dims = _SHAPE_KEYS.get(key)
    if dims is None:
        if len(_SHAPE_KEYS) > 4096:  # dynamic shapes: keep the tables bounded
            _SHAPE_KEYS.clear()
            _SHAPES1.clear()
        _SHAPE_KEYS[key] = key
        return (key,)
    if _gc_is_tracked(dims):  # the GC has not looked at it yet: a tuple of this record's own
        return (dims,)
    value = _SHAPES1[dims] = (dims,)
    return value


def _intern_dtype(dtype: Any) -> tuple:
    value = _DTYPES1[dtype] = (dtype,)
    return value


def _tensor_meta(value: Any, objects: bool) -> Tuple[tuple, tuple, Any]:
    """(shapes, dtypes, first tensor) of a tensor, a list of tensors or a list of lists.

    Dtypes stay ``torch.dtype`` (named when the record is read); shapes become plain tuples, as a
    ``torch.Size`` would keep the record tracked by the garbage collector.
    """
    cls = type(value)
    if objects:
        n = len(value) if cls is list or cls is tuple else 1
        return ((n,),), ("object",), None
    if cls is list or cls is tuple:
        shapes, dtypes, first = [], [], None
        for v in value:
            if type(v) is list or type(v) is tuple:
                for w in v:
                    shapes.append(tuple(w.shape))
                    dtypes.append(w.dtype)
                    first = first if first is not None else w
            else:
                shapes.append(tuple(v.shape))
                dtypes.append(v.dtype)
                first = first if first is not None else v
        return tuple(shapes), tuple(dtypes), first
    return (tuple(value.shape),), (value.dtype,), value


_STREAM_NAMES: Dict[int, str] = {}
#: raw current-stream tuple (id, device, type) -> (stream name, torch.cuda.Stream): the CUDA hot
#: path's one lookup (the tuple comes from one C call; the Stream object records events).
_STREAMS: Dict[tuple, Tuple[str, Any]] = {}
#: torch._C._cuda_getCurrentStream once torch is imported with CUDA (a list: the generated issue()
#: functions hold the list, so enable() can fill it later).
_CUR_STREAM: List[Callable[[int], tuple]] = [lambda device: ()]
_new_event: Callable[[], Any] = lambda: None
_record_event: Callable[[Any, Any], None] = lambda ev, stream: None
#: Markers waiting on a stream that trigger a sweep from the caller's thread (which returns done
#: events to the pool); after a sweep the next one waits until they doubled (one event query per
#: sweep when the GPU keeps up). Events are at most one per gap, so this is a few ms of calls.
_SWEEP_MIN = 4
#: Pooled events left in the pool by the hot path (it creates new ones below that).
_POOL_RESERVE = 2
#: How synchronous CUDA calls are seen completed: "event" (pooled CUDA events spaced in time and
#: idle-stream queries, see Recorder._track_cuda) or "work" (the backend's own Work, caught in the
#: Work.wait() that c10d calls for a synchronous call, falling back to events when none shows up).
#: On torch 2.11 + NCCL 2.28 no Work was caught this way for synchronous calls (docs/gpu.md), so
#: "work" only added the Work.wait hook: "event" is the default.
_CUDA_COMPLETION = os.environ.get("HANGDOC_CUDA_COMPLETION", "event")


def _env_gap() -> float:
    """HANGDOC_CUDA_EVENT_GAP_MS in seconds (1 ms by default; 0: an event after every call)."""
    try:
        return max(0.0, float(os.environ.get("HANGDOC_CUDA_EVENT_GAP_MS", "") or 1.0)) / 1000.0
    except ValueError:
        return 0.001


#: The least time between two CUDA events of the recorder on one stream (see _track_cuda). An
#: event after every call (0) keeps every state exact but cost ~9-13 µs per call in a tight loop
#: of small NCCL calls on 2 x H200; one per gap bounds that cost by the clock instead of the call
#: rate. Read again by enable(): the generated wrappers hold it as a constant.
_EVENT_GAP = _env_gap()
#: A pause between two calls on a stream after which the second asks whether the stream is idle
#: before its launch (see _close_burst).
_IDLE_AFTER = 0.0001
#: [record whose Work is awaited, thread ident, (record, Work) once caught]: set around one call.
_capture: List[Any] = [None, 0, None]


def _stream_of(tensor: Any) -> Tuple[str, Any]:
    """``(name, stream)``: the caller's current stream on the tensor's device (``default`` or
    ``stream<id>``), first sight of a stream only; later calls hit ``_STREAMS``.

    Stream ids are assigned in creation order, so the same program names the same streams alike
    on every rank; the name is what the misplacement check compares.
    """
    import torch

    global _new_event, _record_event
    device = tensor.get_device()
    raw = torch._C._cuda_getCurrentStream(device)
    sid = raw[0]
    name = _STREAM_NAMES.get(sid)
    if name is None:
        name = _STREAM_NAMES[sid] = "default" if sid == 0 else f"stream{sid}"
    entry = _STREAMS[raw] = (name, torch.cuda.Stream(stream_id=raw[0], device_index=raw[1], device_type=raw[2]))
    _CUR_STREAM[0] = torch._C._cuda_getCurrentStream
    _new_event = _Event[0] = torch.cuda.Event
    _record_event = torch._C._CudaEventBase.record
    if _CUDA_COMPLETION == "work":
        _install_wait()
    return entry


def _issue(spec: _Spec, args: tuple, kwargs: dict, frame: Any) -> Tuple[tuple, Any]:
    """Build and buffer the record of one call (before the call runs)."""
    return spec.extract(args, kwargs, frame, _internal_code.get(id(frame.f_code)) or _code_kind(frame.f_code))


def _install_wait() -> None:
    """Observe Work.wait() returning; installed on the first async call only, because torch's own
    synchronous calls wait on a Work too and would all pay for the patched method."""
    global _wait_original
    if _wait_original is None and _c10d is not None:
        _wait_original = _c10d.Work.wait
        _c10d.Work.wait = _work_wait


def _finish(rec: tuple, result: Any, first: Any) -> None:
    r = _recorder
    if rec[_ASYNC]:
        if result is not None and hasattr(result, "is_completed"):
            if _wait_original is None:
                _install_wait()
            r._works[id(result)] = (result, [rec])
            # Sweeping again only once the pending Works doubled: O(1) per call even when
            # hundreds stay incomplete (the CPU far ahead of the GPU, isend never waited on).
            if len(r._works) > r._works_sweep_at:
                r._sweep()
                r._works_sweep_at = max(256, 2 * len(r._works))
        else:
            r._complete(rec)  # async_op=True on a rank outside the group returns None
    elif rec[_STREAM] is not None:
        if _CUDA_COMPLETION == "work":
            r._track_cuda_work(rec, first)
        else:
            r._track_cuda(rec, first, rec[_T0])
    else:
        r._complete(rec)


def _run_tracked(fn: Callable, rec: tuple, first: Any, args: tuple, kwargs: dict) -> Any:
    """Run a recorded call and complete its record: at once for a host-synchronous call, later
    for async Work and CUDA calls (see _finish)."""
    if rec[_STREAM] is not None and not rec[_ASYNC]:
        r = _recorder
        st = r._streams.get(rec[_STREAM]) if r is not None else None
        if st is not None and rec[_T0] - st.last_call >= min(_EVENT_GAP, _IDLE_AFTER) and st.n != st.marked_n:
            try:
                r._close_burst(st, rec[_T0])  # type: ignore[union-attr]
            except Exception as e:
                _report(e)
        if _wait_original is not None:
            _capture[0] = rec  # the Work.wait() c10d calls inside fn hands over the Work
            _capture[1] = _get_ident()
    try:
        result = fn(*args, **kwargs)
    except BaseException:
        r = _recorder
        if r is not None:
            r._complete(rec, "failed")
        raise
    try:
        _finish(rec, result, first)
    except Exception as e:
        _report(e)
    return result


def _wrap(fn: Callable, spec: _Spec) -> Callable:
    """``fn`` recording each call: with ``fn``'s own signature where it can be reproduced (the
    hot path, see _make_fast_wrapper), else through ``*args, **kwargs`` and ``spec.extract``."""
    wrapper = _make_fast_wrapper(fn, spec) or _generic_wrapper(fn, spec)
    _WRAPPER_CODES[id(wrapper.__code__)] = wrapper.__code__
    functools.update_wrapper(wrapper, fn)
    wrapper.__hangdoc_original__ = fn  # type: ignore[attr-defined]
    return wrapper


def _generic_wrapper(fn: Callable, spec: _Spec) -> Callable:
    issue = spec.extract

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _recorder is None:
            return fn(*args, **kwargs)
        try:
            frame = _getframe(1)
            code = frame.f_code
            hit = _internal_code.get(id(code)) or _code_kind(code)
            # called by another c10d function (broadcast_object_list -> broadcast): not a call of its own
            rec, first = (None, None) if hit[1] == 2 else issue(args, kwargs, frame, hit)
        except _PASS_THROUGH:
            raise
        except Exception as e:
            _report(e)
            rec = None
        if rec is None:  # outside the try: the user's call runs exactly once, its errors untouched
            return fn(*args, **kwargs)
        return _run_tracked(fn, rec, first, args, kwargs)

    return wrapper


_time = time.time
_get_ident = threading.get_ident
_getframe = sys._getframe
_gc_is_tracked = gc.is_tracked


def _wrap_batch(fn: Callable) -> Callable:
    """batch_isend_irecv: one record per P2POp (peer as global rank), completed with its Work."""
    @functools.wraps(fn)
    def wrapper(p2p_op_list: Any, *args: Any, **kwargs: Any) -> Any:
        frame = sys._getframe(1)
        if _recorder is None or (_internal_code.get(id(frame.f_code)) or _code_kind(frame.f_code))[1] == 2:
            return fn(p2p_op_list, *args, **kwargs)
        recs: List[tuple] = []
        try:
            for p in p2p_op_list:
                # P2POps built from the unwrapped isend/irecv (before enable) must still pass
                # batch_isend_irecv's identity check against the (wrapped) module globals.
                orig = getattr(p.op, "__hangdoc_original__", p.op)
                opname = getattr(orig, "__name__", "p2p")
                for (mod, attr), o in _originals.items():
                    if o is p.op:
                        p.op = getattr(mod, attr)
                        break
                spec = _SPECS_BY_NAME.get(opname) or _Spec(opname, ["tensor", "dst", "group"])
                # P2POp.peer is already a global rank: pass it as such, the spec makes it the peer.
                rec, _ = _issue(spec, (p.tensor, p.peer), {"group": p.group}, frame)
                if rec is None:
                    continue
                if not rec[_ASYNC]:
                    fixed = rec[:_ASYNC] + (True,) + rec[_ASYNC + 1:]
                    _recorder._replace(rec, fixed)
                    rec = fixed
                recs.append(rec)
        except Exception as e:
            _report(e)
        try:
            works = fn(p2p_op_list, *args, **kwargs)
        except BaseException:
            for rec in recs:
                _recorder._complete(rec, "failed")
            raise
        try:
            r = _recorder
            works_l = list(works or ())
            if works_l and len(works_l) == len(recs):
                for w, rec in zip(works_l, recs):
                    r._works[id(w)] = (w, [rec])
            elif works_l:  # one coalesced Work for the whole batch (NCCL)
                r._works[id(works_l[-1])] = (works_l[-1], recs)
            if not works_l:
                for rec in recs:
                    r._complete(rec)
            elif _wait_original is None:
                _install_wait()
        except Exception as e:
            _report(e)
        return works

    wrapper.__hangdoc_original__ = fn  # type: ignore[attr-defined]
    return wrapper


#: the sequence of new_group calls (see _wrap_group_creation)
CREATION_GROUP = "new_group"
_CREATION_INFO: Dict[Tuple[int, ...], Tuple[str, Tuple[int, ...]]] = {}


def _wrap_group_creation(fn: Callable) -> Callable:
    """``new_group``: every rank of the job must call it, members or not, in the same order, so each
    call is a record of its own sequence, group ``CREATION_GROUP`` (all ranks; the default group's
    collective numbers stay those of NCCL and Flight Recorder), its members as the record's one
    "shape" (``new_group([0,1])``): a rank that skipped a ``new_group`` diverges there, where its
    later groups' names alone (numbered by creation order) would pair the wrong groups."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        rec = None
        r = _recorder
        if r is not None:
            try:
                rec = _group_creation_record(r, args, kwargs, sys._getframe(1))
            except _PASS_THROUGH:  # the detector's abort policy: before the call, as for collectives
                raise
            except Exception as e:
                _report(e)
        try:
            result = fn(*args, **kwargs)
        except BaseException:
            if rec is not None and _recorder is not None:
                _recorder._complete(rec, "failed")
            raise
        if rec is not None and _recorder is not None:
            _recorder._complete(rec, "completed")
        _groups.clear()  # a new group: names are learnt again lazily
        return result

    wrapper.__hangdoc_original__ = fn  # type: ignore[attr-defined]
    return wrapper


def _group_creation_record(r: "Recorder", args: tuple, kwargs: dict, frame: Any) -> Optional[tuple]:
    world = _group_info(None)
    if world is None:
        return None
    info = _CREATION_INFO.get(world[1])
    if info is None:
        info = _CREATION_INFO[world[1]] = (CREATION_GROUP, world[1])
    ranks = kwargs.get("ranks", args[0] if args else None)
    try:
        members = tuple(sorted(int(x) for x in ranks)) if ranks is not None else info[1]
    except (TypeError, ValueError):
        return None
    hit = _internal_code.get(id(frame.f_code)) or _code_kind(frame.f_code)
    if hit[1] == 3:  # reached through one of hangdoc's wrappers: part of that call
        return None
    # (from c10d's own module: new_subgroups & co., which every rank calls for every sub-group, each
    # new_group of it a creation of its own, at the user's line that called new_subgroups)
    site = (hit[2].get(frame.f_lasti) or _intern_site(hit, frame.f_lasti)) if not hit[1] else _call_site(frame)
    if site is _NESTED:
        return None
    seq = r._seq.get(info[0], 0)
    r._seq[info[0]] = seq + 1
    rec = (seq, "new_group", info, (members,), (), None, None, False, site, None, _phase[0], _time(), None, "issued")
    if _detect is not None:  # hangdoc.runtime.detect: a rank that skipped a new_group diverges here
        _detect(info[0], "new_group", (members,), (), None, rec)
    r._buf.append(rec)
    return rec


def _wrap_group_maker(fn: Callable) -> Callable:
    """new_group & co: the group registry forgets stale entries (and learns new ones lazily)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        leaving = _detect_leaving
        if leaving is not None and fn.__name__ == "destroy_process_group" and not args and kwargs.get("group") is None:
            try:
                leaving()
            except Exception as e:
                _report(e)
        result = fn(*args, **kwargs)
        if fn.__name__ == "destroy_process_group":
            _groups.clear()
        return result

    wrapper.__hangdoc_original__ = fn  # type: ignore[attr-defined]
    return wrapper


def _work_wait(self: Any, *args: Any, **kwargs: Any) -> Any:
    cap = _capture
    if cap[0] is not None and cap[1] == _get_ident():
        cap[2] = (cap[0], self)
        cap[0] = None
    result = _wait_original(self, *args, **kwargs)  # type: ignore[misc]
    r = _recorder
    if r is not None and r._works:
        entry = r._works.get(id(self))
        if entry is not None and entry[0] is self:
            try:
                if entry[1] and entry[1][0][_STREAM] is not None:
                    return result  # CUDA: wait() only orders streams; completion comes from the sweep
                if r._works.pop(id(self), None) is entry:  # not completed by a sweep meanwhile
                    for rec in entry[1]:
                        r._complete(rec)
            except Exception as e:
                _report(e)
    return result


_SPECS_BY_NAME: Dict[str, _Spec] = {}


def discover(c10d: Any) -> Dict[str, _Spec]:
    """Communication entry points of this torch: public c10d functions with a ``group`` parameter
    and a tensor/object/async argument, plus :data:`KNOWN`."""
    import inspect
    import warnings

    specs: Dict[str, _Spec] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated aliases (reduce_op) warn when inspected
        _discover_into(c10d, specs, inspect)
    return specs


def _discover_into(c10d: Any, specs: Dict[str, "_Spec"], inspect: Any) -> None:
    namespace = vars(c10d)  # not getattr: deprecated aliases warn when touched
    for name in sorted(set(namespace) | set(KNOWN)):
        if name in _NOT_COMM or (name.startswith("_") and name not in KNOWN):
            continue
        fn = namespace.get(name)
        if not inspect.isfunction(fn) or not getattr(fn, "__module__", "").startswith("torch.distributed"):
            continue
        try:
            params = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            continue
        if name == "batch_isend_irecv":
            specs[name] = _Spec(name, params)
            continue
        comm = "group" in params and (
            "async_op" in params or any(p in params for p in _INPUT_PARAMS) or name in KNOWN
        )
        if comm or name in KNOWN:
            specs[name] = _Spec(name.lstrip("_") if name in ("_all_gather_base", "_reduce_scatter_base") else name, params)


def intercepted() -> List[str]:
    """Names wrapped in this process (empty when off)."""
    return sorted({attr for (_, attr) in _originals})


def enable(capacity: int = 100_000, out_dir: Optional[str] = None) -> Optional[Recorder]:
    """Start recording (idempotent); returns the Recorder, or None when torch.distributed is absent.

        >>> from hangdoc.runtime import recorder
        >>> r = recorder.enable(capacity=10)
        >>> r is recorder.enable() and r.records() == []
        True
        >>> recorder.disable()
    """
    global _recorder, _c10d, _internal_prefixes, _graph_task_id, _c10d_file, _EVENT_GAP
    if _recorder is not None:
        return _recorder
    _EVENT_GAP = _env_gap()  # read now, not at import: the job may set it after importing hangdoc
    try:
        import torch
        import torch.distributed as dist

        if not dist.is_available():
            return None
        import torch.distributed.distributed_c10d as c10d
    except Exception:
        return None
    _c10d = c10d
    _internal_prefixes = plumbing_prefixes()
    _c10d_file = c10d.__file__
    _internal_code.clear()
    _Tensor[0] = torch.Tensor
    gid = getattr(torch._C, "_current_graph_task_id", None)
    _graph_task_id = gid if callable(gid) else (lambda: -1)
    rec = Recorder(capacity=capacity, out_dir=out_dir)
    _refresh_identity()

    try:
        _patch(c10d, dist)
    except Exception as e:  # an unexpected torch: run unrecorded rather than break the job
        _report(e)
        for (mod, name), fn in list(_originals.items()):
            setattr(mod, name, fn)
        _originals.clear()
        return None
    _groups.clear()
    _recorder = rec
    from hangdoc.runtime import ddp

    ddp.install()  # DDP's gradient all_reduces (never raises; see hangdoc/runtime/ddp.py)
    from hangdoc.runtime import record_funcol

    record_funcol.install()  # DTensor's functional collectives (never raises)
    if _STREAMS and _CUDA_COMPLETION == "work":  # streams seen by an earlier enable(): no first sight again
        _install_wait()
    atexit.register(_dump_at_exit)
    from hangdoc.runtime import on_term

    on_term.install(_dump_at_exit)  # a launcher's SIGTERM to a rank stuck in a collective
    # what a dump imports, imported now: an exit dump on the SIGTERM thread while the main thread
    # imports too read a half-initialised module ("cannot import name 'CollectiveRecord'")
    import hangdoc.model  # noqa: F401
    return rec


def _patch(c10d: Any, dist: Any) -> None:
    specs = discover(c10d)
    _SPECS_BY_NAME.clear()
    _SPECS_BY_NAME.update(specs)
    modules = [c10d, dist]
    for name, spec in specs.items():
        fn = getattr(c10d, name)
        wrapped = _wrap_batch(fn) if name == "batch_isend_irecv" else _wrap(fn, spec)
        for mod in modules:
            if getattr(mod, name, None) is fn:
                _originals[(mod, name)] = fn
                setattr(mod, name, wrapped)
    for name, (op, params) in BINDINGS.items():
        fn = getattr(dist, name, None)
        if fn is not None and callable(fn):
            _originals[(dist, name)] = fn
            setattr(dist, name, _wrap(fn, _Spec(op, params)))
    # torch's own modules that imported these by name before hangdoc came (DeviceMesh's
    # ``from torch.distributed.distributed_c10d import new_group``) call them through their own
    # reference: patched there too, so that init_device_mesh's group creations are recorded
    holders = [m for key, m in list(sys.modules.items())
               if key.startswith("torch.distributed.") and m is not None and m is not c10d]
    for name in ("destroy_process_group", "new_group"):
        fn = getattr(c10d, name, None)
        if fn is not None:
            wrapped = _wrap_group_maker(fn) if name == "destroy_process_group" else _wrap_group_creation(fn)
            for mod in modules + holders:
                if getattr(mod, name, None) is fn:
                    _originals[(mod, name)] = fn
                    setattr(mod, name, wrapped)


def _tail(raw: List[tuple], limit: int) -> List[tuple]:
    """The newest ``limit`` records, after the newest older record of each group absent from them."""
    cut = max(0, len(raw) - limit)
    tail = raw[cut:]
    seen = {r[_GROUP][0] for r in tail}
    older = []
    for r in reversed(raw[:cut]):
        if r[_GROUP][0] not in seen:
            seen.add(r[_GROUP][0])
            older.append(r)
    return older[::-1] + tail


def _env_exit_records() -> Optional[int]:
    """HANGDOC_EXIT_RECORDS: how many of the newest records the exit dump writes (4096 by default;
    "all": the whole buffer; 0: no exit dump)."""
    v = os.environ.get("HANGDOC_EXIT_RECORDS", "").strip().lower()
    if v == "all":
        return None
    try:
        return max(0, int(v)) if v else 4096
    except ValueError:
        return 4096


def _dump_at_exit() -> None:
    """The exit dump: a rank that leaves while the others still wait for it (uneven inputs, an
    exception) says where it stopped. Only the newest records (``_env_exit_records``), unless this
    process dumped before (a hang: the watchdog wrote the whole buffer, which this rewrites)."""
    r = _recorder
    if r is not None and r._buf:
        try:
            limit = _env_exit_records()
            if limit == 0:
                return
            r.dump(limit=None if r.dumped_to else limit)
        except Exception as e:
            _report(e)


def disable() -> None:
    """Stop recording and restore every wrapped function (the Recorder stays readable)."""
    global _recorder, _wait_original
    from hangdoc.runtime import ddp

    from hangdoc.runtime import record_funcol

    ddp.uninstall()
    record_funcol.uninstall()
    for (mod, name), fn in list(_originals.items()):
        setattr(mod, name, fn)
    _originals.clear()
    if _wait_original is not None and _c10d is not None:
        _c10d.Work.wait = _wait_original
        _wait_original = None
    _capture[:] = [None, 0, None]
    try:
        atexit.unregister(_dump_at_exit)
        from hangdoc.runtime import on_term

        on_term.uninstall(_dump_at_exit)
    except Exception:
        pass
    _recorder = None
    _groups.clear()


def get() -> Optional[Recorder]:
    """The active Recorder, or None."""
    return _recorder
