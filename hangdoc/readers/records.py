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
import math
from typing import Any, BinaryIO, Callable, Dict, Iterator, List, Optional, Tuple

from hangdoc.bounds import MAX_PID, MAX_SEQ, MAX_SIZE
from hangdoc.bounds import MAX_RANKS as _MAX_RANKS
from hangdoc.model import CollectiveRecord, ParseError, Source
from hangdoc.safeio import open_input

#: seconds since the epoch, give or take: anything wider is no time (and too wide for a float)
_MAX_TIME = 1e12

FORMAT = "hangdoc-records"


def looks_like(path: str, head: bytes) -> bool:
    """True for a recorder file (its header line)."""
    return head.lstrip()[:40].startswith(b'{"hangdoc": "collectives"') or b'"hangdoc": "collectives"' in head[:200]


#: a record line longer than this is no record (one is a few hundred bytes)
MAX_RECORD_LINE = 1 << 20
#: records read from one file at most (the recorder keeps far fewer)
MAX_RECORDS = 1 << 22


def _lines(f: BinaryIO, path: str, errors: Callable[[ParseError], None]) -> Iterator[Tuple[int, str]]:
    """``(number, text)`` of each line, each read with a bound: an over-long line is reported and skipped."""
    lineno = 0
    while True:
        raw = f.readline(MAX_RECORD_LINE + 1)
        if not raw:
            return
        lineno += 1
        if len(raw) > MAX_RECORD_LINE and not raw.endswith(b"\n"):
            errors(ParseError(path, lineno, f"record line longer than {MAX_RECORD_LINE >> 10} KiB; skipped"))
            while raw and not raw.endswith(b"\n"):
                raw = f.readline(MAX_RECORD_LINE)
            continue
        yield lineno, raw.decode("utf-8", "replace")


def read(path: str, source: Optional[Source] = None, follow: bool = True) -> List[CollectiveRecord]:
    """Records of one file, each filled with the header's host/pid/rank where it lacks them.

    Only a regular file is read (``follow=False``: not through a symbolic link), line by line with
    a bound on each line and on the number of records."""
    source = source if source is not None else Source(path)
    out: List[CollectiveRecord] = []
    header: Dict[str, Any] = {}
    world: Optional[int] = None
    errors = _Errors(source)
    # The recorder writes each call once (one seq per group and rank): a repeat is a copy gone
    # wrong, read once. 8 MB of one repeated line made 18,000 records that the alignment walked
    # (2.3 s); a line equal to the one before is dropped before it is even parsed.
    seen = set()
    previous = None
    repeats = 0
    try:
        f = open_input(path, follow=follow)
    except OSError as e:
        source.errors.append(ParseError(path, 0, f"cannot read: {e.strerror or e}"))
        return out
    with f:
        for lineno, line in _lines(f, path, errors):
            line = line.strip()
            if not line:
                continue
            if line == previous:
                repeats += 1
                continue
            previous = line
            if len(out) >= MAX_RECORDS:
                errors(ParseError(path, lineno, f"more than {MAX_RECORDS} records; the rest not read"))
                break
            try:
                d = json.loads(line)
            except RecursionError:
                errors(ParseError(path, lineno, "bad record line: nested too deeply"))
                continue
            except ValueError as e:
                errors(ParseError(path, lineno, f"bad record line: {str(e).split(':')[0]}"))
                continue
            if not isinstance(d, dict):
                errors(ParseError(path, lineno, "bad record line: not an object"))
                continue
            if d.get("hangdoc") == "collectives":
                if d.get("version", 1) != 1:
                    errors(ParseError(path, lineno, f"unknown records version {str(d.get('version'))[:40]!r}; reading anyway"))
                header = d
                ws = d.get("world_size")
                world = ws if _is_int(ws) and 0 < ws <= MAX_RANKS else None
                if ws is not None and world is None:
                    errors(ParseError(path, lineno, f"bad header: world_size {str(ws)[:40]!r} is not a positive integer up to {MAX_RANKS}"))
                continue
            for key in ("rank", "host", "pid"):
                if d.get(key) is None and header.get(key) is not None:
                    d[key] = header[key]
            problem = check(d, world)
            if problem is None:
                try:
                    rec = CollectiveRecord.from_json(d)
                except (TypeError, ValueError, OverflowError) as e:
                    problem = str(e)[:200]
                else:
                    key = (rec.rank, rec.group, rec.seq, rec.origin)
                    if key in seen:
                        repeats += 1
                    else:
                        seen.add(key)
                        out.append(rec)
                    continue
            errors(ParseError(path, lineno, f"bad record: {problem}"))
    if repeats:
        source.errors.append(ParseError(path, 0, f"{repeats} repeated records (a seq of a group and rank already read); "
                                                 "each read once"))
    if errors.more:
        source.errors.append(ParseError(path, 0, f"{errors.more} more bad lines (the first {MAX_ERRORS} are listed)"))
    # source.records / source.formats are the caller's (hangdoc.readers.read_paths) to fill.
    return out


#: bad lines of one file reported one by one; the rest are counted (a million bad lines cost no memory)
MAX_ERRORS = 100


