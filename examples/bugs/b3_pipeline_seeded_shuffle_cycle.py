"""4-stage pipeline whose stages shuffle the data with ``seed + rank``: stages 2 and 3 each wait for the other.

A GPipe schedule (all forward micro-batches, then all backward, blocking ``send``/``recv``) over 4
stages with sequence packing: a step's tokens are packed into micro-batches of ``TOKENS_PER_MICRO``
tokens, so the number of micro-batches is ``ceil(tokens / TOKENS_PER_MICRO)``. Every stage runs the
same data pipeline (stage 0 needs the inputs, the last stage the labels, the others the schedule),
and that pipeline was written for data parallelism: its shuffle generator is seeded with
``SEED + rank``. Each stage therefore sees another batch. Steps 0 and 1 happen to give every stage
4 micro-batches; at step 2 ranks 0-2 count 3 and rank 3 counts 4. Rank 2 sends 3 micro-batches and
turns to the backward pass, waiting in ``recv`` for the gradient from rank 3; rank 3 waits in
``recv`` for a fourth activation from rank 2: a cycle of two. Ranks 1 and 0 wait behind it, in the
backward ``recv`` from ranks 2 and 1.

    torchrun --nproc-per-node 4 examples/bugs/b3_pipeline_seeded_shuffle_cycle.py
"""

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "p2p-cycle", "culprits": [2, 3], "world": 4,
         "why": "per-rank shuffle seed (SEED + rank): at step 2 rank 3 expects 4 packed micro-batches, rank 2 "
                "sends 3; rank 3 waits in recv(src=2) for an activation, rank 2 in recv(src=3) for a gradient"}

SEED = 555
NUM_SEQS = 64
BATCH = 8
TOKENS_PER_MICRO = 64
VOCAB = 128
HIDDEN = 32
STEPS = 6
HANG_STEP = 2


def sequence_lengths():
    return torch.randint(12, 41, (NUM_SEQS,), generator=torch.Generator().manual_seed(0), device="cpu")


def sequence(idx, length):
    return torch.randint(VOCAB, (length,), generator=torch.Generator().manual_seed(10_000 + idx), device="cpu")


def batches(rank):
    lengths = sequence_lengths()
    g = torch.Generator().manual_seed(SEED + rank)  # the bug: a DP habit; pipeline stages must agree
    order = torch.randperm(NUM_SEQS, generator=g, device="cpu")
    for start in range(0, NUM_SEQS, BATCH):
        yield [sequence(int(i), int(lengths[i])) for i in order[start:start + BATCH]]


def pack(seqs):
    """Concatenate the batch's sequences and cut them into micro-batches of TOKENS_PER_MICRO tokens."""
    tokens = torch.cat(seqs)
    num_micro = math.ceil(tokens.numel() / TOKENS_PER_MICRO)
    padded = torch.zeros(num_micro * TOKENS_PER_MICRO, dtype=torch.long)
    padded[:tokens.numel()] = tokens
    return padded.view(num_micro, TOKENS_PER_MICRO).to(torch.get_default_device())


class Stage(torch.nn.Module):
    def __init__(self, first, last):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN) if first else None
        self.body = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh())
        self.head = torch.nn.Linear(HIDDEN, VOCAB) if last else None

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        x = self.body(x)
        return self.head(x) if self.head is not None else x


def main():
    rank, world = init()
    first, last = rank == 0, rank == world - 1
    torch.manual_seed(rank)
    stage = Stage(first, last)
    opt = torch.optim.SGD(stage.parameters(), lr=0.01)
    for step, seqs in enumerate(batches(rank)):
        if step == STEPS:
            break
        micro = pack(seqs)
        inputs, outputs, losses = [], [], []
        for mb in range(micro.shape[0]):  # forward of every micro-batch
            if first:
                x = micro[mb]
            else:
                x = torch.empty(TOKENS_PER_MICRO, HIDDEN)
                if step == HANG_STEP and last and mb == 3:
                    hang_point(rank, f"recv(src={rank - 1}) activation, micro-batch {mb}")
                dist.recv(x, src=rank - 1)
                x.requires_grad_(True)
            y = stage(x)
            inputs.append(x)
            outputs.append(y)
            if last:
                labels = torch.roll(micro[mb], -1)
                losses.append(torch.nn.functional.cross_entropy(y, labels))
            else:
                dist.send(y.detach(), dst=rank + 1)
        opt.zero_grad()
        for mb in reversed(range(len(outputs))):  # backward, last micro-batch first
            if last:
                (losses[mb] / len(losses)).backward()
            else:
                grad = torch.empty(TOKENS_PER_MICRO, HIDDEN)
                if step == HANG_STEP and mb == len(outputs) - 1:
                    hang_point(rank, f"recv(src={rank + 1}) gradient, micro-batch {mb}")
                dist.recv(grad, src=rank + 1)
                outputs[mb].backward(grad)
            if not first:
                dist.send(inputs[mb].grad, dst=rank - 1)
        opt.step()
        if last:
            print(f"step={step} micro_batches={len(outputs)} loss={sum(l.item() for l in losses) / len(losses):.4f}",
                  flush=True)
        progress(rank, step)
    finish()


if __name__ == "__main__":
    main()
