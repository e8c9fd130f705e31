"""Rank 0's ``multiprocessing.Pool.map`` never returns: a worker's exception cannot be unpickled.

Each rank computes log-spectrogram features of its audio clips in a ``multiprocessing.Pool`` of two
worker processes (``pool.map(extract_features, clips)``) and trains a keyword classifier on them,
all-reducing the gradients. ``extract_features`` rejects clips with the wrong sample rate by raising
``BadClip(clip_id, reason)``, and the training loop means to skip such a batch with
``except BadClip``. But ``BadClip.__init__`` takes two arguments and passes one message to
``Exception``: the exception pickles, yet unpickling it in the parent calls ``BadClip(message)`` and
raises ``TypeError``. That kills the pool's result-handler thread (its traceback goes to stderr) and
``pool.map`` waits for ever on a result that no thread will deliver. Clip 36 of the manifest is an
8 kHz telephone recording; it is in rank 0's shard at step 3. Rank 0's main thread blocks in
``pool.map`` (a ``threading`` wait, no collective); rank 1 waits in step 3's ``all_reduce``.

    torchrun --nproc-per-node 2 examples/bugs/b4_proc_pool_unpicklable_exception.py
"""

import math
import multiprocessing
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "rank-failed", "culprits": [0], "world": 2,
         "why": "rank 0's main thread waits for ever in multiprocessing Pool.map: the BadClip raised for 8 kHz "
                "clip 36 cannot be unpickled, the pool's result-handler thread died; rank 1 waits in all_reduce"}

SAMPLE_RATE = 16000
CLIPS_PER_STEP = 6
STEPS = 6
KEYWORDS = 4


class BadClip(Exception):
    def __init__(self, clip_id, reason):
        super().__init__(f"clip {clip_id}: {reason}")  # the bug: self.args == (message,), not (clip_id, reason)
        self.clip_id, self.reason = clip_id, reason


def manifest(n=72):
    """(clip_id, sample_rate, keyword) of the corpus; clip 36 came from a telephone-speech source."""
    return [(i, 8000 if i == 36 else SAMPLE_RATE, i % KEYWORDS) for i in range(n)]


def load_audio(clip_id, sample_rate, keyword):
    t = torch.arange(sample_rate // 10, dtype=torch.float32, device="cpu") / sample_rate  # a forked worker: never CUDA
    gen = torch.Generator().manual_seed(clip_id)
    return torch.sin(2 * math.pi * (200 + 150 * keyword) * t) + 0.1 * torch.randn(t.shape, generator=gen, device="cpu")


def extract_features(clip):
    clip_id, sample_rate, keyword = clip
    if sample_rate != SAMPLE_RATE:
        raise BadClip(clip_id, f"sample rate {sample_rate}, expected {SAMPLE_RATE}")
    wave = load_audio(clip_id, sample_rate, keyword)
    spec = torch.stft(wave, n_fft=256, hop_length=128, window=torch.hann_window(256, device="cpu"), return_complex=True)
    return (spec.abs() + 1e-6).log().mean(dim=1)  # 129 log-magnitude bins


def worker_init():
    torch.set_num_threads(1)


def main():
    rank, world = init()
    pool = multiprocessing.get_context("fork").Pool(2, initializer=worker_init)
    try:
        clips = manifest()[rank::world]
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(129, 64), nn.ReLU(), nn.Linear(64, KEYWORDS))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        dev = next(model.parameters()).device
        for step in range(STEPS):
            batch = clips[step * CLIPS_PER_STEP:(step + 1) * CLIPS_PER_STEP]
            if step == 3 and rank == 0:
                hang_point(rank, "Pool.map (result-handler thread died unpickling BadClip)")
            opt.zero_grad()
            try:
                feats = torch.stack(pool.map(extract_features, batch)).to(dev)
                labels = torch.tensor([keyword for _, _, keyword in batch])
                nn.functional.cross_entropy(model(feats), labels).backward()
            except BadClip as exc:  # meant to skip a bad batch: never reached
                print(f"[rank {rank}] skipping batch at step {step}: {exc}", flush=True)
                for p in model.parameters():
                    p.grad = torch.zeros_like(p)
            if step == 3 and rank != 0:
                hang_point(rank, "all_reduce gradients")
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
            opt.step()
            progress(rank, step)
        finish()
    finally:
        pool.terminate()


if __name__ == "__main__":
    main()
