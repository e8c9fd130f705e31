"""Ring attention's KV rotation with ``batch_isend_irecv``: rank 2 posts its irecv from the wrong neighbour.

Context parallelism over 5 ranks: each rank holds one chunk of the sequence's keys/values and,
world - 1 times per layer, passes the chunk it holds to ``rank + 1`` and receives one from
``rank - 1`` with one ``batch_isend_irecv``. ``ring_peers`` handles the wrap-around by hand and
gets rank 2 wrong: after a refactor to a "reversed" ring for odd layers it returns ``rank + 1`` as
the source for rank 2 from layer 2 on. Rank 2's irecv waits for rank 3, which sends to rank 4.
gloo completes a send only once its receiver posted the matching recv, so the ring stalls hop by
hop (measured, from the gloo timeouts): rank 1's send to rank 2 never completes, rank 3 gets hop 0
from rank 2 and waits for hop 1 from it, ranks 0 and 4 wait in sends to ranks that are stuck. Every
rank waits in a ``batch_isend_irecv`` request, and ranks 2 and 3 wait for each other; the one wrong
peer is rank 2's (line ``prv = ...`` in ``ring_peers``).

    torchrun --nproc-per-node 5 examples/bugs/ring_attention_wrong_neighbour.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "p2p-stall", "culprits": [2], "world": 5,
         "why": "rank 2 posted irecv(src=3) in the ring rotation; its sender is rank 1 (rank 3 sends to rank 4)"}


def ring_peers(rank, world, layer):
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    if layer % 2 == 1:
        nxt, prv = prv, nxt  # odd layers run the ring backwards
    if rank == 2 and layer >= 2:
        prv = (rank + 1) % world  # the bug: a leftover of the reversed ring for the middle rank
    return nxt, prv


def rotate(kv, rank, world, layer, hop):
    nxt, prv = ring_peers(rank, world, layer)
    incoming = torch.empty_like(kv)
    ops = [dist.P2POp(dist.isend, kv, nxt), dist.P2POp(dist.irecv, incoming, prv)]
    if layer == 2 and hop == 0:
        hang_point(rank, f"batch_isend_irecv (send {nxt}, recv {prv})")
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return incoming


def main():
    rank, world = init()
    q = torch.randn(8, 16)
    for layer in range(4):
        kv = torch.randn(8, 16) + rank
        stats = torch.zeros(2)
        for hop in range(world - 1):
            scores = q @ kv.T
            stats += torch.stack([scores.max(), scores.exp().sum().log()])
            kv = rotate(kv, rank, world, layer, hop)
        dist.all_reduce(stats)  # the softmax statistics of the whole sequence
        progress(rank, layer)
    finish()


if __name__ == "__main__":
    main()
