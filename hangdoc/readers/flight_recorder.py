"""Reader for PyTorch Flight Recorder dumps (pickle and JSON) into CollectiveRecords.

Flight Recorder (``TORCH_FR_BUFFER_SIZE``, formerly ``TORCH_NCCL_TRACE_BUFFER_SIZE``; files
``${TORCH_FR_DUMP_TEMP_FILE}<rank>``, default ``/tmp/nccl_trace_rank_<rank>``) writes one dump per
rank: ``{"version", "pg_config", "pg_status", "comm_lib_version", "entries": [...]}`` where each
entry has ``record_id, pg_id, process_group (name, desc), collective_seq_id, p2p_seq_id,
profiling_name ("nccl:all_reduce", "nccl:send 0->1", "gloo:broadcast"), input_sizes,
input_dtypes, output_sizes, state (scheduled/started/completed), retired, time_created_ns, frames``.
The file name carries the rank (the dump itself does not). In torch 2.13 gloo records collectives
too (not send/recv), so real dumps can be taken on CPU.

Pickles are read with an unpickler that resolves no global but plain containers: a dump holds
only dicts, lists, tuples, strings and numbers, and anything else is refused rather than executed.
It is the pure-Python unpickler, whose memo is a dict (the C one sizes its memo array by the
index a pickle names: 8 bytes of pickle could ask for 16 GiB), and what it built is measured
before it is used (:data:`MAX_NODES`): shared references make a few MB of pickle stand for 10^12
elements, and a list may contain itself. The file is read whole, up to :data:`MAX_DUMP` bytes.

    >>> import pickle, os, tempfile
    >>> from hangdoc.model import Source
    >>> d = {"version": "2.10", "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}},
    ...      "entries": [{"record_id": 0, "pg_id": 0, "process_group": ("0", "default_pg"),
    ...                   "collective_seq_id": 1, "p2p_seq_id": 0, "profiling_name": "nccl:all_reduce",
    ...                   "input_sizes": [[8]], "input_dtypes": ["Float"], "state": "completed",
    ...                   "time_created_ns": 0, "frames": [{"name": "main", "filename": "train.py", "line": 9}]}]}
    >>> p = os.path.join(tempfile.mkdtemp(), "nccl_trace_rank_1")
    >>> with open(p, "wb") as f:
    ...     pickle.dump(d, f)
    >>> looks_like(p, open(p, "rb").read(256))
    True
    >>> [(r.rank, r.op, r.dtypes, r.call_site, r.state) for r in read(p, Source(p))]
    [(1, 'all_reduce', ('float32',), 'train.py:9:main', 'completed')]
"""

from __future__ import annotations

import collections
import io
import json
import os
import pickle
from typing import Any, Dict, List, Optional, Tuple

from hangdoc.bounds import MAX_RANK, MAX_RANKS, MAX_SEQ, MAX_SIZE, bounded, bounded_int
from hangdoc.model import CollectiveRecord, ParseError, Source
from hangdoc.readers import fr_pickle
from hangdoc.safeio import open_input, read_bounded

FORMAT = "flight-recorder"

# ATen scalar type names as Flight Recorder writes them -> torch dtype names.
_DTYPES = {
    "Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16",
    "Long": "int64", "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8",
    "Bool": "bool", "ComplexFloat": "complex64", "ComplexDouble": "complex128",
    "Float8_e4m3fn": "float8_e4m3fn", "Float8_e5m2": "float8_e5m2",
}
# Backend op names -> torch.distributed function names, so FR and hangdoc records read alike.
_OPS = {
    "allreduce": "all_reduce", "_allgather_base": "all_gather_into_tensor", "_all_gather_base": "all_gather_into_tensor",
    "allgather": "all_gather", "_reduce_scatter_base": "reduce_scatter_tensor", "reduce_scatter_base": "reduce_scatter_tensor",
    "alltoall": "all_to_all", "alltoall_base": "all_to_all_single", "allreduce_coalesced": "all_reduce_coalesced",
    "_broadcast_oop": "broadcast", "_reduce_oop": "reduce",
}
_RANK_SUFFIXES = (".json", ".pkl", ".pickle")


