"""Send/recv waits in stacks: cycles when peers are known (``--locals``), chains that end at a rank
doing something else, and, with peers unknown, the call site no other stage shares or every rank
receiving while none sends. A mixin of :class:`hangdoc.analysis.stack_rules._Analysis`, which
provides ``w``, ``by_rank``, ``missing``, ``rank_b``, ``ok_b``, ``report``, ``evidence_procs`` and
``out``."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from hangdoc.analysis.signatures import Wait
from hangdoc.analysis.stack_words import _LOCALS_ADVICE, _RECORDS_ADVICE, _culprits, _procs, _s, who
from hangdoc.model import STATUS_OK, Culprit, Finding, Process

#: blocking receives (an ``irecv`` returns at once; its ``wait`` is not told apart from a send's)
_RECV_OPS = ("recv", "recv_object_list")


class P2PRules:
    """The send/recv rules of the stack analysis (see the module)."""

    def p2p(self) -> None:
        p2p = _procs(self.in_category(["p2p"]))
        if not p2p:
            return
        known = {p.rank: p for p in p2p if p.rank is not None and self.w(p).peer is not None and not self.w(p).peer_is_group_rank}
        if known:
            self._p2p_graph(known)
        unknown = [p for p in p2p if p.rank not in known or p.rank is None]
        if unknown:
            self._p2p_unknown(unknown)

    def _satisfied(self, p: Process, w: Wait) -> bool:
        q = self.by_rank.get(w.peer)
        if q is None or q.status != STATUS_OK:
            return False
        v = self.w(q)
        if v.category != "p2p" or v.peer is None or v.peer_is_group_rank:
            return False
        recv = w.op in ("recv", "irecv", "recv_object_list")
        other_recv = v.op in ("recv", "irecv", "recv_object_list")
        return v.peer == p.rank and recv != other_recv

    def _p2p_graph(self, known: Dict[int, Process]) -> None:
        edges = {r: self.w(p).peer for r, p in known.items() if not self._satisfied(p, self.w(p))}
        arrow = lambda r: f"rank {r} {self.w(known[r]).op}{'←' if self.w(known[r]).op.startswith('recv') or self.w(known[r]).op.startswith('irecv') else '→'}{edges[r]}"
        in_cycle: set = set()
        for start in sorted(edges):
            path: List[int] = []
            seen: Dict[int, int] = {}
            r: Optional[int] = start
            while r is not None and r in edges and r not in seen:
                seen[r] = len(path)
                path.append(r)
                r = edges[r]
            if r is not None and r in seen:
                cycle = path[seen[r]:]
                if not in_cycle.intersection(cycle):
                    in_cycle.update(cycle)
                    procs = [known[x] for x in cycle]
                    order = cycle[cycle.index(min(cycle)):] + cycle[:cycle.index(min(cycle))]
                    self.out.append(Finding(
                        "p2p-cycle",
                        f"point-to-point cycle: {', '.join(arrow(x) for x in order)}",
                        _culprits(procs),
                        self.evidence_procs(procs),
                        ["Each of these ranks waits for a send/recv of the next one, which waits in turn: reorder "
                         "the sends and recvs so one side sends first (or use `batch_isend_irecv` for both directions at once).",
                         "In pipeline schedules, check that stage k's recv order matches stage k±1's send order."],
                        0.8,
                    ))
        # Chains that end outside p2p: the rank at the end is what the chain waits for.
        ends: Dict[int, List[int]] = {}
        for start in sorted(edges):
            r: Optional[int] = start
            seen_chain = set()
            while r is not None and r in edges and r not in seen_chain and r not in in_cycle:
                seen_chain.add(r)
                r = edges[r]
            if r is None or r in in_cycle or r in edges:
                continue
            ends.setdefault(r, []).append(start)
        for end, starts in sorted(ends.items()):
            q = self.by_rank.get(end)
            waiting = [known[s] for s in starts]
            if q is None:
                what = "left no dump" if end in self.missing else "is not in the dumps"
                culprits = [Culprit(rank=end)]
            elif q.status != STATUS_OK:
                what = f"is {q.status}"
                culprits = [q.culprit()]
            else:
                what = f"is at {self.w(q).describe()}"
                culprits = [q.culprit()]
            self.out.append(Finding(
                "p2p-stall",
                f"{who(waiting)} {'waits' if len(waiting) == 1 else 'wait'} on rank {end}, which {what}",
                culprits,
                self.evidence_procs(waiting + ([q] if q is not None and q.status == STATUS_OK else [])),
                [f"Find out why rank {end} does not reach the matching send/recv: the path it took instead is its stack above.",
                 _RECORDS_ADVICE],
                0.6,
            ))

    def _all_receive(self, procs: List[Process]) -> bool:
        """Every rank process dumped (none missing, none in another state) blocks in a recv."""
        return (len(procs) >= 2 and not self.missing and all(b.ok for b in self.rank_b)
                and len(procs) == len(_procs(self.ok_b)) and all(self.w(p).op in _RECV_OPS for p in procs))

    def _receive_deadlock(self, procs: List[Process]) -> None:
        """Nobody sends: a recv completes only when its peer sends, and every peer receives. The
        wait-for graph of such ranks closes in a cycle whatever the peers are (a ring that receives
        before it sends, two ranks receiving from each other)."""
        ws = self.report.job.world_size
        whole = ws is not None and ws == len(procs)
        summary = (f"{who(procs)} all wait in recv and none sends: a receive deadlock, no recv can complete"
                   + ("" if whole else " (unless a process that was not dumped sends to them)"))
        evidence = self.evidence_procs(procs) + [
            ("every rank of the job" if whole else "every process dumped") + " is in a blocking recv; a recv "
            "completes only when its peer sends, and each peer is receiving itself"]
        advice = ["Let one side send first: reorder so that (for a ring) even ranks send then receive and odd ranks "
                  "receive then send, or post both directions at once with `batch_isend_irecv` / `isend` + `irecv`.",
                  _LOCALS_ADVICE + " With peers known, hangdoc draws the cycle itself."]
        self.out.append(Finding("p2p-cycle", summary, _culprits(procs), evidence, advice, 0.75 if whole else 0.6))

    def _p2p_unknown(self, procs: List[Process]) -> None:
        # Key: the whole user part of the stack, so ranks of one stage (same code path) share it.
        groups: Dict[Tuple, List[Process]] = {}
        for p in procs:
            groups.setdefault(self._user_path(p), []).append(p)
        sizes = sorted(len(g) for g in groups.values())
        odd: List[Process] = []
        # Without a single Python frame of user code (gdb without Python support) there are no call sites to compare.
        sited = all(len(key) > 2 for key in groups)
        if sited and len(groups) > 1 and sizes[-1] >= 2:
            odd = [p for g in groups.values() if len(g) < sizes[-1] for p in g]
        if not odd and self._all_receive(procs):
            # (with a rank at a call site of its own, that rank is what the stall below names)
            self._receive_deadlock(procs)
            return
        evidence = self.evidence_procs(procs)
        blamed: List[Process] = []
        if odd:
            # a rank in the majority's own operation at another call site stands out; one in the other
            # operation (it sends, they receive) is named a candidate, never blamed: a pipeline's first
            # and last stages are on code paths of their own by design
            major = max(groups.values(), key=len)
            op = self._user_path(major[0])[:2]
            blamed = [p for p in odd if self._user_path(p)[:2] == op]
            summary = f"{who(procs)} {_s(procs, 'waits', 'wait')} in send/recv with unknown peers; {who(odd)} {'is' if len(odd) == 1 else 'are'} at call sites no other stage shares"
            if len(blamed) < len(odd):
                evidence.append(f"without peers the stacks cannot say who is wrong: {who([p for p in odd if p not in blamed])} "
                                "in another operation than the others, as a pipeline's first or last stage is by design")
            conf = 0.5
        else:
            summary = f"{who(procs)} {_s(procs, 'waits', 'wait')} in send/recv with unknown peers"
            evidence.append("the dumps show no Python frames, so there are no call sites to compare" if not sited else
                            "all of them are at one call site" if len(groups) == 1 else
                            "each of them is on a code path of its own, so no call site stands out")
            conf = 0.4
        self.out.append(Finding("p2p-stall", summary, _culprits(blamed), evidence,
                                [_LOCALS_ADVICE + " With peers known, hangdoc shows the wait-for cycle.", _RECORDS_ADVICE], conf,
                                candidates=_culprits([p for p in odd if p not in blamed])))

    def _user_path(self, p: Process) -> Tuple:
        from hangdoc.analysis.signatures import is_library

        t = p.main_thread
        frames = t.frames if t is not None else ()
        return (self.w(p).category, self.w(p).op) + tuple(
            (f.function, f.file, f.line) for f in frames if not f.native and not is_library(f))
