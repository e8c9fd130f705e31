"""Slow, not hung: rank 0 uploads each checkpoint to a throttled object store synchronously (20 s, twice).

The usual ``if rank == 0: save_checkpoint(...)`` every ``SAVE_EVERY`` steps, where "save" also
pushes the file to an object store part by part through a bandwidth-throttled client (each part
PUT takes 0.5 s, 40 parts). The upload is synchronous, so ranks 1 and 2 wait in the next step's
gradient ``all_reduce`` for 20 s, at step 5 and again at step 10; then the job resumes and ends
normally (about 40 s of training, 50-55 s with torchrun's start-up). Normal steps take a few
milliseconds.
(``UPLOAD_SECONDS`` changes the 20 s.)

    torchrun --nproc-per-node 3 examples/bugs/rank0_object_store_upload_slow.py
"""

import io
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "slow-not-hung", "culprits": [], "world": 3, "slow": [0],
         "why": "rank 0 alone uploads the checkpoint to a throttled object store for 20 s after steps 4 and 9; "
                "ranks 1, 2 wait in the next all_reduce; the job then finishes"}

SAVE_EVERY = 5
STEPS = 12
PART_SECONDS = 0.5


class ThrottledObjectStore:
    """A stand-in for a multipart-upload client behind a slow, rate-limited link."""

    def __init__(self, seconds):
        self.parts = max(1, round(seconds / PART_SECONDS))
        self.objects = {}

    def upload(self, key, payload):
        part_size = -(-len(payload) // self.parts)
        parts = []
        for i in range(self.parts):
            parts.append(payload[i * part_size:(i + 1) * part_size])
            time.sleep(PART_SECONDS)  # PUT part i: the link gives us ~2 parts per second
        self.objects[key] = b"".join(parts)


def save_checkpoint(store, model, opt, step):
    buf = io.BytesIO()
    torch.save({"step": step, "model": model.state_dict(), "opt": opt.state_dict()}, buf)
    store.upload(f"ckpt/step_{step:06d}.pt", buf.getvalue())


def main():
    rank, world = init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    store = ThrottledObjectStore(float(os.environ.get("UPLOAD_SECONDS", "20")))
    torch.manual_seed(rank)
    for step in range(STEPS):
        x = torch.randn(16, 32)
        y = x[:, :1].sin()
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        if step == SAVE_EVERY and rank != 0:
            hang_point(rank, "all_reduce (waits for rank 0's upload)")
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        progress(rank, step)
        if rank == 0 and (step + 1) % SAVE_EVERY == 0:
            if step + 1 == SAVE_EVERY:
                hang_point(rank, "upload checkpoint to the object store (20 s)")
            save_checkpoint(store, model, opt, step)
    finish()


if __name__ == "__main__":
    main()
