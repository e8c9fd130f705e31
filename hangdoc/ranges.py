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

from bisect import bisect_right
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

#: ranks listed one by one where a list of ranks must be enumerated (a finding's ``culprits``):
#: beyond this the compressed text (``ranks 1-1048575``) says it all.
MAX_LISTED = 10_000


class RankSet:
    """A set of ranks held as sorted runs ``[(lo, hi), ...]``: a million missing ranks are one run.

    Sizes, membership and text cost O(runs), never O(ranks): the ranks a world size implies are
    reasoned about without enumerating the world. It compares equal to the sorted list of its ranks.

        >>> s = RankSet.missing(world=1 << 20, present={0, 5})
        >>> s.runs, len(s), 3 in s, 5 in s
        ([(1, 4), (6, 1048575)], 1048574, True, False)
        >>> RankSet.missing(4, [0, 2]) == [1, 3], compress_ranks(s)
        (True, '1-4,6-1048575')
    """

    __slots__ = ("runs", "_len")

    def __init__(self, runs: Sequence[Tuple[int, int]] = ()) -> None:
        self.runs: List[Tuple[int, int]] = list(runs)
        self._len = sum(hi - lo + 1 for lo, hi in self.runs)

    @classmethod
    def of(cls, ranks: Iterable[int]) -> "RankSet":
        """The set of ``ranks`` (any iterable of ints, or a RankSet)."""
        if isinstance(ranks, RankSet):
            return ranks
        runs: List[Tuple[int, int]] = []
        for v in sorted(set(ranks)):
            if runs and v == runs[-1][1] + 1:
                runs[-1] = (runs[-1][0], v)
            else:
                runs.append((v, v))
        return cls(runs)

    @classmethod
    def missing(cls, world: int, present: Iterable[int]) -> "RankSet":
        """Ranks ``0..world-1`` not in ``present``: O(len(present) log len(present)), whatever ``world``."""
        runs: List[Tuple[int, int]] = []
        nxt = 0
        for v in sorted({r for r in present if isinstance(r, int) and 0 <= r < world}):
            if v > nxt:
                runs.append((nxt, v - 1))
            nxt = v + 1
        if world > nxt:
            runs.append((nxt, world - 1))
        return cls(runs)

    def minus(self, other: Iterable[int]) -> "RankSet":
        """This set without the ranks of ``other`` (O(runs of both))."""
        o = RankSet.of(other).runs
        out: List[Tuple[int, int]] = []
        j = 0
        for lo, hi in self.runs:
            while j < len(o) and o[j][1] < lo:
                j += 1
            k = j
            cur = lo
            while k < len(o) and o[k][0] <= hi:
                if o[k][0] > cur:
                    out.append((cur, o[k][0] - 1))
                cur = max(cur, o[k][1] + 1)
                k += 1
            if cur <= hi:
                out.append((cur, hi))
        return RankSet(out)

    def first(self, n: int) -> List[int]:
        """The ``n`` lowest ranks."""
        out: List[int] = []
        for lo, hi in self.runs:
            out.extend(range(lo, min(hi, lo + n - len(out) - 1) + 1))
            if len(out) >= n:
                break
        return out

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[int]:
        for lo, hi in self.runs:
            yield from range(lo, hi + 1)

    def __contains__(self, rank: object) -> bool:
        if not isinstance(rank, int):
            return False
        i = bisect_right(self.runs, (rank, float("inf"))) - 1
        return i >= 0 and self.runs[i][0] <= rank <= self.runs[i][1]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RankSet):
            return self.runs == other.runs
        if isinstance(other, (list, tuple)):
            return len(other) == self._len and self._len <= MAX_LISTED and list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return repr(list(self)) if self._len <= 64 else f"RankSet({compress_ranks(self)!r})"


def _runs(ranks: Iterable[int]) -> List[Tuple[int, int]]:
    return ranks.runs if isinstance(ranks, RankSet) else RankSet.of(ranks).runs


def _join_runs(runs: Iterable[Tuple[int, int]]) -> str:
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def compress_ranks(ranks: Iterable[int]) -> str:
    """Sorted, de-duplicated, consecutive runs joined with ``-``; empty input gives ``''``."""
    if isinstance(ranks, RankSet):
        return _join_runs(ranks.runs)
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
            if hi - lo >= 1 << 20:
                raise ValueError(f"range {part!r} holds more than {1 << 20} ranks")
            result.extend(range(lo, hi + 1))
        else:
            result.append(int(part))
    return sorted(set(result))


#: a host number wider than this is no number to fold (and too wide for a cheap int())
_MAX_HOST_DIGITS = 18


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
        # the trailing digits, found by one scan from the end (the regex ^(.*?)(\d+)$ was
        # quadratic: 25 s on a 60 KB name)
        prefix = h.rstrip("0123456789")
        digits = h[len(prefix):]
        if not digits or len(digits) > _MAX_HOST_DIGITS or not digits.isascii():
            plain.append(h)
            continue
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
    rs = RankSet.of(ranks)
    runs = rs.runs
    if len(rs) == 1:
        return f"rank {runs[0][0]}"
    if max_runs is None or len(runs) <= max_runs:
        return f"ranks {_join_runs(runs)}"
    shown = runs[:max_runs]
    more = len(rs) - sum(b - a + 1 for a, b in shown)
    return "ranks " + _join_runs(shown) + f" … and {more} more"


def describe_ranks_capped(ranks: Iterable[int]) -> str:
    """:func:`describe_ranks` cut after :data:`MAX_RUNS` runs: for the text of findings.

    >>> describe_ranks_capped(range(0, 100, 2))
    'ranks 0,2,4,6,8,10,12,14,16,18 … and 40 more'
    """
    return describe_ranks(ranks, MAX_RUNS)
