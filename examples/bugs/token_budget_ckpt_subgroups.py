"""Checkpoint every N *local* tokens: rank 2 crosses the budget a step early and builds the save groups alone.

A language-model loop on packed, variable-length batches saves a sharded checkpoint every
``SAVE_EVERY_TOKENS`` tokens. The trigger counts this rank's own tokens (``tokens_seen +=
mask.sum()``) where it should count the global ones, and the checkpoint writer creates its per-node
sub-groups lazily on first use (``dist.new_subgroups(group_size=2)``, cached in a module global).
Rank 2's shard is the "code" source, whose documents are longer: it crosses the budget at the end
of step 3 and enters ``new_subgroups``; as a member of ``[2, 3]`` it blocks in the gloo group's
rendezvous with rank 3. Ranks 0, 1 and 3 are still under budget and go on to step 4's gradient
``all_reduce`` on the default group, which waits for rank 2.

    torchrun --nproc-per-node 4 examples/bugs/token_budget_ckpt_subgroups.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

from _common import finish, hang_point, init, progress, timeout  # noqa: E402

TRUTH = {"kind": "collective-mismatch", "culprits": [2], "world": 4,
         "why": "rank 2's rank-local token count crosses the checkpoint budget at step 3: it alone calls "
                "dist.new_subgroups (stuck creating group [2, 3]) while ranks 0, 1, 3 wait in step 4's all_reduce"}

SEQ = 160
BATCH = 8
VOCAB = 512
SAVE_EVERY_TOKENS = 3500
SOURCES = ["web", "books", "code", "web"]        # the data mixture: shard i is read by rank i
MEAN_DOC_LEN = {"web": 96, "books": 100, "code": 124}

_SAVE_GROUP = None


def packed_batch(source, step, rank):
    """A batch of documents padded to SEQ; the mask marks real tokens."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    jitter = torch.randint(-4, 5, (BATCH,), generator=g, device="cpu")
    lens = (MEAN_DOC_LEN[source] + jitter).clamp(max=SEQ)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g, device="cpu")
    mask = torch.arange(SEQ, device="cpu")[None, :] < lens[:, None]
    dev = torch.get_default_device()
    return tokens.to(dev), mask.to(dev)


def save_group():
    global _SAVE_GROUP
    if _SAVE_GROUP is None:  # lazily, on the first save: "every rank saves at the same step anyway"
        _SAVE_GROUP, _ = dist.new_subgroups(group_size=2, timeout=timeout())
    return _SAVE_GROUP


def save_checkpoint(model, rank, step):
    if _SAVE_GROUP is None:
        hang_point(rank, "new_subgroups (checkpoint writer)")
    group = save_group()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    shards = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, flat, group=group)
    torch.save({"step": step, "node_shards": shards}, os.devnull)


def main():
    rank, world = init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, 32), nn.Linear(32, VOCAB))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    tokens_seen = 0
    next_save = SAVE_EVERY_TOKENS
    for step in range(8):
        tokens, mask = packed_batch(SOURCES[rank], step, rank)
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1),
                                           reduction="none")
        loss = (loss * mask[:, 1:].reshape(-1)).sum() / mask[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        flat = torch.cat([p.grad.flatten() for p in model.parameters()])
        if step == 4:
            hang_point(rank, "all_reduce (gradients)")
        dist.all_reduce(flat)
        flat /= world
        offset = 0
        for p in model.parameters():
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        opt.step()
        tokens_seen += int(mask.sum())  # the bug: this rank's tokens, not the job's
        if tokens_seen >= next_save:
            save_checkpoint(model, rank, step)
            next_save += SAVE_EVERY_TOKENS
        progress(rank, step)
    finish()


if __name__ == "__main__":
    main()