def _rank_in_name(base: str) -> Optional[str]:
    """The digits a file name ends in (before .json/.pkl/.pickle), found by one scan from the end
    (the regex ``(\\d+)(...)?$`` was quadratic in a long run of digits).

    >>> _rank_in_name("nccl_trace_rank_12"), _rank_in_name("fr_3.json"), _rank_in_name("x.pkl")
    ('12', '3', None)
    """
    for suffix in _RANK_SUFFIXES:
        if base.endswith(suffix):
            base = base[:-len(suffix)]
            break
    stem = base.rstrip("0123456789")
    return base[len(stem):] or None


#: bytes of one dump read at most (real dumps are a few MB)
MAX_DUMP = 256 << 20
#: containers and scalars a loaded dump may hold, counted with repeats (a shared list counts each
#: time it is referred to): beyond this it is refused, never walked
MAX_NODES = 10_000_000


#: MARKs open at once at most (a dump nests a few deep; 1 MB of "(" made a million lists, 64 MB)
MAX_MARKS = 1000
#: pickle operations at most (each makes at most one small object: this bounds the memory a
#: pickle can ask for, whatever its size; a 20,000-entry dump takes a few million)
MAX_PICKLE_OPS = 16_000_000


class _NoGlobals(pickle._Unpickler):  # type: ignore[name-defined,misc]  # the pure-Python one: see above
    """Containers and scalars only: a dump naming any class or function is refused; MARKs nest at
    most :data:`MAX_MARKS` deep and at most :data:`MAX_PICKLE_OPS` operations run."""

    def load_mark(self) -> None:
        if len(self.metastack) >= MAX_MARKS:
            raise pickle.UnpicklingError(f"more than {MAX_MARKS} nested MARKs")
        pickle._Unpickler.load_mark(self)  # type: ignore[attr-defined]

    ops = 0

    def _count(self) -> None:
        self.ops += 1
        if self.ops > MAX_PICKLE_OPS:
            raise pickle.UnpicklingError(f"more than {MAX_PICKLE_OPS} pickle operations")

    def find_class(self, module: str, name: str) -> Any:  # noqa: D401
        if module == "builtins" and name in ("set", "frozenset", "dict", "list", "tuple"):
            import builtins

            return getattr(builtins, name)
        if module == "collections" and name == "OrderedDict":
            import collections

            return collections.OrderedDict
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def _counted(load: Any) -> Any:
    def counted(self: _NoGlobals) -> None:
        self._count()
        load(self)
    return counted


_NoGlobals.dispatch = {k: _counted(f) for k, f in pickle._Unpickler.dispatch.items()}  # type: ignore[attr-defined]
_NoGlobals.dispatch[pickle.MARK[0]] = _counted(_NoGlobals.load_mark)


class _NoGlobalsUncounted(_NoGlobals):
    """:class:`_NoGlobals` without the count of operations, for a pickle of at most
    :data:`MAX_PICKLE_OPS` bytes: every operation reads at least its own opcode byte, so it cannot
    run more operations than that anyway (counting each one took half the time of a load)."""


_NoGlobalsUncounted.dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]
_NoGlobalsUncounted.dispatch[pickle.MARK[0]] = _NoGlobals.load_mark


def _noting_shared(load: Any) -> Any:
    """A memo get (GET, BINGET, LONG_BINGET) or a DUP that notes when it fetched a container: only
    then can the loaded data refer to one container twice (or to itself), what :func:`_check_size`
    looks for. (DUP was missed once: 150 bytes of ``DUP TUPLE2`` made a tuple of 2^40 leaves that
    the reader's ``str()`` never finished.)"""
    def get(self: _NoGlobals) -> None:
        load(self)
        if isinstance(self.stack[-1], _CONTAINERS):
            self.shared = True
    return get


for _cls in (_NoGlobals, _NoGlobalsUncounted):
    _cls.shared = False
    for _op in (pickle.GET, pickle.BINGET, pickle.LONG_BINGET, pickle.DUP):
        _cls.dispatch[_op[0]] = _noting_shared(_cls.dispatch[_op[0]])


