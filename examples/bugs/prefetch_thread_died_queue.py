"""Rank 1's prefetch thread dies on a corrupt record; its main thread blocks forever in ``queue.get()``.

Each rank decodes its own shard in a background prefetch thread that puts ready batches on a
bounded ``queue.Queue``; the training loop takes them with a plain ``get()`` (no timeout, no
sentinel for errors). At batch 3 rank 1's shard holds a truncated record: ``decode`` raises
``ValueError`` in the prefetch thread (it decodes ahead, so this happens while the main thread is
still on step 0 or 1), Python prints "Exception in thread prefetch-1" with the traceback and the
thread ends. The process lives on (the main thread is fine), so the launcher sees nothing: rank
1's main thread takes batches 0-2 and then waits in ``Queue.get`` for batch 3, and ranks 0, 2 wait
in step 3's ``all_reduce`` until the gloo timeout.

    torchrun --nproc-per-node 3 examples/bugs/prefetch_thread_died_queue.py
"""

import os
import queue
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "rank-failed", "culprits": [1], "world": 3,
         "why": "rank 1's prefetch thread raised ValueError on a truncated record (batch 3) and died; its main thread waits in queue.get() for a batch that never comes"}

STEPS, DIM = 8, 128


def read_record(rank, i):
    payload = bytes((rank * 31 + i * 7 + j) % 256 for j in range(DIM))
    return payload[:DIM // 2] if (rank, i) == (1, 3) else payload  # rank 1's shard: a truncated record


def decode(raw):
    if len(raw) != DIM:
        raise ValueError(f"truncated record: {len(raw)} of {DIM} bytes")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).float() / 255.0


def prefetch(rank, out):
    for i in range(STEPS):
        out.put(decode(read_record(rank, i)))  # an exception here ends the thread, silently for the consumer


def main():
    rank, world = init()
    batches = queue.Queue(maxsize=2)
    threading.Thread(target=prefetch, args=(rank, batches), name=f"prefetch-{rank}", daemon=True).start()
    w = torch.zeros(DIM)
    for step in range(STEPS):
        if step == 3:
            hang_point(rank, "queue.get" if rank == 1 else "all_reduce")
        x = batches.get()  # the bug: no timeout, and the producer's failure never reaches the queue
        grad = (w - x.to(w.device)) * 0.5  # (decoded on the prefetch thread: on the CPU)
        dist.all_reduce(grad)
        w -= 0.1 * grad / world
        progress(rank, step)
    finish()


if __name__ == "__main__":
    main()