class _Errors:
    def __init__(self, source: Source) -> None:
        self.source = source
        self.first = len(source.errors)
        self.more = 0

    def __call__(self, error: ParseError) -> None:
        if len(self.source.errors) - self.first < MAX_ERRORS:
            self.source.errors.append(error)
        else:
            self.more += 1


#: No job has more ranks than this; a rank beyond it is a corrupt line, not a rank to report missing.
#: (hangdoc.bounds.MAX_RANKS, the bound of every rank read from input)
MAX_RANKS = _MAX_RANKS
STATES = ("issued", "completed", "failed")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _type(x: Any) -> str:
    return "null" if x is None else {dict: "object", list: "array", str: "string", bool: "boolean"}.get(type(x), type(x).__name__)


def check(d: Dict[str, Any], world: Optional[int] = None) -> Optional[str]:
    """What is wrong with one record object, or None. ``world``: the header's world size.

    Every field the analysis reads is checked here, so a corrupt line is reported with its file and
    line instead of failing a rule later or naming a rank that does not exist.

        >>> check({"rank": 1, "seq": 0, "op": "broadcast", "root": 0, "shapes": [[8]]}, world=2)
        >>> check({"rank": 1, "seq": 0, "op": "broadcast", "group": {}})
        "'group' must be a string, not object"
        >>> check({"rank": 1000000, "seq": 0, "op": "barrier"}, world=4)
        'rank 1000000 is outside the world of 4 ranks'
    """
    limit = world or MAX_RANKS
    where = f"the world of {world} ranks" if world else f"0-{MAX_RANKS - 1}"

    def rank_problem(key: str, v: Any) -> Optional[str]:
        if not _is_int(v):
            return f"{key!r} must be an integer, not {_type(v)}"
        if not 0 <= v < limit:
            return f"{key.replace('_', ' ')} {v} is outside {where}"
        return None

    for key in ("rank", "seq", "op"):
        if key not in d or d[key] is None:
            return f"{key!r} is missing"
    p = rank_problem("rank", d["rank"])
    if p:
        return p
    if not _is_int(d["seq"]) or not 0 <= d["seq"] <= MAX_SEQ:
        return f"'seq' must be a non-negative integer, not {str(d['seq'])[:40]}"[:120]
    if not isinstance(d["op"], str) or not d["op"]:
        return f"'op' must be a non-empty string, not {_type(d['op'])}"
    for key in ("root", "peer"):
        if d.get(key) is not None:
            p = rank_problem(key, d[key])
            if p:
                return p
    for key in ("group", "call_site", "origin", "state"):
        if key in d and not isinstance(d[key], str):
            return f"{key!r} must be a string, not {_type(d[key])}"
    for key in ("stream", "phase", "host"):
        if d.get(key) is not None and not isinstance(d[key], str):
            return f"{key!r} must be a string or null, not {_type(d[key])}"
    if "state" in d and d["state"] not in STATES:
        return f"'state' must be one of {', '.join(STATES)}, not {str(d['state'])[:40]!r}"[:120]
    if "async_op" in d and not isinstance(d["async_op"], bool):
        return f"'async_op' must be true or false, not {_type(d['async_op'])}"
    if d.get("pid") is not None and (not _is_int(d["pid"]) or not 0 <= d["pid"] <= MAX_PID):
        return f"'pid' must be an integer 0-{MAX_PID}, not {_type(d['pid'])}"
    for key in ("time_issued", "time_completed"):
        v = d.get(key)
        if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not -_MAX_TIME <= v <= _MAX_TIME
                              or not math.isfinite(v)):
            return f"{key!r} must be a number of seconds or null, not {_type(v) if not isinstance(v, float) else v}"
    gr = d.get("group_ranks")
    if gr is not None:
        if not isinstance(gr, list):
            return f"'group_ranks' must be an array of ranks, not {_type(gr)}"
        if len(gr) > MAX_RANKS:
            return f"'group_ranks' holds more than {MAX_RANKS} ranks"
        for v in gr:
            p = rank_problem("group_ranks", v)
            if p:
                return p
    shapes = d.get("shapes")
    if shapes is not None:
        if not isinstance(shapes, list) or not all(isinstance(s, list) and all(_is_int(x) and 0 <= x <= MAX_SIZE for x in s)
                                                   for s in shapes):
            return "'shapes' must be an array of arrays of non-negative integers"
    dtypes = d.get("dtypes")
    if dtypes is not None and (not isinstance(dtypes, list) or not all(isinstance(x, str) for x in dtypes)):
        return "'dtypes' must be an array of strings"
    return None


def world_size(path: str) -> Optional[int]:
    """The header's world size, if the file has one."""
    try:
        with open_input(path) as f:
            d = json.loads(f.readline(MAX_RECORD_LINE).decode("utf-8", "replace"))
        ws = d.get("world_size") if d.get("hangdoc") == "collectives" else None
        return ws if _is_int(ws) and 0 < ws <= MAX_RANKS else None
    except (OSError, ValueError, TypeError, AttributeError, RecursionError):
        return None
