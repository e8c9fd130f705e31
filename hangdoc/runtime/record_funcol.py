"""Records of torch's *functional* collectives, the ones DTensor, tensor parallelism and FSDP2's
state dict call (``torch.distributed._functional_collectives``: ``all_gather_single``,
``reduce_scatter_single``, ``all_reduce``, ``all_to_all_single``, ``broadcast`` and the coalesced
ones). They reach the process group through ``torch.ops._c10d_functional``, not through the
``torch.distributed`` functions the recorder wraps, so without this a ``full_tensor()`` that only
some ranks reach leaves no record and no ``--detect`` digest.

Each call is recorded under the op its process group runs (``all_gather_single`` is an
``all_gather_into_tensor``): the same wire op as an eager call, so a rank in DTensor's all-gather
and a rank in FSDP's own ``dist.all_gather_into_tensor`` at the same sequence number are compared
as the one collective they are. A call is complete when its ``AsyncCollectiveTensor`` was waited
on (a plain tensor result: at once; a CUDA one: by its stream, as for eager calls).

The module is patched where it is imported: at ``install()`` when it already is, otherwise by a
one-shot import hook when torch imports it (DeviceMesh and DTensor import it, ``torch.distributed``
does not). Under ``torch.compile`` the wrappers step aside (``torch.compiler.is_compiling()``), so
that compiled graphs trace the functional ops exactly as before.

    >>> from hangdoc.runtime import record_funcol
    >>> sorted(record_funcol.OPS)[:2]
    ['all_gather_into_tensor_coalesced', 'all_gather_single']
"""

from __future__ import annotations

import functools
import sys
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

__all__ = ["install", "uninstall", "OPS", "MODULE"]

MODULE = "torch.distributed._functional_collectives"

#: function name -> the process group's op (the name a record carries). Only the functions that
#: call a ``torch.ops._c10d_functional*`` op themselves are wrapped (``_calls_the_op``): deprecated
#: aliases (``all_gather_tensor`` -> ``all_gather_single`` in recent torch) and autograd variants
#: that only call a base function stay as they are, so their warnings still name the user's line,
#: and the base call's record names it too (the first frame outside torch).
OPS: Dict[str, str] = {
    "broadcast": "broadcast",
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce_coalesced",
    "all_gather_single": "all_gather_into_tensor",
    "all_gather_single_autograd": "all_gather_into_tensor",
    "all_gather_tensor": "all_gather_into_tensor",
    "all_gather_tensor_autograd": "all_gather_into_tensor",
    "all_gather_single_coalesced": "all_gather_into_tensor_coalesced",
    "all_gather_into_tensor_coalesced": "all_gather_into_tensor_coalesced",
    "reduce_scatter_single": "reduce_scatter_tensor",
    "reduce_scatter_single_autograd": "reduce_scatter_tensor",
    "reduce_scatter_tensor": "reduce_scatter_tensor",
    "reduce_scatter_tensor_autograd": "reduce_scatter_tensor",
    "reduce_scatter_single_coalesced": "reduce_scatter_tensor_coalesced",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor_coalesced",
    "all_to_all_single": "all_to_all_single",
    "all_to_all_single_autograd": "all_to_all_single",
}

_patched: List[Tuple[Any, str, Callable]] = []
_hook: List[Any] = []


class _Waited:
    """An ``AsyncCollectiveTensor``'s pending record, as the recorder's sweep asks of async results
    (``is_completed``): done once ``wait_tensor`` returned for its output tensor, or once that
    tensor is gone unwaited. The tensor is held weakly: a record never keeps the user's memory."""

    __slots__ = ("ref", "done")

    def __init__(self, elem: Any):
        self.ref = weakref.ref(elem)
        self.done = False

    def is_completed(self) -> bool:
        return self.done or self.ref() is None


#: id(output tensor) -> its _Waited, until ``wait_tensor`` returns for it. Bounded: pruned of
#: finished entries whenever it doubled (an output never waited on stays until its tensor dies).
_pending: Dict[int, _Waited] = {}
_prune_at = [1024]


def _awaiting(elem: Any) -> _Waited:
    w = _Waited(elem)
    _pending[id(elem)] = w
    if len(_pending) > _prune_at[0]:
        for key, v in list(_pending.items()):
            if v.is_completed():
                _pending.pop(key, None)
        _prune_at[0] = max(1024, 2 * len(_pending))
    return w


