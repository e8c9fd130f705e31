"""A readable side-by-side view of where ranks' collective sequences part ways.

One block per process group that diverged: the analysis's one-line summary, then the calls around
the first divergence, one column per distinct sequence (the agreeing ranks first), each cell the
call's seq, op and signature and the user call site. Not a wall of records: a few rows of context.

    >>> from hangdoc.model import CollectiveRecord as R
    >>> f32 = dict(dtypes=("float32",), state="completed")
    >>> recs = [R(0, 0, "all_reduce", shapes=((4,),), call_site="t.py:3:f", **f32),
    ...         R(0, 1, "broadcast", shapes=((8,),), root=0, call_site="t.py:5:f", **f32),
    ...         R(1, 0, "all_reduce", shapes=((4,),), call_site="t.py:3:f", **f32)]
    >>> print(side_by_side(by_rank(recs), "default_pg", [1], index=1))  # doctest: +NORMALIZE_WHITESPACE
           rank 0                                       | rank 1
      #0   all_reduce([4] float32)   t.py:3 f           | all_reduce([4] float32)   t.py:3 f
    > #1   broadcast([8] float32, src=0)   t.py:5 f     ! (nothing)
"""

from __future__ import annotations

import os
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from hangdoc.model import CollectiveRecord
from hangdoc.ranges import compress_ranks, describe_ranks

#: rows shown before and after the first divergence.
CONTEXT = 2
#: at most this many columns (distinct sequences) side by side.
MAX_COLUMNS = 3
CELL = 44


P2P_OPS = frozenset({"send", "recv", "isend", "irecv", "send_object_list", "recv_object_list"})


def by_rank(records: Iterable[CollectiveRecord]) -> Dict[int, Dict[str, List[CollectiveRecord]]]:
    """rank -> group -> collective records in seq order. Point-to-point calls are left out (they
    pair up by peer, not by position), and so are calls of a rank on a group it is not in (torch
    makes them no-ops, so they are not part of that group's sequence)."""
    out: Dict[int, Dict[str, List[CollectiveRecord]]] = {}
    for r in records:
        if (r.group_ranks and r.rank not in r.group_ranks) or r.op in P2P_OPS:
            continue
        out.setdefault(r.rank, {}).setdefault(r.group, []).append(r)
    for groups in out.values():
        for recs in groups.values():
            recs.sort(key=lambda r: r.seq)
    return out


def member_records(records: Iterable[CollectiveRecord]) -> List[CollectiveRecord]:
    """The records a group's members really took part in (see :func:`by_rank`)."""
    return [r for r in records if not (r.group_ranks and r.rank not in r.group_ranks)]


def _site(rec: CollectiveRecord) -> str:
    site = rec.call_site or ""
    parts = site.rsplit(":", 2)
    if len(parts) == 3:
        path, line, fn = parts
        return f"{os.path.basename(path)}:{line} {fn}"
    return os.path.basename(site)


class _Gap(str):
    """A hole the alignment opened in one column: the call the other side has here, this one lacks."""


def _cell(rec, exists: bool) -> str:
    if isinstance(rec, _Gap):
        return str(rec)
    if rec is None:
        return "(nothing)" if exists else ""
    text = f"{rec.describe()}   {_site(rec)}"
    if rec.state == "issued":
        text += "  [never completed]"
    elif rec.state == "failed":
        text += "  [failed]"
    return text


def _key(recs: Sequence) -> Tuple:
    return tuple(None if isinstance(r, _Gap) else (r.signature(), r.peer) for r in recs)