def _load_pickle(data: bytes) -> Tuple[Any, bool]:
    """The loaded data, and whether it must be walked (:func:`_check_size`) before it is used.

    Through :mod:`hangdoc.readers.fr_pickle` (Flight Recorder's own opcodes, several times faster)
    where it can (at most :data:`MAX_PICKLE_OPS` bytes: each opcode makes at most one object): it
    bounds the expanded size as it loads and its data cannot contain itself, so only a bound over
    :data:`MAX_NODES` needs the walk. Else, or when it gives up, the pure-Python unpickler below,
    whose result or error stands, and which needs the walk when a container may be referred to twice."""
    if len(data) <= MAX_PICKLE_OPS:
        try:
            obj, bound = fr_pickle.loads(data)
            return obj, bound > MAX_NODES
        except Exception:  # an opcode it does not run, or a broken pickle: the general path decides
            pass
    cls = _NoGlobalsUncounted if len(data) <= MAX_PICKLE_OPS else _NoGlobals
    u = cls(io.BytesIO(data))
    return u.load(), u.shared or len(data) > MAX_NODES


def _is_pickle(head: bytes) -> bool:
    return len(head) > 2 and head[0] == 0x80 and head[1] in (2, 3, 4, 5)


def looks_like(path: str, head: bytes) -> bool:
    """True for a Flight Recorder dump (pickle or JSON), judged on the first bytes of the file."""
    if _is_pickle(head):
        return b"entries" in head or b"pg_config" in head or b"version" in head[:64]
    text = head.lstrip()[:4096]
    if text.startswith(b"{"):
        return (b'"entries"' in text or b'"pg_config"' in text) and (
            b'"profiling_name"' in text or b'"pg_config"' in text or b'"comm_lib_version"' in text)
    return False


def load(path: str, follow: bool = True) -> Dict[str, Any]:
    """The dump as plain Python data; raises ValueError on anything else, OSError on a file that is
    no regular file or larger than :data:`MAX_DUMP`."""
    with open_input(path, follow=follow) as f:
        return loads(read_bounded(f, MAX_DUMP, "Flight Recorder dump"))


_CONTAINERS = (dict, list, tuple, set, frozenset)
#: the exact types a loaded dump's containers can have (find_class allows these and OrderedDict)
_CONTAINER_TYPES = frozenset({dict, list, tuple, set, frozenset, collections.OrderedDict})


def _check_size(obj: Any) -> None:
    """Raise ValueError when ``obj`` would hold more than :data:`MAX_NODES` values if every shared
    reference were copied (what walking it costs), or contains itself (numbers out of bounds cost
    their entry, see :func:`_record`): :func:`_expanded_size` with that limit."""
    _expanded_size(obj, MAX_NODES)


def _expanded_size(obj: Any, limit: int = 1 << 62) -> int:
    """The values ``obj`` holds with every shared reference copied (:func:`fr_pickle.expanded_size`,
    every container type a dump can hold); ValueError past ``limit`` or for a container that contains
    itself. Costs O(distinct containers and their items), never the expanded size.

    >>> shared = [[1, 2]] * 3
    >>> _expanded_size({"entries": shared})
    12
    >>> loop = []; loop.append(loop)
    >>> _check_size(loop)
    Traceback (most recent call last):
    ...
    ValueError: not a Flight Recorder dump: a container that contains itself
    """
    return fr_pickle.expanded_size(obj, {}, _CONTAINER_TYPES, limit)


