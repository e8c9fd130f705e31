"""Rank 2 retries loading a truncated cache file for ever: ``except Exception`` + exponential back-off.

Each node keeps a tokenized-data cache on its local disk, one ``torch.save`` file per chunk, and
each step of the job trains on the next chunk. The cache is filled by a preprocessing job that
writes each file in place (no temporary name and rename). On the node of rank 2 that job hit its
wall-time limit while writing ``chunk_003.pt``: the file is truncated. ``load_chunk`` was written
for a flaky network file system: it catches every exception, logs a warning and sleeps with
exponential back-off (0.5 s, 1 s, 2 s, ... capped at 60 s) before retrying. A truncated zip archive
is not transient: rank 2 stays alive, sleeping and retrying, and never reaches step 3's gradient
``all_reduce``, where ranks 0, 1 and 3 wait.

    torchrun --nproc-per-node 4 examples/bugs/b4_proc_cache_retry_backoff_forever.py
"""

import io
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "collective-mismatch", "culprits": [2], "world": 4,
         "why": "rank 2 sleeps in load_chunk's retry loop (except Exception + back-off) on a truncated "
                "chunk_003.pt in its node-local cache; the others wait in step 3's all_reduce"}

CHUNKS = 6
ROWS = 32
FEATURES = 24
# What the preprocessing job left in each node's cache (one rank per node here): files it was
# still writing when its wall-time limit killed it.
PREPROCESS_KILLED_WHILE_WRITING = {"node2": "chunk_003.pt"}


def job_tmpdir(tag):
    """Scratch shared by this job's ranks (one torchrun agent: the parent pid); any rank's ``finally`` removes it."""
    base = os.path.join(tempfile.gettempdir(), f"b4-proc-{tag}-{os.getppid()}")
    os.makedirs(base, exist_ok=True)
    return base


def preprocess(cache, node, seed):
    """The preprocessing job: tokenize, write each chunk in place."""
    os.makedirs(cache, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    for k in range(CHUNKS):
        name = f"chunk_{k:03d}.pt"
        x = torch.randn(ROWS, FEATURES, generator=gen, device="cpu")
        buf = io.BytesIO()
        torch.save({"x": x, "y": x.sum(1, keepdim=True).tanh()}, buf)
        data = buf.getvalue()
        if PREPROCESS_KILLED_WHILE_WRITING.get(node) == name:
            data = data[:len(data) // 3]  # killed mid-write
        with open(os.path.join(cache, name), "wb") as f:
            f.write(data)


def load_chunk(path, rank):
    backoff = 0.5
    while True:
        try:
            return torch.load(path)
        except Exception as exc:  # the bug: every error is treated as a transient file-system hiccup
            print(f"[rank {rank}] WARNING: loading {os.path.basename(path)} failed ({type(exc).__name__}: "
                  f"{str(exc)[:80]}); retrying in {backoff:.1f}s", file=sys.stderr, flush=True)
            time.sleep(backoff)
            backoff = min(backoff * 2, 60.0)


def main():
    rank, world = init()
    base = job_tmpdir("cache")
    try:
        node = f"node{rank}"
        cache = os.path.join(base, node, "token_cache")
        preprocess(cache, node, seed=100 + rank)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(FEATURES, 64), nn.GELU(), nn.Linear(64, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        dev = next(model.parameters()).device
        for step in range(CHUNKS):
            path = os.path.join(cache, f"chunk_{step:03d}.pt")
            if step == 3 and rank == 2:
                hang_point(rank, "load_chunk retry loop (truncated chunk_003.pt), sleeping")
            chunk = load_chunk(path, rank)
            x, y = chunk["x"].to(dev), chunk["y"].to(dev)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            if step == 3 and rank != 2:
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
