"""Collective-order checks that run every rank in this process, one after another.

With torch's ``fake`` process group a collective completes at once without talking to anyone, so
the ranks of a job can run sequentially in one process: each rank initialises the group, runs the
function under the collective recorder, and tears the group down. Comparing what the ranks issued
then finds order bugs at world size 64 in milliseconds, cheap enough for ``hypothesis``.

What a fake group cannot do: move data. A received tensor keeps whatever it held, so code whose
control flow depends on *received* values (a broadcast batch size, say) sees the local value; and
object collectives (``broadcast_object_list`` & co) may fail. Run those on ``gloo`` through
``@pytest.mark.world_size(n)``.

    >>> import torch, torch.distributed as dist
    >>> def step(rank, world_size):
    ...     dist.all_reduce(torch.ones(4))
    ...     if rank != 1:   # the bug: rank 1 skips the broadcast
    ...         dist.broadcast(torch.ones(8), src=0)
    >>> check_collective_order(step, world_size=4)  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    hangdoc.testing.order.CollectiveOrderError: collective order diverged (world size 4, fake backend)
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from hangdoc.model import CollectiveRecord


class CollectiveOrderError(AssertionError):
    """Ranks issued different collectives: the message is the side-by-side diff.

    ``trace`` holds every rank's records, ``divergences`` the analysis's findings.
    """

    def __init__(self, message: str, trace: "CollectiveTrace", divergences: Sequence[Any]):
        super().__init__(message)
        self.trace = trace
        self.divergences = list(divergences)


class CollectiveTrace:
    """What each rank of one run issued, as :class:`~hangdoc.model.CollectiveRecord` lists.

        >>> from hangdoc.model import CollectiveRecord as R
        >>> t = CollectiveTrace({0: [R(0, 0, "all_reduce")], 1: [R(1, 0, "all_reduce")]}, 2)
        >>> t.ops(1)
        ['all_reduce']
    """

    def __init__(self, by_rank: Mapping[int, Sequence[CollectiveRecord]], world_size: int,
                 errors: Optional[Mapping[int, BaseException]] = None):
        self.by_rank: Dict[int, List[CollectiveRecord]] = {r: list(v) for r, v in by_rank.items()}
        self.world_size = world_size
        #: rank -> the exception that rank's function raised (fake backend runs only).
        self.errors: Dict[int, BaseException] = dict(errors or {})

    def records(self, rank: Optional[int] = None, group: Optional[str] = None) -> List[CollectiveRecord]:
        """All records (rank order), or one rank's; optionally only one process group's."""
        ranks = sorted(self.by_rank) if rank is None else [rank]
        return [r for k in ranks for r in self.by_rank.get(k, []) if group is None or r.group == group]

    def ops(self, rank: int, group: Optional[str] = None) -> List[str]:
        """The op names ``rank`` issued, in order."""
        return [r.op for r in self.records(rank, group)]

    def calls(self, rank: int, group: Optional[str] = None) -> List[str]:
        """``describe()`` of each call of ``rank``: ``['all_reduce([4] float32)', ...]``."""
        return [r.describe() for r in self.records(rank, group)]

    def divergences(self) -> List[Any]:
        """The analysis's divergences between the ranks' collectives (empty when they agree)."""
        return find_divergences(self.records(), sorted(self.by_rank))

    def schedule_problems(self) -> List[Any]:
        """Point-to-point problems: deadlocks under blocking semantics, unmatched or mismatched messages."""
        from hangdoc.testing.schedule import replay

        return replay(self.by_rank)

    def problems(self) -> Tuple[List[Any], List[Any]]:
        """(divergences, schedule problems); the replay runs only when the collectives agree."""
        found = self.divergences()
        return found, ([] if found else self.schedule_problems())


class RankTrace:
    """The ``collective_trace`` fixture: this rank's calls so far, read from the live recorder.

    ``collective_trace.ops()`` -> ``['all_reduce', 'broadcast']``; ``records()`` and ``calls()``
    as in :class:`CollectiveTrace`, for the rank running the test.
    """

    def _live(self) -> List[CollectiveRecord]:
        from hangdoc.runtime import recorder

        rec = recorder.get()
        return rec.records()[_RANK_START[0]:] if rec is not None else []

    def records(self, group: Optional[str] = None) -> List[CollectiveRecord]:
        return [r for r in self._live() if group is None or r.group == group]

    def ops(self, group: Optional[str] = None) -> List[str]:
        return [r.op for r in self.records(group)]

    def calls(self, group: Optional[str] = None) -> List[str]:
        return [r.describe() for r in self.records(group)]


#: in an in-process run, where the running rank's records start in the shared recorder.
_RANK_START = [0]


def find_divergences(records: Sequence[CollectiveRecord], ranks: Sequence[int] = ()) -> List[Any]:
    """``hangdoc.analysis.sequence.divergences`` over the calls each rank really took part in.

    ``ranks`` names the ranks known to have run to their end: one of them that issued nothing at
    all in a group where the others did is a divergence too (the alignment only sees ranks that
    left records).
    """
    from hangdoc.analysis.sequence import Divergence, divergences
    from hangdoc.testing.diff import member_records

    recs = _renumber(member_records(records))
    found = list(divergences(recs))
    groups: Dict[str, Dict[int, List[CollectiveRecord]]] = {}
    for r in recs:
        if r.op in _P2P:
            continue
        groups.setdefault(r.group, {}).setdefault(r.rank, []).append(r)
    for name, per_rank in groups.items():
        sample = next(iter(per_rank.values()))[0]
        members = set(sample.group_ranks) if sample.group_ranks else set(ranks)
        silent = sorted(m for m in members if m in set(ranks) and m not in per_rank)
        if not silent:
            continue
        first = min(per_rank.items())[1]
        first.sort(key=lambda r: r.seq)
        exp = first[0]
        others = sorted(per_rank)
        from hangdoc.ranges import describe_ranks
        from hangdoc.testing.schedule import _site

        summary = (f"{describe_ranks(silent)} issued nothing in group {name}, where {describe_ranks(others)} issued "
                   f"{len(first)} call{'s' if len(first) != 1 else ''}, the first {exp.describe()} at {_site(exp)}")
        found.append(Divergence(name, "missing", silent, exp, None, 0, summary, others))
    found.sort(key=lambda d: (d.group != "default_pg", d.group, d.index))
    return found


_P2P = frozenset({"send", "recv", "isend", "irecv", "send_object_list", "recv_object_list"})


def _renumber(records: Sequence[CollectiveRecord]) -> List[CollectiveRecord]:
    """Collectives numbered 0, 1, 2... per rank and group, point-to-point calls left out of the count.

    The recorder's ``seq`` counts every call of a group, sends and receives included, so the n-th
    collective carries a different seq on a pipeline stage that sends twice as often; the alignment
    would read that as a ring buffer that lost records. A test's buffer never wraps.
    """
    out: List[CollectiveRecord] = []
    count: Dict[Tuple[int, str], int] = {}
    for r in sorted(records, key=lambda r: (r.rank, r.group, r.seq)):
        if r.op in _P2P:
            out.append(r)
            continue
        k = count.get((r.rank, r.group), 0)
        count[(r.rank, r.group)] = k + 1
        out.append(r if r.seq == k else dataclasses.replace(r, seq=k))
    return out


def run_in_process(call: Callable[[int], Any], world_size: int,
                   deadline: Optional[Any] = None) -> Tuple[Dict[int, List[CollectiveRecord]], Dict[int, BaseException]]:
    """Run ``call(rank)`` for each rank in turn on a fake process group, recording collectives.

    An exception on one rank does not stop the others (their records may show why it failed).
    ``deadline`` (a :class:`hangdoc.testing.deadline.RankDeadline`, entered) bounds each rank's
    run: the rank that outlives it is interrupted, keeps the records it made, and the ranks after
    it do not run (``deadline.hung`` says which rank and where it was).
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hangdoc.runtime import recorder
    from hangdoc.testing.deadline import RankTimeout

    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group is already initialised in this process; "
                           "the fake backend runs ranks in-process and needs it uninitialised")
    if recorder.get() is not None:
        raise RuntimeError("the hangdoc recorder is already enabled in this process; "
                           "disable it before running ranks in-process")
    records: Dict[int, List[CollectiveRecord]] = {}
    errors: Dict[int, BaseException] = {}
    # A recorder of its own for each rank (enabling costs milliseconds): each rank may issue up to
    # the recorder's capacity, not all ranks together.
    try:
        for rank in range(world_size):
            rec = recorder.enable()
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
            _RANK_START[0] = 0
            try:
                with (deadline.rank(rank) if deadline is not None else contextlib.nullcontext()):
                    call(rank)
            except RankTimeout:
                pass  # deadline.hung has the rest
            except Exception as e:
                errors[rank] = e
            finally:
                snapshot = rec.records() if rec is not None else []
                capacity = rec.capacity if rec is not None else 0
                if dist.is_initialized():
                    dist.destroy_process_group()
                recorder.disable()
                hung = deadline is not None and deadline.hung is not None
                wrapped = rec is not None and len(snapshot) >= capacity
                if hung and wrapped:
                    # a loop of calls until the deadline: what it issued first is gone; keep the last
                    deadline.hung.records_wrapped = len(snapshot)
                    snapshot = snapshot[-1000:]
                elif wrapped:
                    raise RuntimeError(f"rank {rank} issued more collective calls than the recorder holds "
                                       f"({capacity:,}); check fewer steps at a time")
                # The recorder names the rank it was in when asked; pin it to the rank that ran.
                records[rank] = [r if r.rank == rank else dataclasses.replace(r, rank=rank) for r in snapshot]
            if deadline is not None and deadline.hung is not None:
                break
    finally:
        _RANK_START[0] = 0
        recorder.disable()
    return records, errors


