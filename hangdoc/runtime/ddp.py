"""DDP gradient all_reduces in the collective recorder.

DistributedDataParallel's gradient all_reduces are issued by its C++ Reducer straight on the
ProcessGroup, so the recorder, which wraps the torch.distributed *functions*, never sees them: the
most common collectives of a DDP job would be missing, and a rank that skips ``backward()`` would
leave no trace in the records.

``install()`` patches ``DistributedDataParallel.forward``: after the first forward of each DDP
instance (so that hooks registered at construction or in DDP's lazy init are already there) it
registers a Python comm hook that does what DDP does without a hook (divide the bucket by the
group size, all_reduce SUM) but issues the all_reduce through ``torch.distributed.all_reduce``,
looked up at call time: the recorder's wrapper records it (op ``all_reduce``, ``async_op``, the
DDP's process group, phase ``backward``) and sees it complete through its Work.

A comm hook of the user's (``register_comm_hook``, ``_register_builtin_comm_hook``, mixed
precision, fused optimizers) takes precedence: an instance that has one is left alone, and one
registered after hangdoc's (after the first forward) replaces it instead of failing with torch's
"can only be called once".

Cost decides where it is on: on CPU (gloo) the hook's cost is lost in the step's noise, so it is
on by default; on GPUs any Python comm hook, torch's own ``allreduce_hook`` alike, costs ~90-150 us
per bucket (a small DDP step x1.33 on 2 x H200), so there it is opt-in: ``HANGDOC_RECORD_DDP=1``.
``HANGDOC_RECORD_DDP=0`` turns it off everywhere.

    >>> from hangdoc.runtime import ddp
    >>> ddp.install() in (True, False)      # False without torch.distributed or when opted out
    True
    >>> ddp.uninstall()
    >>> ddp.installed()
    False
"""

from __future__ import annotations

import os
import sys
import weakref
from typing import Any, Callable, Dict, Optional

__all__ = ["install", "uninstall", "installed", "hooked"]

_ENV = "HANGDOC_RECORD_DDP"
#: The instance attribute naming the reducer whose hook was decided (``id(reducer)``): an int, so
#: DDP's pickling (which drops the reducer and rebuilds it) carries nothing of ours, and a rebuilt
#: reducer is decided again.
_ATTR = "_hangdoc_ddp_reducer"
#: (class, attribute name) -> original function, while installed.
_originals: Dict[Any, Callable] = {}
#: DDP instance -> its _State, for instances carrying hangdoc's hook (weak: no lifetime of ours).
_states: "weakref.WeakKeyDictionary[Any, _State]" = weakref.WeakKeyDictionary()
_dist: Any = None
_getframe = sys._getframe
#: torch's message when a reducer already has a hook (reducer.cpp).
_ONCE = "can only be called once"


class _State:
    """The hook's state, held by the C++ reducer. It must not refer to the DDP module: the reducer
    is owned by the module, and a cycle through C++ is invisible to the garbage collector."""

    __slots__ = ("group", "size", "issue", "delegate", "__weakref__")

    def __init__(self, group: Any, issue: Callable[[Any, Any], Any]):
        self.group = group
        self.size = group.size()
        self.issue = issue
        #: (hook, state) registered by the user after hangdoc's hook: called instead.
        self.delegate: Optional[tuple] = None


def _value(fut: Any) -> Any:
    # The reducer wants a Future of one tensor; the Work's future holds a list.
    return fut.value()[0]


def _hook(state: _State, bucket: Any) -> Any:
    """``allreduce_hook`` with the all_reduce going through torch.distributed.all_reduce."""
    d = state.delegate
    if d is not None:
        return d[0](d[1], bucket)
    tensor = bucket.buffer()
    tensor.div_(state.size)  # before the sum, as DDP does, to avoid overflow in low precision
    if _getframe().f_back is None:
        # Called on an autograd engine thread (CUDA): no caller frames at all, so the recorder
        # would find no call site. The issuer's code carries the DDP forward's call site instead.
        work = state.issue(tensor, state.group)
    else:  # on the thread that called backward(): the recorder finds the user's backward() line
        work = _dist.all_reduce(tensor, group=state.group, async_op=True)
    return work.get_future().then(_value)


