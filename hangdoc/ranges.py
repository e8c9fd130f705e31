"""Compressed rank and host lists: ``0-127,129-383`` and ``iam[01-34,36-48]``.

Used by every renderer and in finding summaries, so that 384 ranks read as one short line.

    >>> compress_ranks([0, 1, 2, 3, 5, 7, 8])
    '0-3,5,7-8'
    >>> expand_ranks('0-3,5')
    [0, 1, 2, 3, 5]
    >>> compress_hosts(['iam01', 'iam02', 'iam03', 'iam05', 'login'])
    'iam[01-03,05],login'
"""

from __future__ import annotations

import re
from typing import Dict, Iterable, List, Optional, Tuple


def compress_ranks(ranks: Iterable[int]) -> str:
    """Sorted, de-duplicated, consecutive runs joined with ``-``; empty input gives ``''``."""
    values = sorted(set(ranks))
    if not values:
        return ""
    out: List[str] = []
    start = prev = values[0]
    for v in values[1:]:
        if v == prev + 1:
            prev = v
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = v
    out.append(str(start) if start == prev else f"{start}-{prev}")
    return ",".join(out)


def expand_ranks(text: str) -> List[int]:
    """The inverse of :func:`compress_ranks`; raises ValueError on malformed text."""
    result: List[int] = []
    text = text.strip()
    if not text:
        return result
    for part in text.split(","):
        part = part.strip()
        if "-" in part:
            a, b = part.split("-", 1)
            lo, hi = int(a), int(b)
            if hi < lo:
                raise ValueError(f"bad range {part!r}")
            result.extend(range(lo, hi + 1))
        else:
            result.append(int(part))
    return sorted(set(result))


_HOST_RE = re.compile(r"^(.*?)(\d+)$")


def compress_hosts(hosts: Iterable[str]) -> str:
    """SLURM-style hostlist: hosts sharing a prefix (and zero padding) fold into ``prefix[a-b,c]``.

        >>> compress_hosts(["n8", "n9", "n10", "n11", "n13"])
        'n[8-11,13]'
        >>> compress_hosts(["gpu008", "gpu009", "gpu010", "gpu1000", "login"])
        'gpu1000,gpu[008-010],login'
    """
    # Zero-padded numbers (n08) keep their width; unpadded ones (n8, n10) fold together, as SLURM's
    # hostlist does; an unpadded number as wide as a padded one of the same prefix joins it (n09,n10).
    buckets: Dict[Tuple[str, int], List[int]] = {}
    plain: List[str] = []
    numbered: List[Tuple[str, str]] = []
    padded: Dict[str, set] = {}
    for h in sorted(set(hosts)):
        m = _HOST_RE.match(h)
        if not m:
            plain.append(h)
            continue
        prefix, digits = m.group(1), m.group(2)
        numbered.append((prefix, digits))
        if len(digits) > 1 and digits[0] == "0":
            padded.setdefault(prefix, set()).add(len(digits))
    for prefix, digits in numbered:
        width = len(digits) if len(digits) in padded.get(prefix, ()) else 0
        buckets.setdefault((prefix, width), []).append(int(digits))
    parts: List[str] = []
    for (prefix, width), nums in sorted(buckets.items()):
        if len(nums) == 1:
            parts.append(f"{prefix}{nums[0]:0{width}d}")
            continue
        runs: List[str] = []
        nums.sort()
        start = prev = nums[0]
        for v in nums[1:] + [None]:  # type: ignore[list-item]
            if v is not None and v == prev + 1:
                prev = v
                continue
            runs.append(f"{start:0{width}d}" if start == prev else f"{start:0{width}d}-{prev:0{width}d}")
            if v is not None:
                start = prev = v
        parts.append(f"{prefix}[{','.join(runs)}]")
    return ",".join(parts + plain)


#: runs of ranks a finding's text shows before "… and N more" (findings keep every culprit in ``culprits``).
MAX_RUNS = 10


def describe_ranks(ranks: Iterable[int], max_runs: Optional[int] = None) -> str:
    """``rank 3`` or ``ranks 0-2,4``; with ``max_runs``, at most that many runs and a count of the rest.

    >>> describe_ranks(range(0, 40, 2), max_runs=3)
    'ranks 0,2,4 … and 17 more'
    """
    values = sorted(set(ranks))
    if len(values) == 1:
        return f"rank {values[0]}"
    if max_runs is None:
        return f"ranks {compress_ranks(values)}"
    runs: List[Tuple[int, int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], v)
        else:
            runs.append((v, v))
    if len(runs) <= max_runs:
        return f"ranks {compress_ranks(values)}"
    shown = runs[:max_runs]
    more = len(values) - sum(b - a + 1 for a, b in shown)
    return "ranks " + ",".join(str(a) if a == b else f"{a}-{b}" for a, b in shown) + f" … and {more} more"


def describe_ranks_capped(ranks: Iterable[int]) -> str:
    """:func:`describe_ranks` cut after :data:`MAX_RUNS` runs: for the text of findings.

    >>> describe_ranks_capped(range(0, 100, 2))
    'ranks 0,2,4,6,8,10,12,14,16,18 … and 40 more'
    """
    return describe_ranks(ranks, MAX_RUNS)
