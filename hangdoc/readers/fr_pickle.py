"""A fast loader for the pickles Flight Recorder writes: plain containers and scalars only.

:mod:`hangdoc.readers.flight_recorder` reads pickles with the pure-Python unpickler (the C one sizes
its memo by the index a pickle names, and cannot be made to refuse that), which costs about half a
microsecond a byte: a few MB of dump took 2-3 s. Flight Recorder's pickles (protocol 2, written by
torch) use a small set of binary opcodes (no frames, no globals); this loader runs those in one loop
over the bytes, with the memo a dict, and gives up (:class:`Unsupported`) on anything else, a global
above all, so that the caller falls back to the pure-Python path, whose result or error then stands.
What it builds is what ``pickle.loads`` builds for those opcodes (tested against it).

It also bounds what the loaded object holds with every shared reference expanded (what walking it
costs), so that the caller walks it only when the bound is large. A container can be referred to
twice only through a memo get or a ``DUP`` (a *fetch*); a container fetched is *frozen* (it and
everything in it: a pickle that adds to one later is given up, which no pickler writes), so its
expanded size is final then and is counted once per fetch. Each operation reads at least one byte
and pushes at least one value, so the bound is ``len(data)`` plus, per fetch of a container, its
expanded size less one (a value dropped, a dict's key set twice, is still counted: a bound). Freezing
also means the object cannot contain itself: a container can only become its own descendant by being
added to after it was fetched. (Torch's dumps fetch their frame dicts, shared between entries: a few
values each.)

    >>> import pickle
    >>> d = {"entries": [{"frames": [{"line": 9}], "state": "completed", "t": 1.5, "x": (1, None, True)}]}
    >>> data = pickle.dumps(d, protocol=2)
    >>> loads(data) == (d, len(data))
    True
    >>> shared = list(range(100))
    >>> data = pickle.dumps([shared, shared], protocol=2)
    >>> loads(data)[1] - len(data)      # the second reference stands for 101 values, not 1
    100
"""

from __future__ import annotations

import struct
from typing import Any, Dict, List, Optional, Tuple

#: MARKs open at once at most (as the pure-Python path: see flight_recorder.MAX_MARKS)
MAX_MARKS = 1000

#: the containers this loader builds
_CONTAINERS = frozenset({dict, list, tuple})
_DOUBLE = struct.Struct(">d")


class Unsupported(Exception):
    """An opcode this loader does not run, or a pickle it cannot read: use the general path."""


def expanded_size(x: Any, sizes: Dict[int, int], kinds: Any = _CONTAINERS, limit: int = 1 << 62,
                  keep: Optional[List[Any]] = None) -> int:
    """The values ``x`` holds with every shared reference copied (a dict's keys count; a container
    counts one), ValueError past ``limit`` or for a container that contains itself. Each container's
    size is computed once, depth first without recursion, into ``sizes`` (id -> size; pass the same
    dict again and the containers sized before are not walked again; ``keep`` keeps them alive, so no
    id is reused); scalars are counted by ``len``, only containers (types in ``kinds``) visited.

    >>> shared = [[1, 2]] * 3
    >>> expanded_size({"entries": shared}, {})
    12
    """
    if type(x) not in kinds:
        return 1
    size = sizes.get(id(x))
    if size is not None:
        return size
    entered = set()
    todo = [x]
    while todo:
        y = todo[-1]
        i = id(y)
        if i in sizes:
            todo.pop()
            continue
        if isinstance(y, dict):
            kids = [c for c in y.values() if type(c) in kinds]
            kids += [k for k in y if type(k) in kinds]  # a tuple or frozenset as a key
            n = 1 + 2 * len(y) - len(kids)
        else:
            kids = [c for c in y if type(c) in kinds]
            n = 1 + len(y) - len(kids)
        if i not in entered:
            entered.add(i)
            pending = [c for c in kids if id(c) not in sizes]
            if pending:
                if any(id(c) in entered for c in pending):  # entered and not done: y is its own descendant
                    raise ValueError("not a Flight Recorder dump: a container that contains itself")
                todo.extend(pending)
                continue
        for c in kids:
            n += sizes[id(c)]
        if n > limit:
            raise ValueError(f"not a Flight Recorder dump: more than {limit} values (shared references expanded)")
        sizes[i] = n
        if keep is not None:
            keep.append(y)
        entered.discard(i)
        todo.pop()
    return sizes[id(x)]


def loads(data: bytes) -> Tuple[Any, int]:  # noqa: C901 - one loop, on purpose (speed)
    """``(object, bound)`` for a pickle of containers and scalars, ``bound`` at least the number of
    values the object holds with shared references expanded; :class:`Unsupported` else."""
    try:
        return _loads(data)
    except IndexError:  # a read past the end or of an empty stack: the general path says which
        raise Unsupported("truncated") from None