def loads(data: bytes) -> Dict[str, Any]:
    """:func:`load` of bytes (what ``torch._C._distributed_c10d._dump_nccl_trace()`` returns)."""
    check = True  # JSON cannot share, but its nesting is checked the same way (cheap next to parsing it)
    if _is_pickle(data[:4]):
        try:
            obj, check = _load_pickle(data)
        except Exception as e:  # any corrupt or hostile pickle
            raise ValueError(f"not a readable Flight Recorder pickle: {type(e).__name__}: {str(e)[:200]}") from None
    else:
        try:
            obj = json.loads(data.decode("utf-8", "replace"))
        except RecursionError:
            raise ValueError("not a Flight Recorder JSON dump: nested too deeply") from None
        except ValueError as e:
            raise ValueError(f"not a Flight Recorder JSON dump: {str(e)[:200]}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("entries", []), list):
        raise ValueError("not a Flight Recorder dump (no 'entries' list)")
    if check:
        # (else the data is a tree, or its shared containers were counted as it loaded: no more than
        # MAX_NODES values with every shared reference expanded, and no cycle)
        _check_size(obj)
    return obj


def _rank_of(path: str, dump: Dict[str, Any]) -> Optional[int]:
    for key in ("rank", "global_rank"):
        r = bounded(dump.get(key), 0, MAX_RANK)
        if r is not None:
            return r
    digits = _rank_in_name(os.path.basename(path))
    return bounded_int(digits, 0, MAX_RANK) if digits else None


def _pg_ranks(dump: Dict[str, Any]) -> Dict[str, Tuple[int, ...]]:
    out: Dict[str, Tuple[int, ...]] = {}
    cfg = dump.get("pg_config") or {}
    if not isinstance(cfg, dict):
        return out
    for key, value in cfg.items():
        if not isinstance(value, dict):
            continue
        ranks = _rank_list(value.get("ranks"))
        for name in {str(key), str(value.get("name", key))}:
            if ranks:
                out[name] = ranks
    return out


def _rank_list(ranks: Any) -> Tuple[int, ...]:
    """``"[0, 1, 2]"`` (as Flight Recorder writes a group's ranks) or a list → ranks; () when any
    is no rank. Read by splitting, not ``ast.literal_eval`` (whose cost on hostile text is not bounded).

    >>> _rank_list("[0, 1, 3]"), _rank_list([2, 5]), _rank_list("[1, x]"), _rank_list("[" + "9" * 5000 + "]")
    ((0, 1, 3), (2, 5), (), ())
    """
    if isinstance(ranks, str):
        text = ranks.strip()
        if text[:1] in "[(" and text[-1:] in "])":
            text = text[1:-1]
        parts = [x for x in text.split(",") if x.strip()]
    elif isinstance(ranks, (list, tuple)):
        parts = list(ranks)
    else:
        return ()
    if len(parts) > MAX_RANKS:
        return ()
    out = []
    for x in parts:
        r = bounded_int(x, 0, MAX_RANK)
        if r is None:
            return ()
        out.append(r)
    return tuple(out)


def _call_site(frames: Any) -> str:
    """The first frame outside torch (FR lists the innermost frame first)."""
    if not isinstance(frames, list):
        return ""
    for fr in frames:
        if not isinstance(fr, dict):
            continue
        fn = str(fr.get("filename", ""))
        if not fn or "/torch/" in fn or "/hangdoc/runtime/" in fn or fn.startswith("<"):
            continue
        return f"{fn}:{str(fr.get('line', '?'))[:20]}:{str(fr.get('name', '?'))[:200]}"[:1000]
    return ""


def _op_and_p2p(name: str) -> Tuple[str, Optional[int], Optional[int]]:
    """``nccl:send 0->1`` -> ("send", src group rank, dst group rank)."""
    name = name.split(":", 1)[1] if ":" in name else name
    parts = name.split(" ")
    op = _OPS.get(parts[0], parts[0])
    if len(parts) == 2 and ("->" in parts[1] or "<-" in parts[1]):
        if "->" in parts[1]:
            s, _, d = parts[1].partition("->")
        else:
            d, _, s = parts[1].partition("<-")
        src, dst = bounded_int(s, 0, MAX_RANK), bounded_int(d, 0, MAX_RANK)
        if src is None or dst is None:
            raise ValueError(f"bad peer ranks in {name[:80]!r}")
        return op, src, dst
    return op, None, None


def read(path: str, source: Optional[Source] = None, follow: bool = True) -> List[CollectiveRecord]:
    """Records of one Flight Recorder dump; a bad entry is a ParseError (its index as the line)."""
    source = source if source is not None else Source(path)
    try:
        dump = load(path, follow)
    except (OSError, ValueError) as e:
        source.errors.append(ParseError(path, 0, str(e)))
        return []
    rank = _rank_of(path, dump)
    if rank is None:
        source.errors.append(ParseError(path, 0, "cannot tell the rank: the file name does not end in it"))
        return []
    ranks_of = _pg_ranks(dump)
    out: List[CollectiveRecord] = []
    more = 0
    # Flight Recorder writes each entry once, with its own record_id: an entry met again (the same
    # object referred to twice, or a record_id seen before) is a copy gone wrong, read once. A
    # 2.4 MB pickle of one entry referred to 20,000 times took 3.2 s (found by the fuzz run).
    seen_objects = set()
    seen_ids = set()
    repeats = 0
    for i, e in enumerate(dump.get("entries") or (), 1):
        rid = e.get("record_id") if isinstance(e, dict) else None
        if id(e) in seen_objects or (type(rid) is int and rid in seen_ids):
            repeats += 1
            continue
        seen_objects.add(id(e))
        if type(rid) is int:
            seen_ids.add(rid)
        try:
            out.append(_record(e, rank, ranks_of))
        except _ENTRY_ERRORS as err:
            if len(source.errors) < MAX_ERRORS:
                source.errors.append(ParseError(path, i, f"bad Flight Recorder entry {i}: {type(err).__name__}: {str(err)[:200]}"))
            else:
                more += 1
    if more:
        source.errors.append(ParseError(path, 0, f"{more} more bad Flight Recorder entries (the first {MAX_ERRORS} are listed)"))
    if repeats:
        source.errors.append(ParseError(path, 0, f"{repeats} repeated Flight Recorder entries (an entry or record_id "
                                                 "already read); each read once"))
    # source.records / source.formats are the caller's (hangdoc.readers.read_paths) to fill.
    return out


def records_of(dump: Dict[str, Any], rank: int) -> List[CollectiveRecord]:
    """The records of a loaded dump of ``rank``'s process; entries that do not parse are left out
    (the in-job recorder uses this on its own process's dump: nothing to report them to)."""
    ranks_of = _pg_ranks(dump)
    out: List[CollectiveRecord] = []
    for e in dump.get("entries") or ():
        try:
            out.append(_record(e, rank, ranks_of))
        except _ENTRY_ERRORS:
            pass
    return out


#: bad entries of one dump reported one by one; the rest are counted
MAX_ERRORS = 100
#: what a malformed entry may raise: it costs that entry
_ENTRY_ERRORS = (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError, RecursionError)


def _seconds(ns: Any) -> Optional[float]:
    v = bounded(ns, 0, MAX_SEQ)
    return v / 1e9 if v else None


def _record(e: Dict[str, Any], rank: int, ranks_of: Dict[str, Tuple[int, ...]]) -> CollectiveRecord:
    if not isinstance(e, dict):
        raise TypeError(f"an entry is a {type(e).__name__}, not a dict")
    pg = e.get("process_group") or (str(e.get("pg_id", "0"))[:100], "undefined")
    if not isinstance(pg, (list, tuple)) or not pg:
        raise TypeError("'process_group' is no (name, description) pair")
    pg_name, pg_desc = str(pg[0])[:200], str(pg[1])[:200] if len(pg) > 1 else "undefined"
    ranks = ranks_of.get(pg_name, ())
    group = "default_pg" if pg_desc == "default_pg" else pg_name
    name = str(e["profiling_name"])
    if len(name) > 1000:
        raise ValueError(f"profiling_name longer than 1000 characters: {name[:40]!r}...")
    op, src, dst = _op_and_p2p(name)
    peer = None
    is_p2p = src is not None or bool(e.get("is_p2p"))
    if src is not None:
        other = dst if op == "send" else src
        peer = ranks[other] if ranks and 0 <= other < len(ranks) else other
    # Flight Recorder counts from 1; hangdoc's records (and every "#N" in a report) count from 0.
    seq_id = bounded(e["p2p_seq_id"] if is_p2p else e["collective_seq_id"], 0, MAX_SEQ)
    if seq_id is None:
        raise ValueError(f"sequence number is no integer 0-{MAX_SEQ}")
    seq = max(0, seq_id - 1)
    state = str(e.get("state", ""))
    # gloo leaves finished entries "scheduled" but retired; NCCL marks them "completed", and its
    # watchdog also retires an entry that timed out or was aborted, never completed.
    nccl = str(e.get("profiling_name", "")).startswith("nccl:")
    done = state == "completed" or (bool(e.get("retired")) and not nccl)
    shapes = []
    for s in e.get("input_sizes") or ():
        dims = tuple(bounded(x, 0, MAX_SIZE) for x in s)
        if None in dims:
            raise ValueError(f"a tensor size is no integer 0-{MAX_SIZE}")
        shapes.append(dims)
    return CollectiveRecord(
        rank=rank, seq=seq, op=op, group=group, group_ranks=tuple(ranks),
        shapes=tuple(shapes),
        dtypes=tuple(_DTYPES.get(str(d)[:40], str(d)[:40].lower()) for d in e.get("input_dtypes") or ()),
        peer=peer, async_op=False, call_site=_call_site(e.get("frames")),
        time_issued=_seconds(e.get("time_created_ns")),
        time_completed=_seconds(e.get("time_discovered_completed_ns")),
        state="completed" if done else "issued", origin="flight-recorder",
    )
