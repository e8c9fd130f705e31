"""Rank 1 spins for ever in a hand-written tokenizer on a record with a no-break space.

A small text classifier is trained data-parallel on a scraped corpus; each rank takes every
``world``-th line of the shared corpus file and tokenizes its batch with ``split_words``, a
hand-rolled scanner that was written for ASCII text. Line 43 was scraped from HTML and, after
``html.unescape``, contains a U+00A0 no-break space. That character is neither a separator, a word
character nor listed punctuation, so ``split_words`` neither consumes it nor advances: ``i = j``
with ``j == i``, a CPU-bound ``while`` loop that never ends (pure Python, no sleep, no I/O). Line
43 falls into rank 1's shard at step 3: rank 1 never reaches the gradient ``all_reduce`` its peers
wait in.

    torchrun --nproc-per-node 3 examples/bugs/b4_proc_tokenizer_nbsp_spin.py
"""

import html
import os
import shutil
import sys
import tempfile
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "collective-mismatch", "culprits": [1], "world": 3,
         "why": "rank 1 spins in pure Python in split_words() on corpus line 43 (U+00A0 never consumed) "
                "at step 3 and never reaches the gradient all_reduce"}

BATCH = 4
STEPS = 6
VOCAB = 512
SEPARATORS = " \t\n"
PUNCT = ".,;:!?()\"'$%/"

SUBJECTS = ["The parcel", "Our support team", "This model", "The refund", "A new account", "The invoice"]
VERBS = ["arrived", "was processed", "is available", "was rejected", "ships", "needs review"]
TAILS = ["within two days.", "after the update!", "on Monday, as planned.", "(again).", "for 40% off.",
         "without any issue."]


def write_corpus(path, lines=120):
    """Scraped FAQ/ticket lines, HTML entities and all; one line kept an ``&nbsp;``."""
    with open(path, "w", encoding="utf-8") as f:
        for i in range(lines):
            line = f"{SUBJECTS[i % 6]} {VERBS[(i // 6) % 6]} {TAILS[(i * 5) % 6]}"
            if i == 43:
                line = "Shipping costs 5&nbsp;EUR per order &amp; arrives in 3 days."
            f.write(f"{i % 2}\t{line}\n")


def read_shard(path, rank, world):
    with open(path, encoding="utf-8") as f:
        rows = [line.rstrip("\n").split("\t", 1) for line in f]
    return [(int(label), html.unescape(text)) for label, text in rows][rank::world]


def split_words(text):
    """Whitespace and punctuation tokenizer (ASCII assumptions)."""
    words, i = [], 0
    while i < len(text):
        if text[i] in SEPARATORS:
            i += 1
            continue
        j = i
        while j < len(text) and (text[j].isascii() and text[j].isalnum() or text[j] in "-_'"):
            j += 1
        if j > i:
            words.append(text[i:j].lower())
        elif text[i] in PUNCT:
            words.append(text[i])
            j = i + 1
        i = j  # the bug: for any other character (U+00A0, an emoji) j == i and the loop never advances
    return words


def encode(batch):
    ids, offsets = [], []
    for _, text in batch:
        offsets.append(len(ids))
        ids.extend(zlib.crc32(w.encode()) % VOCAB for w in split_words(text))
    return torch.tensor(ids, dtype=torch.long), torch.tensor(offsets, dtype=torch.long)


class BagClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(VOCAB, 32, mode="mean")
        self.head = nn.Linear(32, 2)

    def forward(self, ids, offsets):
        return self.head(self.emb(ids, offsets))


def job_tmpdir(tag):
    """Scratch shared by this job's ranks (one torchrun agent: the parent pid); any rank's ``finally`` removes it."""
    base = os.path.join(tempfile.gettempdir(), f"b4-proc-{tag}-{os.getppid()}")
    os.makedirs(base, exist_ok=True)
    return base


def main():
    rank, world = init()
    base = job_tmpdir("corpus")
    workdir = tempfile.mkdtemp(prefix=f"rank{rank}-", dir=base)
    try:
        corpus = os.path.join(workdir, "faq.tsv")
        write_corpus(corpus)
        shard = read_shard(corpus, rank, world)
        torch.manual_seed(0)
        model = BagClassifier()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(STEPS):
            batch = shard[step * BATCH:(step + 1) * BATCH]
            if step == 3 and rank == 1:
                hang_point(rank, "split_words spins on line 43 (U+00A0)")
            ids, offsets = encode(batch)
            labels = torch.tensor([label for label, _ in batch])
            loss = nn.functional.cross_entropy(model(ids, offsets), labels)
            opt.zero_grad()
            loss.backward()
            flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            if step == 3 and rank != 1:
                hang_point(rank, "all_reduce gradients")
            dist.all_reduce(flat)
            flat /= world
            offset = 0
            for p in model.parameters():
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
            opt.step()
            progress(rank, step)
        finish()
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
