"""Ranks waiting in a collective beside ranks waiting in a send or receive whose peers are unknown.

A collective completes only when every member is in it. When some ranks wait in one and the others
in a send or a receive, those others are not in it, and they wait for somebody too: a wait cycle
through a collective and a point-to-point call. A pipeline stage that skipped its collective went on
to its next receive (``examples/bugs/pp_skip_pair.py``, ``tp_pp_skip.py``); a stage that skipped a
send left its peer in a receive while it went on to the collective. One stack snapshot cannot say
which, so the ranks in the send or receive are named as candidates, never as culprits, and the
finding (a ``collective-mismatch``: ranks that are not in the collective the others wait in) ranks
above the plain ``p2p-stall`` ("waits with unknown peers") that says nothing of the collective.
With peers known (``--locals``) the wait-for graph of :mod:`hangdoc.analysis.p2p_stacks` decides
instead. A mixin of :class:`hangdoc.analysis.stack_rules._Analysis`, which provides ``in_category``,
``places``, ``w``, ``who_b``, ``evidence_lines`` and ``out``.
"""

from __future__ import annotations

from hangdoc.analysis.stack_words import _LOCALS_ADVICE, _RECORDS_ADVICE, _culprits, _procs, _s
from hangdoc.model import Finding

#: above p2p-stall with unknown peers (0.4-0.5), below the verdicts that name a culprit
CONFIDENCE = 0.55


class MixedRules:
    """The collective-beside-send/recv rule of the stack analysis (see the module)."""

    def mixed(self) -> None:
        coll = self.in_category(["collective"])
        p2p = self.in_category(["p2p"])
        if not coll or not p2p:
            return
        if any(self.w(p).peer is not None for p in _procs(p2p)):
            return  # peers known: the send/recv wait-for graph follows them
        inside, outside = _procs(coll), _procs(p2p)

        def what(buckets, many: str) -> str:
            places = self.places(buckets)
            return places[0][0].describe() if len(places) == 1 else many

        summary = (f"{self.who_b(coll)} {_s(inside, 'waits', 'wait')} in {what(coll, 'collectives')} while "
                   f"{self.who_b(p2p)} {_s(outside, 'waits', 'wait')} in {what(p2p, 'sends or receives')}, not in "
                   f"{'it' if len(self.places(coll)) == 1 else 'them'}: either {self.who_b(p2p)} skipped the "
                   f"collective and went on to {_s(outside, 'its', 'their')} send/recv, or {self.who_b(coll)} skipped "
                   f"a send or receive that {self.who_b(p2p)} {_s(outside, 'waits', 'wait')} for (the stacks cannot "
                   "say which)")
        evidence = self.evidence_lines(coll + p2p) + [
            "a collective completes only once every member is in it; a rank in a send or receive waits for a peer "
            "in turn: the ranks wait on each other through both"]
        advice = [_RECORDS_ADVICE, _LOCALS_ADVICE + " With peers known, hangdoc follows who waits for whom."]
        self.out.append(Finding("collective-mismatch", summary, [], evidence, advice, CONFIDENCE,
                                candidates=_culprits(outside)))
