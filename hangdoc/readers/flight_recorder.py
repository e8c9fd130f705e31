"""Reader for PyTorch Flight Recorder dumps (pickle and JSON) into CollectiveRecords.

Flight Recorder (``TORCH_FR_BUFFER_SIZE``, formerly ``TORCH_NCCL_TRACE_BUFFER_SIZE``; files
``${TORCH_FR_DUMP_TEMP_FILE}<rank>``, default ``/tmp/nccl_trace_rank_<rank>``) writes one dump per
rank: ``{"version", "pg_config", "pg_status", "comm_lib_version", "entries": [...]}`` where each
entry has ``record_id, pg_id, process_group (name, desc), collective_seq_id, p2p_seq_id,
profiling_name ("nccl:all_reduce", "nccl:send 0->1", "gloo:broadcast"), input_sizes,
input_dtypes, output_sizes, state (scheduled/started/completed), retired, time_created_ns, frames``.
The file name carries the rank (the dump itself does not). In torch 2.13 gloo records collectives
too (not send/recv), so real dumps can be taken on CPU.

Pickles are read with an unpickler that resolves no global at all: a dump holds only dicts,
lists, tuples, strings and numbers, and anything else is refused rather than executed.

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

import ast
import io
import json
import os
import pickle
import re
from typing import Any, Dict, List, Optional, Tuple

from hangdoc.model import CollectiveRecord, ParseError, Source

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
_RANK_IN_NAME = re.compile(r"(\d+)(?:\.json|\.pkl|\.pickle)?$")


class _NoGlobals(pickle.Unpickler):
    """Containers and scalars only: a dump naming any class or function is refused."""

    def find_class(self, module: str, name: str) -> Any:  # noqa: D401
        if module == "builtins" and name in ("set", "frozenset", "dict", "list", "tuple"):
            import builtins

            return getattr(builtins, name)
        if module == "collections" and name == "OrderedDict":
            import collections

            return collections.OrderedDict
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


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


def load(path: str) -> Dict[str, Any]:
    """The dump as plain Python data; raises ValueError on anything else."""
    with open(path, "rb") as f:
        return loads(f.read())


def loads(data: bytes) -> Dict[str, Any]:
    """:func:`load` of bytes (what ``torch._C._distributed_c10d._dump_nccl_trace()`` returns)."""
    if _is_pickle(data[:4]):
        try:
            obj = _NoGlobals(io.BytesIO(data)).load()
        except Exception as e:  # any corrupt or hostile pickle
            raise ValueError(f"not a readable Flight Recorder pickle: {e}") from None
    else:
        try:
            obj = json.loads(data.decode("utf-8", "replace"))
        except ValueError as e:
            raise ValueError(f"not a Flight Recorder JSON dump: {e}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("entries", []), list):
        raise ValueError("not a Flight Recorder dump (no 'entries' list)")
    return obj


def _rank_of(path: str, dump: Dict[str, Any]) -> Optional[int]:
    for key in ("rank", "global_rank"):
        if isinstance(dump.get(key), int):
            return dump[key]
    m = _RANK_IN_NAME.search(os.path.basename(path))
    return int(m.group(1)) if m else None


def _pg_ranks(dump: Dict[str, Any]) -> Dict[str, Tuple[int, ...]]:
    out: Dict[str, Tuple[int, ...]] = {}
    cfg = dump.get("pg_config") or {}
    if not isinstance(cfg, dict):
        return out
    for key, value in cfg.items():
        if not isinstance(value, dict):
            continue
        ranks = value.get("ranks")
        try:
            ranks = ast.literal_eval(ranks) if isinstance(ranks, str) else ranks
            ranks = tuple(int(r) for r in ranks or ())
        except (ValueError, SyntaxError, TypeError):
            ranks = ()
        for name in {str(key), str(value.get("name", key))}:
            if ranks:
                out[name] = ranks
    return out


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
        return f"{fn}:{fr.get('line', '?')}:{fr.get('name', '?')}"
    return ""


def _op_and_p2p(name: str) -> Tuple[str, Optional[int], Optional[int]]:
    """``nccl:send 0->1`` -> ("send", src group rank, dst group rank)."""
    name = name.split(":", 1)[1] if ":" in name else name
    parts = name.split(" ")
    op = _OPS.get(parts[0], parts[0])
    if len(parts) == 2 and "->" in parts[1]:
        s, d = parts[1].split("->")
        return op, int(s), int(d)
    if len(parts) == 2 and "<-" in parts[1]:
        d, s = parts[1].split("<-")
        return op, int(s), int(d)
    return op, None, None


def read(path: str, source: Optional[Source] = None) -> List[CollectiveRecord]:
    """Records of one Flight Recorder dump; a bad entry is a ParseError (its index as the line)."""
    source = source if source is not None else Source(path)
    try:
        dump = load(path)
    except (OSError, ValueError) as e:
        source.errors.append(ParseError(path, 0, str(e)))
        return []
    rank = _rank_of(path, dump)
    if rank is None:
        source.errors.append(ParseError(path, 0, "cannot tell the rank: the file name does not end in it"))
        return []
    ranks_of = _pg_ranks(dump)
    out: List[CollectiveRecord] = []
    for i, e in enumerate(dump.get("entries") or (), 1):
        try:
            out.append(_record(e, rank, ranks_of))
        except (KeyError, TypeError, ValueError, IndexError) as err:
            source.errors.append(ParseError(path, i, f"bad Flight Recorder entry {i}: {type(err).__name__}: {err}"))
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
        except (KeyError, TypeError, ValueError, IndexError):
            pass
    return out


def _record(e: Dict[str, Any], rank: int, ranks_of: Dict[str, Tuple[int, ...]]) -> CollectiveRecord:
    pg = e.get("process_group") or (str(e.get("pg_id", "0")), "undefined")
    pg_name, pg_desc = str(pg[0]), str(pg[1]) if len(pg) > 1 else "undefined"
    ranks = ranks_of.get(pg_name, ())
    group = "default_pg" if pg_desc == "default_pg" else pg_name
    op, src, dst = _op_and_p2p(str(e["profiling_name"]))
    peer = None
    is_p2p = src is not None or bool(e.get("is_p2p"))
    if src is not None:
        other = dst if op == "send" else src
        peer = ranks[other] if ranks and 0 <= other < len(ranks) else other
    # Flight Recorder counts from 1; hangdoc's records (and every "#N" in a report) count from 0.
    seq = max(0, int(e["p2p_seq_id"] if is_p2p else e["collective_seq_id"]) - 1)
    state = str(e.get("state", ""))
    # gloo leaves finished entries "scheduled" but retired; NCCL marks them "completed", and its
    # watchdog also retires an entry that timed out or was aborted, never completed.
    nccl = str(e.get("profiling_name", "")).startswith("nccl:")
    done = state == "completed" or (bool(e.get("retired")) and not nccl)
    created = e.get("time_created_ns")
    completed = e.get("time_discovered_completed_ns")
    return CollectiveRecord(
        rank=rank, seq=seq, op=op, group=group, group_ranks=tuple(ranks),
        shapes=tuple(tuple(int(x) for x in s) for s in e.get("input_sizes") or ()),
        dtypes=tuple(_DTYPES.get(str(d), str(d).lower()) for d in e.get("input_dtypes") or ()),
        peer=peer, async_op=False, call_site=_call_site(e.get("frames")),
        time_issued=created / 1e9 if created else None,
        time_completed=completed / 1e9 if completed else None,
        state="completed" if done else "issued", origin="flight-recorder",
    )