def _wrap_wait(fn: Callable) -> Callable:
    """``wait_tensor``: the record of the collective whose output it waited for is complete."""
    from hangdoc.runtime import recorder as R

    @functools.wraps(fn)
    def wrapper(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        result = fn(tensor, *args, **kwargs)
        if _pending:
            try:
                w = _pending.pop(id(tensor), None)
                if w is not None and w.ref() is tensor:
                    w.done = True
                    r = R._recorder
                    entry = r._works.get(id(w)) if r is not None else None
                    if entry is not None and entry[0] is w and r._works.pop(id(w), None) is entry:
                        for rec in entry[1]:
                            r._complete(rec)
            except Exception as e:
                R._report(e)
        return result

    wrapper.__hangdoc_original__ = fn  # type: ignore[attr-defined]
    return wrapper


def _calls_the_op(fn: Callable) -> bool:
    code = getattr(fn, "__code__", None)
    return code is not None and any(n.startswith("_c10d_functional") for n in code.co_names)


def _resolver(mod: Any, c10d: Any) -> Callable[[Any, str], Any]:
    """``(group argument, tag) -> ProcessGroup``: a ProcessGroup as it is, the rest (a DeviceMesh,
    ``(mesh, dim)``, a list of ranks, a group name) by funcol's own resolution."""
    pg_type = getattr(c10d, "ProcessGroup", None)
    name_of = getattr(mod, "_resolve_group_name", None)
    by_name = getattr(c10d, "_resolve_process_group", None)

    def resolve(group: Any, tag: str) -> Any:
        if pg_type is not None and isinstance(group, pg_type):
            return group
        if name_of is None or by_name is None:
            return None
        return by_name(name_of(group, tag))

    return resolve


def _wrap(fn: Callable, op: str, mod: Any) -> Optional[Callable]:
    import inspect

    from hangdoc.runtime import recorder as R

    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    if "group" not in params or not params:
        return None
    at = {name: i for i, name in enumerate(params)}
    first, g_at, tag_at, src_at = params[0], at["group"], at.get("tag"), at.get("src")
    spec = R._Spec(op, ["tensor", "group", "group_src", "async_op"])
    resolve = _resolver(mod, R._c10d)
    torch = sys.modules["torch"]
    compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (lambda: False)
    act_type = getattr(mod, "AsyncCollectiveTensor", None)

    def arg(args: tuple, kwargs: dict, i: Optional[int], name: Optional[str], default: Any) -> Any:
        if i is None:
            return default
        return args[i] if len(args) > i else kwargs.get(name, default)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        r = R._recorder
        if r is None or compiling():
            return fn(*args, **kwargs)
        rec = first_t = None
        try:
            frame = sys._getframe(1)
            hit = R._internal_code.get(id(frame.f_code)) or R._code_kind(frame.f_code)
            if hit[1] != 3:  # not reached through another recorded call
                value = arg(args, kwargs, 0, first, None)
                pg = resolve(arg(args, kwargs, g_at, "group", None), arg(args, kwargs, tag_at, "tag", ""))
                src = arg(args, kwargs, src_at, "src", None)
                tensor = value[0] if isinstance(value, (list, tuple)) and value else value
                cuda = bool(getattr(tensor, "is_cuda", False))
                if pg is not None:
                    rec, first_t = spec.extract((value, pg, src, not cuda), {}, frame, hit)
        except R._PASS_THROUGH:  # the detector's abort policy, before the call as for eager ones
            raise
        except Exception as e:
            R._report(e)
            rec = None
        if rec is None:
            return fn(*args, **kwargs)
        try:
            result = fn(*args, **kwargs)
        except BaseException:
            r = R._recorder
            if r is not None:
                r._complete(rec, "failed")
            raise
        try:
            # a coalesced call returns one tensor per input, waited on in turn: complete at the last
            last = result[-1] if isinstance(result, (list, tuple)) and result else result
            elem = getattr(last, "elem", None) if act_type is not None and isinstance(last, act_type) else None
            R._finish(rec, _awaiting(elem) if elem is not None else None, first_t)
        except Exception as e:
            R._report(e)
        return result

    R._WRAPPER_CODES[id(wrapper.__code__)] = wrapper.__code__
    wrapper.__hangdoc_original__ = fn  # type: ignore[attr-defined]
    return wrapper


def _patch(mod: Any) -> None:
    """Wrap the functional collectives of an imported ``mod`` (once)."""
    if _patched and _patched[0][0] is mod:
        return
    for name, op in list(OPS.items()) + [("wait_tensor", "")]:
        fn = getattr(mod, name, None)
        if fn is None or not callable(fn) or hasattr(fn, "__hangdoc_original__") or not _calls_the_op(fn):
            continue
        try:
            wrapped = _wrap_wait(fn) if name == "wait_tensor" else _wrap(fn, op, mod)
        except Exception as e:  # an unexpected torch: that function stays unrecorded
            from hangdoc.runtime import recorder as R

            R._report(e)
            continue
        if wrapped is not None:
            _patched.append((mod, name, fn))
            setattr(mod, name, wrapped)


class _Loader:
    """The real loader of ``MODULE``, and the patch once it has run."""

    def __init__(self, inner: Any):
        self._inner = inner

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._inner.exec_module(module)
        try:
            from hangdoc.runtime import recorder as R

            if R._recorder is not None:
                _patch(module)
        except Exception:
            pass

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ...: the real loader's
        return getattr(self._inner, name)


class _Finder:
    """One-shot ``sys.meta_path`` entry: finds ``MODULE`` the normal way, then patches it."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != MODULE:
            return None
        _unhook()
        from importlib.machinery import PathFinder

        spec = PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def _unhook() -> None:
    for h in _hook:
        try:
            sys.meta_path.remove(h)
        except ValueError:
            pass
    _hook.clear()


def install() -> None:
    """Record the functional collectives from now on: at once if torch imported them, else when
    it does (never raises)."""
    try:
        mod = sys.modules.get(MODULE)
        if mod is not None:
            _patch(mod)
        elif not _hook:
            h = _Finder()
            _hook.append(h)
            sys.meta_path.insert(0, h)
    except Exception as e:
        from hangdoc.runtime import recorder as R

        R._report(e)


def uninstall() -> None:
    """Restore every patched function and drop the import hook."""
    _unhook()
    for mod, name, fn in reversed(_patched):
        setattr(mod, name, fn)
    _patched.clear()
    _pending.clear()
