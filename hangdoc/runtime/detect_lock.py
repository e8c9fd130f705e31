"""A thread that waits for a lock it holds itself: a self-deadlock, certain without any timeout.

``threading.Lock`` is not re-entrant: ``record()`` taking ``STATS_LOCK`` while ``update_stats()``
up the same stack holds it blocks for ever (``examples/bugs/lock_twice.py``). A rank whose main
thread does that never issues its next collective, and the others wait for it. Stacks show only the
line ``with STATS_LOCK:``, which reads as "compute"; this module proves the deadlock from the live
frames of the rank's own thread: the innermost frame waits to enter ``with L:`` (or in
``L.acquire()``) for a ``Lock`` that is locked, and a frame of the same thread is inside the body of
a ``with L:`` on the same object. Names are resolved without running user code (locals, globals,
builtins, then static attribute lookups); the source is read as input (a regular file, bounded) and
parsed once per file. (Tested on real files: ``tests/test_detect_lock.py``.)
"""

from __future__ import annotations

import ast
import functools
import inspect
import os
import sys
import threading
from typing import Any, Dict, List, Optional, Tuple

#: frames of the thread looked at, innermost first
MAX_FRAMES = 200
#: the largest source file parsed
MAX_SOURCE = 4 << 20
_LOCK = type(threading.Lock())
_MISSING = object()


@functools.lru_cache(maxsize=16)
def _source(filename: str) -> Optional[bytes]:
    from hangdoc.safeio import read_source

    return read_source(filename, MAX_SOURCE)


def _tree(filename: str) -> Optional[ast.AST]:
    """The file parsed (not kept: a large file's tree is tens of MB; :func:`_withs` keeps what it needs)."""
    data = _source(filename)
    if data is None:
        return None
    try:
        return ast.parse(data)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None


def line_of(filename: str, line: int) -> Optional[bytes]:
    """Line ``line`` (1-based) of a source file as this machine has it; None when unreadable."""
    data = _source(filename)
    if data is None or line < 1:
        return None
    lines = data.split(b"\n", line)
    return lines[line - 1] if len(lines) >= line else None


def _may_acquire(filename: str, line: int) -> bool:
    """Whether line ``line`` of the file mentions ``with`` or ``acquire(`` at all: a file is parsed
    only then (a rank waiting in a collective sits in torch's largest files)."""
    text = line_of(filename, line)
    return text is not None and (b"with" in text or b"acquire(" in text)


@functools.lru_cache(maxsize=256)
def _index(filename: str) -> Tuple[List[Tuple[int, int, int, int, List[ast.expr]]], Dict[int, List[ast.expr]]]:
    """What a file's source says about its locks, from one parse (the tree itself is not kept):
    every ``with`` as (first line of the enclosing function as ``co_firstlineno`` counts it (1: the
    module), header line, first body line, last line, context expressions), and per line the
    objects whose ``.acquire(`` it calls."""
    tree = _tree(filename)
    withs: List[Tuple[int, int, int, int, List[ast.expr]]] = []
    acquires: Dict[int, List[ast.expr]] = {}
    if tree is None:
        return withs, acquires
    todo: List[Tuple[ast.AST, int]] = [(tree, 1)]
    while todo:
        node, owner = todo.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                decos = getattr(child, "decorator_list", None) or []
                todo.append((child, min([child.lineno] + [d.lineno for d in decos])))
                continue
            if isinstance(child, (ast.With, ast.AsyncWith)) and child.body:
                end = getattr(child, "end_lineno", None) or child.body[-1].lineno
                withs.append((owner, child.lineno, child.body[0].lineno, end, [it.context_expr for it in child.items]))
            elif (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute)
                  and child.func.attr == "acquire"):
                acquires.setdefault(child.lineno, []).append(child.func.value)
            todo.append((child, owner))
    return withs, acquires


def _withs(filename: str) -> List[Tuple[int, int, int, int, List[ast.expr]]]:
    return _index(filename)[0]


def _resolve(expr: ast.expr, frame: Any) -> Any:
    """The object a name or a dotted name denotes in ``frame``, without running user code."""
    if isinstance(expr, ast.Name):
        for scope in (frame.f_locals, frame.f_globals, frame.f_builtins):
            v = scope.get(expr.id, _MISSING)
            if v is not _MISSING:
                return v
        return _MISSING
    if isinstance(expr, ast.Attribute):
        base = _resolve(expr.value, frame)
        if base is _MISSING:
            return _MISSING
        try:
            return inspect.getattr_static(base, expr.attr)
        except AttributeError:
            return _MISSING
    return _MISSING


