"""A fast loader for the pickles Flight Recorder writes: plain containers and scalars only.

:mod:`hangdoc.readers.flight_recorder` reads pickles with the pure-Python unpickler (the C one sizes
its memo by the index a pickle names, and cannot be made to refuse that), which costs about half a
microsecond a byte: a few MB of dump took 2-3 s. Flight Recorder's pickles (protocol 2, written by
torch) use a small set of binary opcodes (no frames, no globals); this loader runs those in one loop over the bytes, with
the memo a dict, and gives up (:class:`Unsupported`) on anything else, a global above all, so that
the caller falls back to the pure-Python path, whose result or error then stands. What it builds is
what ``pickle.loads`` builds for those opcodes (tested against it).

It also says whether a container may be referred to twice (a memo get or a ``DUP`` that fetched
one): only then does the caller need to measure the expanded size.

    >>> import pickle
    >>> d = {"entries": [{"frames": [{"line": 9}], "state": "completed", "t": 1.5, "x": (1, None, True)}]}
    >>> loads(pickle.dumps(d, protocol=2)) == (d, False)
    True
    >>> shared = [1, 2]
    >>> loads(pickle.dumps([shared, shared], protocol=2))[1]
    True
"""

from __future__ import annotations

import struct
from typing import Any, Dict, List, Tuple

#: MARKs open at once at most (as the pure-Python path: see flight_recorder.MAX_MARKS)
MAX_MARKS = 1000

_CONTAINERS = (dict, list, tuple, set, frozenset)
_DOUBLE = struct.Struct(">d")


class Unsupported(Exception):
    """An opcode this loader does not run, or a pickle it cannot read: use the general path."""


def loads(data: bytes) -> Tuple[Any, bool]:  # noqa: C901 - one loop, on purpose (speed)
    """``(object, shared)`` for a pickle of containers and scalars; :class:`Unsupported` else."""
    mv = memoryview(data)
    n = len(data)
    i = 0
    stack: List[Any] = []
    marks: List[int] = []
    memo: Dict[int, Any] = {}
    shared = False
    floor = 0  # the stack's items above the innermost open MARK are the ones an operation may take
    append = stack.append
    from_bytes = int.from_bytes
    while True:
        if i >= n:
            raise Unsupported("truncated: no STOP")
        op = data[i]
        i += 1
        if op == 0x68:  # BINGET
            if i >= n:
                raise Unsupported("truncated")
            v = memo[data[i]]
            i += 1
            if type(v) in _CONTAINERS:
                shared = True
            append(v)
        elif op == 0x71:  # BINPUT
            if i >= n or len(stack) <= floor:
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
        elif op == 0x4B:  # BININT1
            if i >= n:
                raise Unsupported("truncated")
            append(data[i])
            i += 1
        elif op == 0x28:  # MARK
            if len(marks) >= MAX_MARKS:
                raise Unsupported("MARKs")
            floor = len(stack)
            marks.append(floor)
        elif op == 0x5D:  # EMPTY_LIST
            append([])
        elif op == 0x7D:  # EMPTY_DICT
            append({})
        elif op == 0x65:  # APPENDS
            if not marks:
                raise Unsupported("APPENDS without MARK")
            k = marks.pop()
            floor = marks[-1] if marks else 0
            if k <= floor:
                raise Unsupported("APPENDS")
            items = stack[k:]
            del stack[k:]
            target = stack[-1]
            if type(target) is not list:
                raise Unsupported("APPENDS to a non-list")
            target.extend(items)
        elif op == 0x75:  # SETITEMS
            if not marks:
                raise Unsupported("SETITEMS without MARK")
            k = marks.pop()
            floor = marks[-1] if marks else 0
            if k <= floor or (len(stack) - k) % 2:
                raise Unsupported("SETITEMS")
            items = stack[k:]
            del stack[k:]
            target = stack[-1]
            if type(target) is not dict:
                raise Unsupported("SETITEMS on a non-dict")
            for j in range(0, len(items), 2):
                target[items[j]] = items[j + 1]
        elif op == 0x4D:  # BININT2
            if i + 2 > n:
                raise Unsupported("truncated")
            append(data[i] | data[i + 1] << 8)
            i += 2
        elif op == 0x4A:  # BININT
            if i + 4 > n:
                raise Unsupported("truncated")
            append(from_bytes(data[i:i + 4], "little", signed=True))
            i += 4
        elif op == 0x8A:  # LONG1
            if i >= n:
                raise Unsupported("truncated")
            size = data[i]
            i += 1
            if i + size > n:
                raise Unsupported("truncated")
            append(from_bytes(data[i:i + size], "little", signed=True))
            i += size
        elif op == 0x4E:  # NONE
            append(None)
        elif op == 0x88:  # NEWTRUE
            append(True)
        elif op == 0x89:  # NEWFALSE
            append(False)
        elif op == 0x85 or op == 0x86 or op == 0x87:  # TUPLE1, TUPLE2, TUPLE3
            k = op - 0x84
            if len(stack) - floor < k:
                raise Unsupported("TUPLEn")
            t = tuple(stack[-k:])
            del stack[-k:]
            append(t)
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
            if len(stack) - floor < 2 or type(stack[-2]) is not list:
                raise Unsupported("APPEND")
            v = stack.pop()
            stack[-1].append(v)
        elif op == 0x73:  # SETITEM
            if len(stack) - floor < 3 or type(stack[-3]) is not dict:
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
            if type(v) in _CONTAINERS:
                shared = True
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
            if type(v) in _CONTAINERS:
                shared = True
            append(v)
        elif op == 0x2E:  # STOP
            if len(stack) != 1 or marks:
                raise Unsupported("STOP with a stack of %d" % len(stack))
            return stack[0], shared
        elif op == 0x80:  # PROTO
            if i >= n or data[i] > 5:
                raise Unsupported("PROTO")
            i += 1
        else:
            raise Unsupported(f"opcode {op:#x}")