def side_by_side(
    ranks: Dict[int, Dict[str, List[CollectiveRecord]]],
    group: str,
    diverging: Sequence[int],
    index: Optional[int] = None,
    group_ranks: Sequence[int] = (),
    kind: Optional[str] = None,
) -> str:
    """The rows around position ``index`` of ``group``'s sequence, agreeing ranks left.

    ``kind`` (the divergence's) aligns the columns: a ``missing`` call opens a hole in the diverging
    columns, an ``extra`` one in the agreeing columns, so the calls after it line up again.
    """
    members = sorted(group_ranks) if group_ranks else sorted(r for r, g in ranks.items() if group in g)
    members = sorted(set(members) | {r for r in diverging if r in ranks or r in members})
    seqs = {r: ranks.get(r, {}).get(group, []) for r in members}
    # Columns: distinct sequences, the agreeing side first, then each diverging variant.
    columns: List[Tuple[List[int], List[CollectiveRecord]]] = []
    seen: Dict[Tuple, int] = {}
    ordered = [r for r in members if r not in diverging] + [r for r in members if r in diverging]
    for r in ordered:
        k = (r in diverging, _key(seqs[r]))
        if k in seen:
            columns[seen[k]][0].append(r)
            continue
        seen[k] = len(columns)
        columns.append(([r], seqs[r]))
    hidden = columns[MAX_COLUMNS:]
    columns = columns[:MAX_COLUMNS]
    if index is not None and kind in ("missing", "extra"):
        aligned = []
        for rs, seq in columns:
            lacking = (rs[0] in diverging) == (kind == "missing")
            if lacking and index < len(seq):
                gap = _Gap("(skipped)" if kind == "missing" else "(nothing)")
                seq = list(seq[:index]) + [gap] + list(seq[index:])
            aligned.append((rs, seq))
        columns = aligned
    if index is None:
        index = _first_difference([c[1] for c in columns])
    longest = max((len(c[1]) for c in columns), default=0)
    lo = max(0, index - CONTEXT)
    hi = min(max(longest, index + 1), index + CONTEXT + 1)
    width = [max(CELL, *(len(_cell(c[1][i] if i < len(c[1]) else None, True)) for i in range(lo, hi)))
             if hi > lo else CELL for c in columns]
    width[-1] = 0  # the last column needs no padding

    def label(rs: List[int]) -> str:
        return f"rank {rs[0]}" if len(rs) == 1 else f"rank {rs[0]} (as ranks {compress_ranks(rs)})"

    lines = ["       " + " | ".join(label(rs).ljust(w) for (rs, _), w in zip(columns, width)).rstrip()]
    if lo > 0:
        lines.append(f"       ... {lo} matching call{'s' if lo != 1 else ''} before")
    for i in range(lo, hi):
        cells = [c[1][i] if i < len(c[1]) else None for c in columns]
        ref = _key(cells[:1]) if cells[0] is not None else None
        marks = [" | "]
        for cell in cells[1:]:
            same = cell is not None and ref is not None and not isinstance(cell, _Gap) and _key([cell]) == ref
            marks.append(" | " if same else " ! ")
        row = ""
        for j, (cell, w) in enumerate(zip(cells, width)):
            sep = marks[j] if j else ""
            row += sep + _cell(cell, i < longest or cell is not None).ljust(w)
        pointer = ">" if i == index else " "
        lines.append(f"{pointer} #{i:<3} {row.rstrip()}")
    if longest > hi:
        lines.append(f"       ... {longest - hi} more call{'s' if longest - hi != 1 else ''} after")
    if hidden:
        more = sorted(r for rs, _ in hidden for r in rs)
        lines.append(f"       (and {len(hidden)} more variant{'s' if len(hidden) != 1 else ''}: {describe_ranks(more)})")
    return "\n".join(lines)


def _first_difference(columns: List[List[CollectiveRecord]]) -> int:
    i = 0
    while True:
        cells = [c[i] if i < len(c) else None for c in columns]
        if all(x is None for x in cells):
            return max(0, i - 1)
        if any(x is None for x in cells) or len({_key([x]) for x in cells}) > 1:  # type: ignore[list-item]
            return i
        i += 1


def format_divergences(records: Iterable[CollectiveRecord], divergences: Sequence, world_size: Optional[int] = None) -> str:
    """The failure text for ``divergences`` (from ``hangdoc.analysis.sequence.divergences``):
    the first divergence of each process group, side by side."""
    from hangdoc.testing.order import _renumber

    recs = _renumber(list(records))
    ranks = by_rank(recs)
    first: Dict[str, object] = {}
    for d in divergences:
        first.setdefault(getattr(d, "group", "default_pg"), d)
    blocks: List[str] = []
    for group, d in first.items():
        diverging = sorted(set(getattr(d, "ranks", ()) or ()))
        sample = getattr(d, "expected", None) or getattr(d, "actual", None)
        group_ranks = tuple(sample.group_ranks) if sample is not None and sample.group_ranks else ()
        if not group_ranks:
            group_ranks = tuple(sorted({r.rank for r in recs if r.group == group} | set(diverging)))
        who = f"ranks {compress_ranks(group_ranks)}" if group_ranks else ""
        summary = getattr(d, "summary", "") or f"{getattr(d, 'kind', 'divergence')} at call #{getattr(d, 'index', '?')}"
        head = f"process group {group}" + (f" ({who})" if who else "") + f": {summary}"
        index = getattr(d, "index", None)
        blocks.append(head + "\n" + side_by_side(ranks, group, diverging, index, group_ranks, getattr(d, "kind", None)))
    n = len(first)
    title = "collective order diverged" + (f" in {n} process groups" if n > 1 else "")
    return title + "\n\n" + "\n\n".join(blocks)
