"""An async checkpoint thread's barrier on a second group waits for rank 3, whose interval never comes.

Each rank writes its checkpoint shard on a background thread and then commits with a ``barrier``
on a dedicated gloo group (``ckpt_group``), so that rank 0 writes the metadata only once every
shard is on disk. The save interval is derived per rank from an estimate of its step time (its
own tokens per step over a nominal throughput): ranks 0-2 get every 3 steps, rank 3, whose
packed batches hold far fewer tokens, every 24, more than the run's 8 steps. Ranks 0-2 start a
save at step 2; their threads wait in the barrier for rank 3. At step 5 they start the next one,
and ``save`` first joins the previous thread: their main threads wait there. Rank 3 never starts
a thread and waits in step 6's gradient ``all_reduce``.

    torchrun --nproc-per-node 4 examples/bugs/async_ckpt_side_barrier.py
"""

import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress, timeout  # noqa: E402

TRUTH = {"kind": "collective-mismatch", "culprits": [3], "world": 4,
         "why": "rank 3 computed a 24-step checkpoint interval (ranks 0-2: 3) and never joined the async checkpoint's barrier on ckpt_group"}

SAVE_EVERY_SECONDS, TOKENS_PER_SECOND = 1.5, 8192


class AsyncCheckpointer:
    def __init__(self, rank, group):
        self.rank, self.group, self.thread = rank, group, None

    def save(self, state, step):
        self.wait()  # one save in flight at a time
        snapshot = {k: v.clone() for k, v in state.items()}
        self.thread = threading.Thread(target=self._write, args=(snapshot, step), name="async-ckpt", daemon=True)
        self.thread.start()

    def _write(self, snapshot, step):
        torch.save(snapshot, os.devnull)  # this rank's shard
        dist.barrier(group=self.group)  # every shard written: commit
        if self.rank == 0:
            print(f"checkpoint {step} committed", flush=True)

    def wait(self):
        if self.thread is not None:
            self.thread.join()


def main():
    rank, world = init()
    ckpt = AsyncCheckpointer(rank, dist.new_group(backend="gloo", timeout=timeout()))
    tokens_per_step = 512 if rank == 3 else 4096  # rank 3's shard packs short sequences
    every = max(1, round(SAVE_EVERY_SECONDS / (tokens_per_step / TOKENS_PER_SECOND)))  # the bug: rank-local
    w = torch.zeros(128)
    for step in range(8):
        if rank == 3 and step == 6:
            hang_point(rank, "all_reduce step 6")
        grad = torch.randn(128) * 1e-3
        dist.all_reduce(grad)
        w -= grad / world
        if (step + 1) % every == 0:
            if step == 5:
                hang_point(rank, "save joins the step-2 checkpoint thread (barrier on ckpt_group)")
            ckpt.save({"w": w}, step)
        progress(rank, step)
    ckpt.wait()
    finish()


if __name__ == "__main__":
    main()
