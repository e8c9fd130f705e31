"""Rank 2 dies of SIGSEGV in a ``ctypes.memmove`` "fast path" that packs an empty sample (NULL pointer).

Sequence packing copies each document's token ids into one preallocated int32 buffer. The fast
path skips per-element Python work: ``ctypes.memmove(buf + offset, ids.data_ptr(), 4 * n)``, with
``n`` taken from the dataset index (the lengths stored at tokenization time), not from the tensor.
Since the index was built, the loader drops padding/BOS ids from each document. Document 32 of the
corpus is a blank page the crawler stored as padding only: after filtering its tensor is empty,
``data_ptr()`` is 0, and ``memmove`` reads 24 bytes from address 0. Document 32 is in rank 2's shard
at step 2: rank 2 is killed by SIGSEGV (exit -11, no Python traceback), ranks 0 and 1 reach step 2's
gradient ``all_reduce``.

    torchrun --nproc-per-node 3 examples/bugs/b4_proc_pack_ctypes_null_segfault.py
"""

import ctypes
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "rank-failed", "culprits": [2], "world": 3,
         "why": "rank 2 is killed by SIGSEGV in ctypes.memmove packing document 32 (padding only: empty tensor, "
                "data_ptr() == 0, length 6 from the index) at step 2; ranks 0 and 1 wait in all_reduce"}

PAD, BOS = 0, 1
VOCAB = 256
DOCS_PER_STEP = 4
PACK_LEN = 64
STEPS = 5


def build_corpus(n_docs=64):
    """Token ids per document and the index of lengths written at tokenization time."""
    gen = torch.Generator().manual_seed(1234)
    docs = []
    for i in range(n_docs):
        length = 4 + (i * 7) % 9
        ids = torch.randint(2, VOCAB, (length,), generator=gen, dtype=torch.int32, device="cpu")
        if i == 32:
            ids = torch.full((6,), PAD, dtype=torch.int32, device="cpu")  # a blank page, stored as padding
        docs.append(torch.cat([torch.tensor([BOS], dtype=torch.int32, device="cpu"), ids]))
    index = [len(d) - 1 for d in docs]  # lengths without BOS
    return docs, index


def strip_special(ids):
    return ids[(ids != PAD) & (ids != BOS)].contiguous()


def pack(docs, lengths):
    """Fast path: copy each document into one buffer without touching its elements in Python."""
    buf = torch.full((PACK_LEN,), PAD, dtype=torch.int32, device="cpu")  # host memory
    base, offset = buf.data_ptr(), 0
    for ids, n in zip(docs, lengths):
        n = min(n, PACK_LEN - offset)
        ctypes.memmove(base + 4 * offset, ids.data_ptr(), 4 * n)  # the bug: n from the index, not ids.numel()
        offset += n
    return buf


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.out = nn.Linear(32, VOCAB)

    def forward(self, ids):
        return self.out(self.emb(ids))


def main():
    rank, world = init()
    docs, index = build_corpus()
    mine = list(range(rank, len(docs), world))
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dev = next(model.parameters()).device
    for step in range(STEPS):
        picked = mine[step * DOCS_PER_STEP:(step + 1) * DOCS_PER_STEP]
        if step == 2 and rank == 2:
            hang_point(rank, "ctypes.memmove from data_ptr() 0 (document 32), SIGSEGV")
        packed = pack([strip_special(docs[i]) for i in picked], [index[i] for i in picked]).long().to(dev)
        logits = model(packed[:-1])
        loss = nn.functional.cross_entropy(logits, packed[1:], ignore_index=PAD)
        opt.zero_grad()
        loss.backward()
        if step == 2 and rank != 2:
            hang_point(rank, "all_reduce gradients")
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        progress(rank, step)
    finish()


if __name__ == "__main__":
    main()
