"""What a user's source line blocks in, when the stack alone cannot say.

A stack from faulthandler, a traceback or the watchdog shows only Python frames: a thread blocked
in ``with STATS_LOCK:`` (a C-level lock acquire) or in ``os.waitpid(pid, 0)`` looks like one that
computes at that line. When the source is readable here (the usual case for the in-job watchdog
and for an aggregate on the training host), the line says what it waits for.

    >>> blocking_call_in("    with STATS_LOCK:  # the stats")
    ('a lock', 'with STATS_LOCK:')
    >>> blocking_call_in("    os.waitpid(pid, 0)")
    ('a child process', 'os.waitpid(pid, 0)')
    >>> blocking_call_in("    loss = model(x).sum()") is None
    True
"""

from __future__ import annotations

import ast
import functools
import os
import re
from typing import Iterable, List, Optional, Tuple

from hangdoc.safeio import read_source

#: the largest source file read (torch's biggest, a test helper, is 1.4 MB; beyond it: unknown)
MAX_SOURCE = 4 << 20
#: the longest line looked at
MAX_LINE = 400

# (what it waits for, pattern): each pattern is linear (no nested quantifiers) and anchored on a name
_WAITS = [
    ("a lock", re.compile(r"^\s*(?:async\s+)?with\s+[\w.\[\]]*(?:lock|mutex|_lk|rlock|cond|condition|semaphore|sem)\w*\s*(?:\(\s*\))?\s*(?:as\s+\w+\s*)?:", re.I)),
    ("a lock", re.compile(r"\.acquire\(")),
    ("a child process", re.compile(r"\b(?:os\.)?wait(?:pid|4)?\(|\.communicate\(|\bsubprocess\.(?:run|call|check_call|check_output)\(")),
    ("a thread or process to end", re.compile(r"\.join\(\s*\)")),
    ("an event or condition", re.compile(r"\b\w*(?:event|cond|condition|done|ready|barrier)\w*\.wait(?:_for)?\(", re.I)),
]
_EVENT_WAIT = _WAITS[-1][1]


def blocking_call_in(text: str) -> Optional[Tuple[str, str]]:
    """``(what it waits for, the statement)`` when the line ``text`` blocks on a primitive."""
    text = text[:MAX_LINE]
    code = text.split("#", 1)[0]
    for what, pattern in _WAITS:
        if pattern.search(code):
            return what, code.strip()
    return None


#: directories a relative file name of a dump is also looked for in (:func:`set_source_roots`)
_ROOTS: List[str] = []
#: at most this many roots, from at most this many processes' command lines
MAX_ROOTS, MAX_COMMANDS = 8, 4096


def set_source_roots(commands: Iterable[str]) -> None:
    """Look for relative file names in the directories of the scripts these command lines run too.

    py-spy names a frame's file relative to the ``sys.path`` entry it is under, and the first entry
    is the script's directory: ``train.py`` of ``python /job/src/train.py`` is ``/job/src/train.py``.
    Only an absolute ``*.py`` argument counts (the first of each line). ``HANGDOC_SOURCE_ROOTS=0``
    turns it off (an output that does not depend on which scripts exist on this machine).

    >>> set_source_roots(["/usr/bin/python3 -u /job/src/train.py --lr 1", "python -m pkg"])
    >>> _ROOTS
    ['/job/src']
    >>> set_source_roots([])
    """
    roots: List[str] = []
    if os.environ.get("HANGDOC_SOURCE_ROOTS", "").strip().lower() in ("0", "off", "no", "false"):
        commands = ()
    for i, command in enumerate(commands):
        if i >= MAX_COMMANDS or len(roots) >= MAX_ROOTS:
            break
        for token in command[:4096].split()[:64]:
            if token.endswith(".py") and os.path.isabs(token):
                root = os.path.dirname(token)
                if root not in roots:
                    roots.append(root)
                break
    if roots != _ROOTS:
        _ROOTS[:] = roots
        for cached in (source_bytes, source_tree, blocking_call, request_wait, _calls_by_function):
            cached.cache_clear()
        from hangdoc.analysis.signatures import in_loop

        in_loop.cache_clear()


