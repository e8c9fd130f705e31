"""Rank 1 forks while a thread holds its log handler's lock; the child blocks logging; rank 1 waits for it.

A custom log handler (a "remote" handler that batches records) guards its buffer with its own
``threading.Lock``, which logging's fork hooks do not reinitialise. A background thread sends
the batches while holding it. At step 3 rank 1 forks a child to compress a checkpoint; the fork lands while the
background thread holds the handler's lock (forced here, a race in real life); the child's first
log call blocks for ever and rank 1 waits for the child in ``os.waitpid``. Ranks 0, 2, 3 wait in
``all_reduce``.

    torchrun --nproc-per-node 4 examples/bugs/logging_fork_lock.py
"""

import logging
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "collective-mismatch", "culprits": [1], "world": 4,
         "why": "rank 1 waits in os.waitpid for a forked child blocked on BatchingHandler._buffer_lock, held at fork"}


class BatchingHandler(logging.Handler):
    def __init__(self):
        super().__init__()
        self._buffer_lock = threading.Lock()  # not known to logging's at-fork reinit
        self.buffer = []

    def emit(self, record):
        with self._buffer_lock:
            self.buffer.append(self.format(record))
            if len(self.buffer) > 2:
                time.sleep(0.2)  # "sending" the batch while holding the lock
                del self.buffer[:]


def send_batch(handler, held):
    """The background sender: holds the handler's lock while it "sends" a batch."""
    with handler._buffer_lock:
        held.set()
        time.sleep(1.0)


def compress_checkpoint(log):
    pid = os.fork()
    if pid == 0:
        log.info("compressing")  # blocks for ever when the lock was held at fork
        os._exit(0)
    os.waitpid(pid, 0)


def main():
    rank, world = init()
    log = logging.getLogger("train")
    log.propagate = False
    handler = BatchingHandler()
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    x = torch.ones(32)
    for step in range(8):
        if step == 3:
            hang_point(rank, "fork" if rank == 1 else "all_reduce")
            if rank == 1:
                held = threading.Event()
                threading.Thread(target=send_batch, args=(handler, held), name="log-sender", daemon=True).start()
                held.wait()  # the race, made certain: the fork lands while the sender holds the lock
                compress_checkpoint(log)
        dist.all_reduce(x)
        x /= world
        progress(rank, step)
    finish()


if __name__ == "__main__":
    main()
