"""Reader for the recorder's files: ``collectives-{host}-r{rank}-{pid}.jsonl``.

The first line is a header (``{"hangdoc": "collectives", "version": 1, "host", "rank", "pid",
"world_size"}``); every other line is one ``CollectiveRecord.to_json()``. A bad line becomes a
``ParseError`` naming the file and line; the rest of the file is still read.

    >>> import json, os, tempfile
    >>> from hangdoc.model import Source
    >>> p = os.path.join(tempfile.mkdtemp(), "collectives-n1-r1-7.jsonl")
    >>> with open(p, "w") as f:
    ...     _ = f.write(json.dumps({"hangdoc": "collectives", "version": 1, "host": "n1", "rank": 1, "pid": 7}) + "\\n")
    ...     _ = f.write(json.dumps({"rank": 1, "seq": 0, "op": "all_reduce", "shapes": [[8]]}) + "\\n")
    ...     _ = f.write("{not json\\n")
    >>> src = Source(p)
    >>> [r.describe() for r in read(p, src)], [str(e).split(": ", 1)[1] for e in src.errors]
    (['all_reduce([8])'], ['bad record line: Expecting property name enclosed in double quotes'])
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional

from hangdoc.model import CollectiveRecord, ParseError, Source

FORMAT = "hangdoc-records"


def looks_like(path: str, head: bytes) -> bool:
    """True for a recorder file (its header line)."""
    return head.lstrip()[:40].startswith(b'{"hangdoc": "collectives"') or b'"hangdoc": "collectives"' in head[:200]


def read(path: str, source: Optional[Source] = None) -> List[CollectiveRecord]:
    """Records of one file, each filled with the header's host/pid/rank where it lacks them."""
    source = source if source is not None else Source(path)
    out: List[CollectiveRecord] = []
    header: Dict[str, Any] = {}
    try:
        f = open(path, "r", encoding="utf-8", errors="replace")
    except OSError as e:
        source.errors.append(ParseError(path, 0, f"cannot read: {e.strerror or e}"))
        return out
    with f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                d = json.loads(line)
            except ValueError as e:
                source.errors.append(ParseError(path, lineno, f"bad record line: {str(e).split(':')[0]}"))
                continue
            if not isinstance(d, dict):
                source.errors.append(ParseError(path, lineno, "bad record line: not an object"))
                continue
            if d.get("hangdoc") == "collectives":
                if d.get("version", 1) != 1:
                    source.errors.append(ParseError(path, lineno, f"unknown records version {d.get('version')!r}; reading anyway"))
                header = d
                continue
            for key in ("rank", "host", "pid"):
                if d.get(key) is None and header.get(key) is not None:
                    d[key] = header[key]
            try:
                rec = CollectiveRecord.from_json(d)
                if not isinstance(rec.rank, int) or not isinstance(rec.seq, int) or not isinstance(rec.op, str):
                    raise ValueError("rank, seq and op are required")
            except (TypeError, ValueError) as e:
                source.errors.append(ParseError(path, lineno, f"bad record: {e}"))
                continue
            out.append(rec)
    # source.records / source.formats are the caller's (hangdoc.readers.read_paths) to fill.
    return out


def world_size(path: str) -> Optional[int]:
    """The header's world size, if the file has one."""
    try:
        with open(path, "r", encoding="utf-8", errors="replace") as f:
            d = json.loads(f.readline())
        return int(d["world_size"]) if d.get("hangdoc") == "collectives" and d.get("world_size") else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