@functools.lru_cache(maxsize=8)
def source_bytes(file: str) -> Optional[bytes]:
    """The source of ``file`` as this machine has it, read as input (the name comes from a dump): a
    regular file only (a FIFO would block, ``/dev/zero`` never end), at most :data:`MAX_SOURCE`
    bytes; None otherwise. A relative name is looked for here, then under each script directory of
    :func:`set_source_roots`. Shared by every rule that looks at a call site's source."""
    data = read_source(file, MAX_SOURCE)
    if data is None and file and not os.path.isabs(file) and not file.startswith("<"):
        for root in _ROOTS:
            data = read_source(os.path.join(root, file), MAX_SOURCE)
            if data is not None:
                break
    return data


@functools.lru_cache(maxsize=1024)
def blocking_call(file: str, line: int) -> Optional[Tuple[str, str]]:
    """:func:`blocking_call_in` of ``file:line``; None when the file is not a readable regular file here."""
    text = source_line(file, line)
    return None if text is None else blocking_call_in(text)


def source_line(file: str, line: int) -> Optional[str]:
    """Line ``line`` (1-based) of ``file`` (:func:`source_bytes`); None when there is none."""
    if line is None or line < 1:
        return None
    data = source_bytes(file)
    if data is None:
        return None
    start = 0
    for _ in range(line - 1):
        start = data.find(b"\n", start) + 1
        if start == 0:
            return None
    end = data.find(b"\n", start)
    return data[start:end if end >= 0 else len(data)].decode("utf-8", "replace")


# ``req.wait()``, ``work.wait(timeout=...)``, ``reqs[i].wait()``: a name's wait() with no argument
# but a timeout. Linear: one bounded subscript, no nested quantifiers.
_REQUEST_WAIT = re.compile(r"\b[A-Za-z_]\w*(?:\[[^\]\n]{0,40}\])?\.wait\(\s*(?:timeout\s*=\s*[\w.]+\s*)?\)")
#: calls that return a point-to-point request, most telling first
_P2P_CALLS = ("batch_isend_irecv", "irecv", "isend")
_ASYNC_COLLECTIVES = frozenset({
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
    "all_to_all", "all_to_all_single", "broadcast", "reduce", "gather", "scatter", "barrier",
    "all_reduce_coalesced", "all_gather_coalesced",
})


@functools.lru_cache(maxsize=8)
def source_tree(file: str) -> Optional[ast.Module]:
    """The parsed source of ``file`` (:func:`source_bytes`), or None when unreadable or not Python."""
    data = source_bytes(file)
    if data is None:
        return None
    try:
        return ast.parse(data.decode("utf-8", "replace"))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


@functools.lru_cache(maxsize=8)
def _calls_by_function(file: str) -> Optional[Tuple[Tuple[int, int, frozenset], ...]]:
    """``(first line, last line, names called)`` of every function of ``file``; None when unreadable."""
    tree = source_tree(file)
    if tree is None:
        return None
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names = set()
            for sub in ast.walk(node):
                if isinstance(sub, ast.Call):
                    f = sub.func
                    names.add(f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else "")
            out.append((node.lineno, getattr(node, "end_lineno", node.lineno) or node.lineno, frozenset(names)))
    return tuple(out)


@functools.lru_cache(maxsize=1024)
def request_wait(file: str, line: int) -> Optional[Tuple[str, str, str]]:
    """``(category, op, statement)`` when ``file:line`` waits on a torch.distributed request
    (``req.wait()``) that the function around it got from a point-to-point call (``p2p``, op
    ``batch_isend_irecv``/``irecv``/``isend``) or from one kind of async collective
    (``collective``, its op); None otherwise (an Event's wait, a ``Popen.wait()``: :func:`blocking_call`'s).

    Looked at before :func:`blocking_call`, whose child-process pattern also matches ``x.wait()``."""
    text = source_line(file, line)
    if text is None:
        return None
    code = text[:MAX_LINE].split("#", 1)[0]
    if not _REQUEST_WAIT.search(code) or _EVENT_WAIT.search(code):
        return None
    funcs = _calls_by_function(file)
    around = [f for f in funcs or () if f[0] <= line <= f[1]]
    if not around:
        return None
    names = min(around, key=lambda f: f[1] - f[0])[2]  # the innermost function
    for op in _P2P_CALLS:
        if op in names:
            return "p2p", op, code.strip()
    coll = names & _ASYNC_COLLECTIVES
    if len(coll) == 1:
        return "collective", next(iter(coll)), code.strip()
    return None