def _issuer(filename: str, line: int, name: str) -> Callable[[Any, Any], Any]:
    """A function issuing the all_reduce whose code object reads as ``filename:line:name``."""
    src = "\n" * (max(1, line) - 1) + "def issue(t, g): return _dist.all_reduce(t, group=g, async_op=True)\n"
    ns: Dict[str, Any] = {}
    exec(compile(src, filename, "exec"), {"_dist": _dist}, ns)  # noqa: S102 - constant source
    fn = ns["issue"]
    code = fn.__code__
    fn.__code__ = code.replace(co_name=name, co_qualname=name) if hasattr(code, "co_qualname") else code.replace(co_name=name)
    return fn


def _forward_site(frame: Any) -> tuple:
    """(file, line) of the first frame outside torch, hangdoc and the stdlib wrappers from
    ``frame`` outwards (what the recorder calls a call site)."""
    from hangdoc.runtime.recorder import plumbing_prefixes

    internal = plumbing_prefixes()
    f = frame
    while f is not None:
        if not f.f_code.co_filename.startswith(internal):
            return f.f_code.co_filename, f.f_lineno
        f = f.f_back
    return "<DistributedDataParallel>", 1


def _skip(ddp: Any) -> Optional[str]:
    """Why this instance keeps DDP's own path (None: hook it). Reasons are not printed: a user's
    hook taking precedence is the intended behaviour, not news."""
    if _on_gpu(ddp) and os.environ.get(_ENV, "").strip().lower() not in ("1", "true", "yes", "on"):
        # Measured on 2 x H200 (docs/recorder.md): any Python comm hook (torch's own
        # allreduce_hook alike) adds ~90-150 us per bucket there, x1.33 on a small step. Opt-in.
        return "GPU parameters without HANGDOC_RECORD_DDP=1"
    if getattr(ddp, "_comm_hooks", None):
        return "a comm hook of the user's"
    if getattr(ddp, "_hangdoc_builtin_hook", False):
        return "a builtin comm hook"
    if getattr(ddp, "_use_python_reducer", False):
        return "the Python reducer (compiled DDP)"
    if getattr(ddp, "_delay_all_reduce_all_params", False):
        return "every parameter's all_reduce is delayed (already recorded as a Python call)"
    if getattr(ddp, "reducer", None) is None or getattr(ddp, "process_group", None) is None:
        return "no reducer"
    import torch

    sparse = (torch.nn.Embedding, torch.nn.EmbeddingBag)
    if any(isinstance(m, sparse) and m.sparse for m in ddp.module.modules()):
        return "sparse gradients"
    return None


def _on_gpu(ddp: Any) -> bool:
    device_type = getattr(ddp, "device_type", None)
    if isinstance(device_type, str):
        return device_type != "cpu"
    try:
        return next(ddp.module.parameters()).device.type != "cpu"
    except Exception:
        return False


def _attach(ddp: Any, caller: Any) -> None:
    """Decide once per reducer whether ``ddp`` gets hangdoc's hook, and register it."""
    reducer = ddp.__dict__.get("reducer")
    ddp.__dict__[_ATTR] = id(reducer)  # decided, whatever happens next: never retried per step
    if _skip(ddp) is not None:
        return
    filename, line = _forward_site(caller)
    name = f"{type(ddp).__name__}({type(ddp.module).__name__}).backward"
    state = _State(ddp.process_group, _issuer(filename, line, name))
    try:
        _dist._register_comm_hook(reducer, state, _hook)
    except RuntimeError as e:
        if _ONCE in str(e):  # a hook registered behind DDP's back (dist._register_comm_hook)
            return
        raise
    _states[ddp] = state


def hooked(ddp: Any) -> bool:
    """Whether ``ddp`` issues its gradient all_reduces through hangdoc's hook (and they are
    recorded): False before its first forward, with a user's hook, or after one replaced ours."""
    state = _states.get(ddp)
    return state is not None and state.delegate is None and ddp.__dict__.get(_ATTR) == id(ddp.reducer)


def _report(e: BaseException) -> None:
    try:
        from hangdoc.runtime import recorder

        recorder._report(e)
    except Exception:
        try:
            sys.stderr.write(f"hangdoc ddp: {type(e).__name__}: {e} (DDP all_reduces are not recorded)\n")
        except Exception:
            pass