def _acquiring(frame: Any) -> Tuple[Any, str]:
    """(the lock the frame waits to take at its current line, its expression) or (_MISSING, "")."""
    line = frame.f_lineno
    if not _may_acquire(frame.f_code.co_filename, line):
        return _MISSING, ""
    for owner, header, _first, _end, exprs in _withs(frame.f_code.co_filename):
        if header == line and owner == frame.f_code.co_firstlineno:
            for e in exprs:
                obj = _resolve(e, frame)
                if isinstance(obj, _LOCK):
                    return obj, ast.unparse(e) if hasattr(ast, "unparse") else getattr(e, "id", "the lock")
    for e in _index(frame.f_code.co_filename)[1].get(line, ()):
        obj = _resolve(e, frame)
        if isinstance(obj, _LOCK):
            return obj, ast.unparse(e) if hasattr(ast, "unparse") else "the lock"
    return _MISSING, ""


def self_deadlock(frame: Any, waiting: Any = None) -> Optional[Dict[str, Any]]:
    """What a thread whose innermost frame is ``frame`` waits for, when it holds that lock itself:
    ``{"lock", "at", "in", "held_at", "held_in"}``; None otherwise. ``waiting``: the lock, when the
    caller knows it (a test)."""
    if frame is None:
        return None
    lock, text = (waiting, "") if waiting is not None else _acquiring(frame)
    if lock is _MISSING or not isinstance(lock, _LOCK) or not lock.locked():
        return None
    f, depth = frame, 0
    while f is not None and depth < MAX_FRAMES:
        for held, name in held_in(f, skip_header=f is frame):
            if held is lock:
                return {"lock": text or name, "at": f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}",
                        "in": frame.f_code.co_name, "held_at": taken_at(f, lock), "held_in": f.f_code.co_name}
        f, depth = f.f_back, depth + 1
    return None


def held_in(frame: Any, skip_header: bool = False) -> List[Tuple[Any, str]]:
    """(lock, its expression) of every locked ``threading.Lock`` whose ``with`` body ``frame`` is in
    now (the thread running the frame took it there). ``skip_header``: not the ``with`` whose own
    line the frame is at (it is entering that one, not in it)."""
    line, out = frame.f_lineno, []
    for owner, header, first, end, exprs in _withs(frame.f_code.co_filename):
        if owner != frame.f_code.co_firstlineno or not first <= line <= end or (skip_header and header == line):
            continue
        for e in exprs:
            obj = _resolve(e, frame)
            if isinstance(obj, _LOCK) and obj.locked():
                out.append((obj, ast.unparse(e) if hasattr(ast, "unparse") else "the lock"))
    return out


def taken_at(frame: Any, lock: Any) -> str:
    """``file:line`` of the ``with`` whose body ``frame`` is in and which took ``lock`` (where the
    frame is now, if none is found)."""
    line = frame.f_lineno
    headers = [header for owner, header, first, end, exprs in _withs(frame.f_code.co_filename)
               if owner == frame.f_code.co_firstlineno and first <= line <= end
               and any(_resolve(e, frame) is lock for e in exprs)]
    return f"{os.path.basename(frame.f_code.co_filename)}:{max(headers) if headers else line}"


def main_thread_deadlock() -> Optional[Dict[str, Any]]:
    """:func:`self_deadlock` of this process's main thread (called from another thread)."""
    main = threading.main_thread()
    if main is threading.current_thread() or main.ident is None:
        return None
    return self_deadlock(sys._current_frames().get(main.ident))


def verdict(rank: int, found: Dict[str, Any], digests: Any, describe: Any) -> Any:
    """The detector's verdict for a rank whose main thread waits for a lock it holds itself: a
    ``collective-mismatch`` (it never issues the collective the others wait in), basis ``lock``."""
    from hangdoc.ranges import describe_ranks
    from hangdoc.runtime.detect_digest import Verdict
    from hangdoc.runtime.detect_failed import last_call
    from hangdoc.textsafe import visible

    group, n, entry, last = last_call(digests, describe)
    v = Verdict(group, max(0, n - 1), True, [rank], [], entry, None, "lock")
    f = {k: visible(str(found.get(k, "")))[:200] for k in ("lock", "at", "in", "held_at", "held_in")}
    v.text = (f"{describe_ranks([rank])} waits for the lock `{f['lock']}` at {f['at']} in {f['in']}, which its own "
              f"thread took at {f['held_at']} in {f['held_in']} and still holds: a self-deadlock (threading.Lock is "
              f"not re-entrant){last}; the other ranks wait for it at their next collective")
    return v