def _call_with_rank(fn: Callable, rank: int, world_size: int, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    """``fn(*args, **kwargs)`` with ``rank``/``world_size`` filled in by name wherever they sit."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return fn(*args, **kwargs)
    given = {"rank": rank, "world_size": world_size}
    call_kwargs: Dict[str, Any] = {k: v for k, v in given.items() if any(p.name == k for p in params)}
    named = [p for p in params if p.name not in given and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
             and p.kind != p.KEYWORD_ONLY]
    if any(p.kind == p.POSITIONAL_ONLY for p in params) or len(args) > len(named):
        return fn(*args, **{**kwargs, **call_kwargs})
    call_kwargs.update({p.name: a for p, a in zip(named, args)})
    return fn(**{**kwargs, **call_kwargs})


def verdict_message(trace: CollectiveTrace, divergences: Sequence[Any], backend: str,
                    problems: Sequence[Any] = ()) -> str:
    from hangdoc.testing.diff import format_divergences
    from hangdoc.testing.schedule import format_problems

    head = f"(world size {trace.world_size}, {backend} backend)"
    parts = []
    if divergences:
        text = format_divergences(trace.records(), divergences, trace.world_size)
        lines = text.split("\n", 1)
        parts.append(lines[0] + " " + head + ("\n" + lines[1] if len(lines) > 1 else ""))
    if problems:
        parts.append(f"point-to-point schedule is wrong {head}\n\n" + format_problems(trace.by_rank, problems))
    text = "\n\n".join(parts)
    if trace.errors:
        text += "\n\nranks that raised:\n" + "\n".join(
            f"  rank {r}: {type(e).__name__}: {e}" for r, e in sorted(trace.errors.items()))
    return text


def check_collective_order(
    fn: Callable,
    world_size: int,
    backend: str = "fake",
    args: Sequence[Any] = (),
    kwargs: Optional[Mapping[str, Any]] = None,
) -> CollectiveTrace:
    """Run ``fn`` as each of ``world_size`` ranks and check that they issue the same collectives.

    ``fn`` is called as ``fn(*args, **kwargs)`` with ``rank=`` and ``world_size=`` added when its
    signature has such parameters, inside an initialised process group. Returns the
    :class:`CollectiveTrace` when every rank issued the same collectives in the same order with
    matching signatures (op, shapes, dtypes, root) per process group; otherwise raises
    :class:`CollectiveOrderError` (an ``AssertionError``, so it works inside
    ``@hypothesis.given``) with a side-by-side diff. When the ranks agree but one raised, that
    exception propagates; they agree too when the raising ranks only issued fewer calls than the
    others (a prefix of theirs: they stopped where they raised). When they disagree beyond that,
    the :class:`CollectiveOrderError` is raised *from* the exception, which Python and pytest
    show first.

        >>> import torch, torch.distributed as dist
        >>> def step(rank, batch):
        ...     dist.all_reduce(torch.tensor([len(batch)]))
        >>> check_collective_order(step, 4, args=([1, 2],)).ops(3)
        ['all_reduce']
    """
    if backend != "fake":
        raise ValueError(f"check_collective_order runs ranks in-process and supports backend='fake' only, "
                         f"not {backend!r}; use @pytest.mark.world_size(n, backend={backend!r}) for real processes")
    if world_size < 1:
        raise ValueError("world_size must be at least 1")
    kw = dict(kwargs or {})
    records, errors = run_in_process(lambda r: _call_with_rank(fn, r, world_size, args, kw), world_size)
    trace = CollectiveTrace(records, world_size, errors)
    found, problems = trace.problems()
    if (found or problems) and errors:
        from hangdoc.testing.verdict import collective_order

        if not collective_order(records, world_size, backend, set(errors)).relevant:
            found, problems = [], []  # the raising ranks stopped early: the exception is the story
    if found or problems:
        error = CollectiveOrderError(verdict_message(trace, found, backend, problems), trace, found + problems)
        if errors:
            raise error from min(errors.items())[1]
        raise error
    if errors:
        rank, err = min(errors.items())
        _note(err, f"raised on rank {rank} of {world_size} (fake backend, ranks run one after another in one process)")
        raise err
    return trace


def _note(err: BaseException, text: str) -> None:
    add = getattr(err, "add_note", None)  # Python 3.11+
    if add is not None:
        add(text)