def _loads(data: bytes) -> Tuple[Any, int]:  # noqa: C901
    mv = memoryview(data)
    n = len(data)
    i = 0
    stack: List[Any] = []
    marks: List[int] = []
    memo: Dict[int, Any] = {}
    frozen: Dict[int, int] = {}  # the containers fetched, and those in them: id -> expanded size
    keep: List[Any] = []
    extra = 0  # per fetch of a container, its expanded size less the one value the fetch pushed
    floor = 0  # the stack's items above the innermost open MARK are the ones an operation may take
    append = stack.append
    from_bytes = int.from_bytes
    kinds = _CONTAINERS
    # The branches in the order of how often torch's dumps use them (a bytes index past the end
    # raises IndexError: see loads).
    while True:
        op = data[i]
        i += 1
        if op == 0x68:  # BINGET
            v = memo[data[i]]
            i += 1
            if type(v) in kinds:
                extra += expanded_size(v, frozen, kinds, keep=keep) - 1
            append(v)
        elif op == 0x28:  # MARK
            if len(marks) >= MAX_MARKS:
                raise Unsupported("MARKs")
            floor = len(stack)
            marks.append(floor)
        elif op == 0x4B:  # BININT1
            append(data[i])
            i += 1
        elif op == 0x5D:  # EMPTY_LIST
            append([])
        elif op == 0x65:  # APPENDS
            if not marks:
                raise Unsupported("APPENDS without MARK")
            k = marks.pop()
            floor = marks[-1] if marks else 0
            if k <= floor:
                raise Unsupported("APPENDS")
            target = stack[k - 1]
            if type(target) is not list or id(target) in frozen:
                raise Unsupported("APPENDS to a non-list, or to a list fetched before")
            target.extend(stack[k:])
            del stack[k:]
        elif op == 0x7D:  # EMPTY_DICT
            append({})
        elif op == 0x75:  # SETITEMS
            if not marks:
                raise Unsupported("SETITEMS without MARK")
            k = marks.pop()
            floor = marks[-1] if marks else 0
            if k <= floor or (len(stack) - k) % 2:
                raise Unsupported("SETITEMS")
            target = stack[k - 1]
            if type(target) is not dict or id(target) in frozen:
                raise Unsupported("SETITEMS on a non-dict, or on a dict fetched before")
            items = stack[k:]
            del stack[k:]
            for j in range(0, len(items), 2):
                target[items[j]] = items[j + 1]  # a key set twice drops a value: the bound stays a bound
        elif op == 0x4E:  # NONE
            append(None)
        elif op == 0x71:  # BINPUT
            if len(stack) <= floor:
                raise Unsupported("BINPUT")
            memo[data[i]] = stack[-1]
            i += 1
        elif op == 0x58 or op == 0x8C:  # BINUNICODE (4-byte length), SHORT_BINUNICODE (1-byte length)
            w = 4 if op == 0x58 else 1
            if i + w > n:
                raise Unsupported("truncated")
            size = from_bytes(data[i:i + w], "little")
            i += w
            if i + size > n:
                raise Unsupported("truncated")
            append(str(mv[i:i + size], "utf-8", "surrogatepass"))
            i += size
        elif op == 0x4A:  # BININT
            if i + 4 > n:
                raise Unsupported("truncated")
            append(from_bytes(data[i:i + 4], "little", signed=True))
            i += 4
        elif op == 0x89:  # NEWFALSE
            append(False)
        elif op == 0x88:  # NEWTRUE
            append(True)
        elif op == 0x85 or op == 0x86 or op == 0x87:  # TUPLE1, TUPLE2, TUPLE3
            k = op - 0x84
            if len(stack) - floor < k:
                raise Unsupported("TUPLEn")
            t = tuple(stack[-k:])
            del stack[-k:]
            append(t)
        elif op == 0x8A:  # LONG1
            size = data[i]
            i += 1
            if i + size > n:
                raise Unsupported("truncated")
            append(from_bytes(data[i:i + size], "little", signed=True))
            i += size
        elif op == 0x4D:  # BININT2
            append(data[i] | data[i + 1] << 8)
            i += 2
        elif op == 0x74:  # TUPLE
            if not marks:
                raise Unsupported("TUPLE without MARK")
            k = marks.pop()
            floor = marks[-1] if marks else 0
            t = tuple(stack[k:])
            del stack[k:]
            append(t)
        elif op == 0x29:  # EMPTY_TUPLE
            append(())
        elif op == 0x61:  # APPEND
            if len(stack) - floor < 2 or type(stack[-2]) is not list or id(stack[-2]) in frozen:
                raise Unsupported("APPEND")
            v = stack.pop()
            stack[-1].append(v)
        elif op == 0x73:  # SETITEM
            if len(stack) - floor < 3 or type(stack[-3]) is not dict or id(stack[-3]) in frozen:
                raise Unsupported("SETITEM")
            v = stack.pop()
            key = stack.pop()
            stack[-1][key] = v
        elif op == 0x47:  # BINFLOAT
            if i + 8 > n:
                raise Unsupported("truncated")
            append(_DOUBLE.unpack_from(data, i)[0])
            i += 8
        elif op == 0x6A:  # LONG_BINGET
            if i + 4 > n:
                raise Unsupported("truncated")
            v = memo[from_bytes(data[i:i + 4], "little")]
            i += 4
            if type(v) in kinds:
                extra += expanded_size(v, frozen, kinds, keep=keep) - 1
            append(v)
        elif op == 0x72:  # LONG_BINPUT
            if i + 4 > n or len(stack) <= floor:
                raise Unsupported("LONG_BINPUT")
            memo[from_bytes(data[i:i + 4], "little")] = stack[-1]
            i += 4
        elif op == 0x94:  # MEMOIZE
            if len(stack) <= floor:
                raise Unsupported("MEMOIZE")
            memo[len(memo)] = stack[-1]
        elif op == 0x32:  # DUP
            if len(stack) <= floor:
                raise Unsupported("DUP")
            v = stack[-1]
            if type(v) in kinds:
                extra += expanded_size(v, frozen, kinds, keep=keep) - 1
            append(v)
        elif op == 0x2E:  # STOP
            if len(stack) != 1 or marks:
                raise Unsupported("STOP with a stack of %d" % len(stack))
            return stack[0], n + extra
        elif op == 0x80:  # PROTO
            if data[i] > 5:
                raise Unsupported("PROTO")
            i += 1
        else:
            raise Unsupported(f"opcode {op:#x}")