def _make_forward(original: Callable) -> Callable:
    def forward(self: Any, *inputs: Any, **kwargs: Any) -> Any:
        out = original(self, *inputs, **kwargs)
        # __dict__, not attributes: a DDP whose parameters are all delayed has no reducer at all
        if self.__dict__.get(_ATTR) != id(self.__dict__.get("reducer")) and _originals:
            try:
                # the caller of DDP.__call__ machinery: this frame's caller onwards
                _attach(self, _getframe(1))
            except Exception as e:
                _report(e)
        return out

    forward.__hangdoc_original__ = original  # type: ignore[attr-defined]
    return forward


def _make_register(original: Callable) -> Callable:
    def register_comm_hook(self: Any, state: Any, hook: Callable) -> None:
        ours = _states.get(self)
        if ours is None or ours.delegate is not None or self.__dict__.get(_ATTR) != id(self.reducer):
            return original(self, state, hook)
        try:
            return original(self, state, hook)
        except RuntimeError as e:
            # DDP checked the hook, logged its name and listed it; only the reducer refused a
            # second hook. Hangdoc's gives way: it calls the user's from now on.
            if _ONCE not in str(e) or not self._comm_hooks or self._comm_hooks[-1][0] is not hook:
                raise
            ours.delegate = (hook, state)
        return None

    register_comm_hook.__hangdoc_original__ = original  # type: ignore[attr-defined]
    return register_comm_hook


def _make_register_builtin(original: Callable) -> Callable:
    def _register_builtin_comm_hook(self: Any, comm_hook_type: Any) -> None:
        ours = _states.get(self)
        if ours is None or ours.delegate is not None or self.__dict__.get(_ATTR) != id(self.reducer):
            self.__dict__["_hangdoc_builtin_hook"] = True
            return original(self, comm_hook_type)
        try:
            return original(self, comm_hook_type)
        except RuntimeError as e:
            if _ONCE not in str(e):
                raise
            # The builtin hooks' Python twins (ALLREDUCE is what hangdoc's hook does already).
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            name = str(comm_hook_type).rsplit(".", 1)[-1]
            if name == "FP16_COMPRESS":
                ours.delegate = (default_hooks.fp16_compress_hook, ours.group)
            elif name != "ALLREDUCE":
                raise
        return None

    _register_builtin_comm_hook.__hangdoc_original__ = original  # type: ignore[attr-defined]
    return _register_builtin_comm_hook


def install() -> bool:
    """Record DDP's gradient all_reduces from each DDP instance's first forward on (idempotent).

    Returns whether it is installed; False without torch.distributed/DDP or with
    ``HANGDOC_RECORD_DDP=0``. Never raises.

        >>> from hangdoc.runtime import ddp
        >>> import os; os.environ["HANGDOC_RECORD_DDP"] = "0"
        >>> ddp.install()
        False
        >>> del os.environ["HANGDOC_RECORD_DDP"]
    """
    global _dist
    if _originals:
        return True
    if os.environ.get(_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    try:
        import torch.distributed as dist

        if not dist.is_available():
            return False
        from torch.nn.parallel import DistributedDataParallel as DDP

        if not hasattr(dist, "_register_comm_hook"):
            return False
        _dist = dist
        patches = {"forward": _make_forward, "register_comm_hook": _make_register,
                   "_register_builtin_comm_hook": _make_register_builtin}
        for attr, make in patches.items():
            original = DDP.__dict__.get(attr)
            if original is None:
                continue
            _originals[(DDP, attr)] = original
            setattr(DDP, attr, make(original))
        return True
    except Exception as e:  # an unexpected torch: DDP runs unrecorded rather than broken
        _report(e)
        _restore()
        return False


def _restore() -> None:
    for (cls, attr), fn in list(_originals.items()):
        try:
            setattr(cls, attr, fn)
        except Exception as e:
            _report(e)
    _originals.clear()


def uninstall() -> None:
    """Restore DDP's methods (idempotent). Instances hooked already keep hangdoc's hook (a reducer
    cannot drop one); it computes what DDP does, only no longer recorded once the recorder is off."""
    _restore()


def installed() -> bool:
    """Whether ``install()`` is in effect."""
    return bool(_originals)
