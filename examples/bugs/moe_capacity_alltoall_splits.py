"""MoE dispatch: rank 1 clamps its receive splits to the expert capacity, the senders do not; gloo aborts rank 1.

An expert-parallel MoE layer, one expert per rank, with hash routing (``expert = token_id %
world``, as in Hash Layers). Each step first exchanges the per-expert token counts with
``all_to_all_single``, then dispatches the tokens with ``all_to_all_single(out, x, out_splits,
in_splits)``. Capacity dropping was put on the receiving side only: ``out_splits =
recv_counts.clamp(max=capacity)``, while the senders still send every token. Padding is not masked
before routing and the pad id is 1 (fairseq's), so every pad token goes to expert 1 on rank 1.
With the long-sequence buckets the load stays below capacity; at step 3 rank 3's length-bucketing
sampler yields its short-sequence bucket (lengths 4-9 padded to 32): rank 3 sends 200+ tokens to
expert 1, whose receive split says 128. Gloo's receive enforces the size: rank 1 dies at once
(``terminate called after throwing an instance of 'gloo::EnforceNotMet'``, SIGABRT) in the
dispatch, under a second after the hang point; ranks 0, 2 and 3 then fail on the closed
connections ("Connection reset by peer") in the dispatch or the combine ``all_to_all_single``.

    torchrun --nproc-per-node 4 examples/bugs/moe_capacity_alltoall_splits.py
"""

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "collective-mismatch", "culprits": [1], "world": 4,
         "why": "step 3: rank 1 clamps its all_to_all_single receive split from rank 3 to the expert capacity "
                "(128) while rank 3 sends all its 200+ pad-routed tokens; gloo aborts rank 1 at once"}

BATCH = 8
SEQ = 32
VOCAB = 1000
PAD_ID = 1
DIM = 16
CAPACITY_FACTOR = 2.0
BUCKETS = [(4, 10)] + [(26, 33)] * 7  # one short-sequence bucket per 8 batches
SAMPLER_SEED = 64


class LengthBucketSampler:
    def __init__(self, rank):
        self.g = torch.Generator().manual_seed(SAMPLER_SEED + rank)
        self.order = torch.randperm(len(BUCKETS), generator=self.g, device="cpu").tolist()

    def batch(self, step):
        lo, hi = BUCKETS[self.order[step % len(BUCKETS)]]
        lens = torch.randint(lo, hi, (BATCH,), generator=self.g, device="cpu")
        ids = torch.randint(4, VOCAB, (BATCH, SEQ), generator=self.g, device="cpu")
        ids[torch.arange(SEQ, device="cpu")[None, :] >= lens[:, None]] = PAD_ID  # padded to a static shape
        return ids.to(torch.get_default_device())


class HashMoE(nn.Module):
    def __init__(self, world):
        super().__init__()
        self.world = world
        self.embed = nn.Embedding(VOCAB, DIM)
        self.expert = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, ids, rank, step):
        h = self.embed(ids)
        flat = ids.flatten()
        dest = flat % self.world  # hash routing; pad tokens are not masked out
        order = torch.argsort(dest, stable=True)
        x = h.reshape(-1, DIM)[order].detach()
        send_counts = torch.bincount(dest, minlength=self.world)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)
        capacity = math.ceil(CAPACITY_FACTOR * flat.numel() / self.world)
        in_splits = send_counts.tolist()
        out_splits = recv_counts.clamp(max=capacity).tolist()  # the bug: tokens dropped on receive only
        received = x.new_empty(sum(out_splits), DIM)
        if step == 3:
            hang_point(rank, "all_to_all_single (dispatch)")
        dist.all_to_all_single(received, x, out_splits, in_splits)
        out = self.expert(received)
        back = x.new_empty(sum(in_splits), DIM)
        dist.all_to_all_single(back, out.detach(), in_splits, out_splits)  # combine
        y = torch.empty_like(back)
        y[order] = back
        return h + y.view_as(h), out


def main():
    rank, world = init()
    torch.manual_seed(0)
    model = HashMoE(world)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sampler = LengthBucketSampler(rank)
    for step in range(8):
        ids = sampler.batch(step)
        y, expert_out = model(ids, rank, step)
        loss = y.pow(2).mean() + expert_out.pow(2).mean()
        opt.zero_grad()
        loss.backward()
        dist.all_reduce(model.embed.weight.grad)  # the embedding is replicated; the expert is local
        model.embed.weight.grad /= world
        opt.step()
        progress(rank, step)
    finish()


if __name__ == "__main__":
    main()
