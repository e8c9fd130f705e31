"""Rank 1 waits forever on a ``threading.Event`` its shard prefetcher never sets; the others wait in all_reduce.

Each rank streams one data shard per epoch (shard ``epoch * world + rank``) from a blob store. A
background thread prefetches the next epoch's shard while the current one trains and sets
``ready`` when it is decoded; the main thread calls ``ready.wait()`` (no timeout) at the epoch
boundary. The decoder validates the shard header against the payload; when they disagree the
prefetcher logs a warning, "will retry", and returns, but nothing retries and ``ready`` is never set:
the thread ends without an exception. Shard 4 was exported with its header counted before
de-duplication (64 records, 61 after), and shard 4 is rank 1's shard of epoch 1. At the first
step of epoch 1 (global step 4) rank 1 sits in ``Event.wait()`` outside any collective, while
ranks 0 and 2 wait in the gradient ``all_reduce``.

    torchrun --nproc-per-node 3 examples/bugs/shard_prefetch_event_never_set.py
"""

import io
import logging
import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "collective-mismatch", "culprits": [1], "world": 3,
         "why": "rank 1's prefetch thread rejected shard 4 (header 64 records, 61 after dedup) and returned "
                "without setting the Event; rank 1 waits in Event.wait() while ranks 0, 2 wait in all_reduce at step 4"}

log = logging.getLogger("prefetch")
RECORDS = 64
FEATURES = 16
BATCH = 16
EPOCHS = 3
CRAWL_OVERLAP = {4}  # shards whose source crawls overlapped


def export_shard(shard_id):
    """The export job: header written before de-duplication (the source of the bug's data)."""
    g = torch.Generator().manual_seed(shard_id)
    x = torch.randn(RECORDS, FEATURES, generator=g, device="cpu")
    if shard_id in CRAWL_OVERLAP:  # a few documents appear twice
        x[10:13] = x[0:3]
    header = {"num_records": RECORDS, "features": FEATURES}
    x = torch.unique(x, dim=0)
    buf = io.BytesIO()
    torch.save({"header": header, "x": x}, buf)
    return buf.getvalue()


BLOB_STORE = {}


def fetch_blob(shard_id):
    if shard_id not in BLOB_STORE:
        BLOB_STORE[shard_id] = export_shard(shard_id)
    return BLOB_STORE[shard_id]


def decode(blob, shard_id):
    obj = torch.load(io.BytesIO(blob))
    n = obj["x"].shape[0]
    if n != obj["header"]["num_records"]:
        raise ValueError(f"shard {shard_id}: header says {obj['header']['num_records']} records, found {n}")
    return obj["x"]


class ShardPrefetcher:
    def __init__(self):
        self.ready = threading.Event()
        self.data = None

    def start(self, shard_id):
        self.ready.clear()
        threading.Thread(target=self._run, args=(shard_id,), name=f"prefetch-{shard_id}", daemon=True).start()

    def _run(self, shard_id):
        try:
            self.data = decode(fetch_blob(shard_id), shard_id)
        except ValueError as e:
            log.warning("%s; will retry", e)  # the bug: nothing retries, and ready is never set
            return
        self.ready.set()

    def get(self):
        self.ready.wait()
        return self.data


def main():
    rank, world = init()
    logging.basicConfig(level=logging.INFO, format=f"[rank{rank}] %(levelname)s %(name)s: %(message)s")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 32), nn.GELU(), nn.Linear(32, FEATURES))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    prefetcher = ShardPrefetcher()
    prefetcher.start(rank)
    step = 0
    for epoch in range(EPOCHS):
        if epoch == 1 and rank == 1:
            hang_point(rank, "Event.wait() for the prefetched shard")
        x = prefetcher.get().to(torch.get_default_device())
        if epoch + 1 < EPOCHS:
            prefetcher.start((epoch + 1) * world + rank)
        for i in range(0, x.shape[0] - BATCH + 1, BATCH):
            xb = x[i:i + BATCH]
            loss = nn.functional.mse_loss(model(xb + 0.1 * torch.randn_like(xb)), xb)
            opt.zero_grad()
            loss.backward()
            if step == 4:
                hang_point(rank, "all_reduce (gradients)")
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
            opt.step()
            progress(rank, step)
            step += 1
    finish()


if __name__ == "__main__":
    main()
