"""A throughput callback gathers only when its rank-local token counter crosses a threshold; rank 5 lags.

The trainer runs every callback's ``on_step_end`` after the optimizer step. ``ThroughputLogger``
counts the tokens this rank has seen and, once they pass ``log_every_tokens``, all-gathers every
rank's tokens/s (rank 0 logs the total and the slowest rank) and resets. The condition is
rank-local: rank 5's shard holds shorter sequences (96 tokens a sample where the others have 128),
so at step 4 ranks 0-4, 6 and 7 cross 2,500 tokens and enter the callback's ``all_gather``, while
rank 5 (1,920 tokens) skips it and goes on to step 5's gradient ``all_reduce``.

    torchrun --nproc-per-node 8 examples/bugs/metrics_callback_skip.py
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "collective-mismatch", "culprits": [5], "world": 8,
         "why": "rank 5's ThroughputLogger callback skipped its all_gather at step 4 (rank-local token threshold)"}


class ThroughputLogger:
    def __init__(self, log_every_tokens=2500):
        self.log_every_tokens = log_every_tokens
        self.tokens = 0
        self.since = time.monotonic()

    def on_step_end(self, trainer, batch):
        self.tokens += batch.numel()
        if self.tokens < self.log_every_tokens:  # the bug: a rank-local decision before a collective
            return
        mine = torch.tensor([self.tokens / (time.monotonic() - self.since)])
        rates = [torch.empty(1) for _ in range(trainer.world)]
        dist.all_gather(rates, mine)  # every rank's tokens/s: the slowest one is the straggler
        if trainer.rank == 0:
            slow = min(range(trainer.world), key=lambda r: rates[r].item())
            print(f"step {trainer.step}: {sum(r.item() for r in rates):.0f} tokens/s, slowest rank {slow}", flush=True)
        self.tokens, self.since = 0, time.monotonic()


class Trainer:
    def __init__(self, rank, world, callbacks):
        self.rank, self.world, self.callbacks, self.step = rank, world, callbacks, 0
        self.weight = torch.zeros(16, 8)

    def train_step(self, batch):
        grad = torch.ones_like(self.weight) * batch.float().mean() / 1000
        dist.all_reduce(grad)  # DDP's gradient bucket
        self.weight -= 0.01 * grad / self.world

    def fit(self, batches):
        for self.step, batch in enumerate(batches):
            if self.step == 4:
                hang_point(self.rank, "all_reduce step 5 (callback skipped)" if self.rank == 5 else "callback all_gather")
            self.train_step(batch)
            for cb in self.callbacks:
                cb.on_step_end(self, batch)
            progress(self.rank, self.step)


def main():
    rank, world = init()
    seq_len = 96 if rank == 5 else 128  # rank 5's shard: shorter documents
    batches = [torch.randint(0, 32000, (4, seq_len)) for _ in range(10)]
    Trainer(rank, world, [ThroughputLogger()]).fit(batches)
    finish()


if __name__ == "__main__":
    main()
