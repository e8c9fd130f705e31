"""Calls that several ranks issued in orders no execution can satisfy (pure; both sides use it).

Each rank runs the calls it queued on one GPU stream in the order it issued them, and a collective
(or a send with its receive) completes on all its ranks together. So when the ranks' orders, taken
together, put some calls in a cycle (rank 0: A before B; rank 1: B before A), none of them can ever
complete: each would have to complete before itself. A call is any hashable key that names the
same call on every rank that takes part in it (a group and the call's number there; a pair's
direction and the message's number). :mod:`hangdoc.runtime.detect_queue` reads the lists ranks
publish while the job runs, :mod:`hangdoc.analysis.stream_order` the collective records after it.

    >>> cycle({0: ["A", "B"], 1: ["B", "A"]}, ["A", "B"])
    [('A', 0), ('B', 1)]
    >>> cycle({0: ["A", "B", "C"], 1: ["A", "C"], 2: ["B", "C"]}, ["A"]) is None
    True
    >>> inversion(["A", "B", "C"], ["C", "B"])
    ('B', 'C')
"""

from __future__ import annotations

from typing import Dict, Hashable, List, Optional, Sequence, Tuple

#: how both sides name a send/receive call: ``p2p:SRC>DST`` with the message's number as the index
P2P_PREFIX = "p2p:"


def p2p_key(src: int, dst: int) -> str:
    """The name of the pair's calls from ``src`` to ``dst`` (its k-th send, the peer's k-th receive)."""
    return f"{P2P_PREFIX}{src}>{dst}"


def is_p2p(name: object) -> bool:
    return str(name).startswith(P2P_PREFIX)


def call_name(call: Tuple[str, int]) -> str:
    """``group 1, #3`` for a collective, ``message #4 0>1`` for a send/receive.

    >>> call_name(("1", 3)), call_name((p2p_key(0, 1), 4))
    ('group 1, #3', 'message #4 0>1')
    """
    name, n = call
    if is_p2p(name):
        return f"message #{n} {str(name)[len(P2P_PREFIX):]}"
    return f"group {name}, #{n}"


def _components(edges: Dict[Hashable, List[Tuple[Hashable, int]]]) -> Dict[Hashable, int]:
    """Each call's strongly connected component (Tarjan's, iterative): O(calls + edges)."""
    index: Dict[Hashable, int] = {}
    low: Dict[Hashable, int] = {}
    comp: Dict[Hashable, int] = {}
    stack: List[Hashable] = []
    on_stack = set()
    counter = 0
    for root in list(edges):
        if root in index:
            continue
        work = [(root, iter(edges.get(root, ())))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            step = next(it, None)
            if step is not None:
                nxt = step[0]
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(edges.get(nxt, ()))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                while True:
                    x = stack.pop()
                    on_stack.discard(x)
                    comp[x] = index[node]
                    if x == node:
                        break
    return comp


def cycle(lists: Dict[int, Sequence[Hashable]], start: Sequence[Hashable]) -> Optional[List[Tuple[Hashable, int]]]:
    """A cycle through the ranks' orders, as [(call, the rank whose list leads from it to the next
    call of the cycle)], through the earliest of ``start`` on one (the first calls that can never
    complete; later cycles are their consequence); None if none. The calls on cycles are found first
    (strongly connected components), then one search inside the component of the earliest start on
    one: O(calls + edges) in all."""
    edges: Dict[Hashable, List[Tuple[Hashable, int]]] = {}
    for r, calls in sorted(lists.items()):
        for a, b in zip(calls, calls[1:]):
            edges.setdefault(a, []).append((b, r))
    comp = _components(edges)
    sizes: Dict[int, int] = {}
    for c in comp.values():
        sizes[c] = sizes.get(c, 0) + 1
    for first in start:
        c = comp.get(first)
        if c is None or sizes[c] < 2:
            continue
        path: List[Tuple[Hashable, int]] = []
        seen = {first}
        stack = [iter(edges.get(first, ()))]
        nodes = [first]
        while stack:
            step = next(stack[-1], None)
            if step is None:
                stack.pop()
                nodes.pop()
                if path:
                    path.pop()
                continue
            nxt, r = step
            if nxt == first:
                return path + [(nodes[-1], r)]
            if nxt in seen or comp.get(nxt) != c:
                continue
            seen.add(nxt)
            path.append((nodes[-1], r))
            nodes.append(nxt)
            stack.append(iter(edges.get(nxt, ())))
    return None


def inversion(mine: Sequence[Hashable], theirs: Sequence[Hashable]) -> Optional[Tuple[Hashable, Hashable]]:
    """Two calls both lists hold, in opposite orders: (the first of them in ``mine``, the second)."""
    pos = {x: k for k, x in enumerate(theirs)}
    seen: List[Tuple[int, Hashable]] = []
    for x in mine:
        k = pos.get(x)
        if k is None:
            continue
        for k0, x0 in seen:
            if k0 > k:
                return x0, x
        seen.append((k, x))
    return None
