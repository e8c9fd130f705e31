"""An overlapped gradient-reduction thread picks dense or sparse reduction of the embedding gradient per rank.

A data-parallel language model with a sparse embedding (``nn.Embedding(sparse=True)``) reduces its
gradients on a communication thread, as DDP/DeepSpeed overlap does: the main thread hands each
gradient to the thread after backward; dense gradients are all-reduced with ``async_op=True`` and
waited later; the sparse embedding gradient goes through ``_reduce_sparse``, which all-gathers the
touched rows (``all_gather`` of the row counts, then of indices and values) unless the gradient is
"dense enough", in which case a dense ``all_reduce`` is cheaper. That choice is made from the
rank's own gradient. At step 3 rank 1's batch (a code file, tokens spread over the whole
vocabulary) touches 22 % of the rows: rank 1's thread calls ``all_reduce`` on the dense matrix
while the threads of ranks 0, 2 and 3 call ``all_gather`` on the row counts. Every main thread
waits in ``queue.get()`` for its thread's result.

    torchrun --nproc-per-node 4 examples/bugs/b3_sparse_grad_comm_thread.py
"""

import os
import queue
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "collective-mismatch", "culprits": [1], "world": 4,
         "why": "at step 3 rank 1's comm thread finds its embedding gradient dense (rank-local density 0.22 > 0.1) "
                "and all_reduces it, while the other ranks' comm threads all_gather the sparse row counts"}

VOCAB = 512
DIM = 16
TOKENS = 128
DENSE_THRESHOLD = 0.1
STEPS = 8
HANG_STEP = 3


class OverlappedReducer:
    """Averages gradients over the ranks on a background thread while the main thread goes on."""

    def __init__(self, world):
        self.world = world
        self.todo, self.done = queue.Queue(), queue.Queue()
        threading.Thread(target=self._run, name="grad-comm", daemon=True).start()

    def submit(self, name, grad):
        self.todo.put((name, grad))

    def wait(self):
        self.todo.put(None)
        result = self.done.get()  # the main thread waits for the step's reductions
        if isinstance(result, BaseException):
            raise RuntimeError("gradient communication thread failed") from result
        return result

    def _run(self):
        try:
            self._loop()
        except BaseException as exc:  # hand the error (e.g. the collective timeout) to the main thread
            self.done.put(exc)

    def _loop(self):
        while True:
            pending, reduced = [], {}
            for name, grad in iter(self.todo.get, None):
                if grad.is_sparse:
                    reduced[name] = self._reduce_sparse(grad)
                else:
                    pending.append((name, grad, dist.all_reduce(grad, async_op=True)))
            for name, grad, work in pending:
                work.wait()
                reduced[name] = grad / self.world
            self.done.put(reduced)

    def _reduce_sparse(self, grad):
        grad = grad.coalesce()
        rows, values = grad.indices()[0], grad.values()
        if rows.numel() / grad.shape[0] > DENSE_THRESHOLD:  # the bug: decided from this rank's gradient only
            dense = grad.to_dense()
            dist.all_reduce(dense)
            return dense / self.world
        device = values.device  # a thread does not inherit the default device
        count = torch.tensor([rows.numel()], device=device)
        counts = [torch.zeros_like(count) for _ in range(self.world)]
        dist.all_gather(counts, count)
        most = int(max(c.item() for c in counts))
        rows_pad = torch.zeros(most, dtype=rows.dtype, device=device)
        values_pad = torch.zeros(most, grad.shape[1], dtype=values.dtype, device=device)
        rows_pad[:rows.numel()], values_pad[:rows.numel()] = rows, values
        all_rows = [torch.empty_like(rows_pad) for _ in range(self.world)]
        all_values = [torch.empty_like(values_pad) for _ in range(self.world)]
        dist.all_gather(all_rows, rows_pad)
        dist.all_gather(all_values, values_pad)
        dense = torch.zeros(grad.shape, dtype=values.dtype, device=device)
        for c, r, v in zip(counts, all_rows, all_values):
            dense.index_add_(0, r[:int(c.item())], v[:int(c.item())])
        return dense / self.world


class BagOfWordsLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM, sparse=True)
        self.out = torch.nn.Linear(DIM, 4)

    def forward(self, tokens):
        return self.out(self.embed(tokens).mean(0, keepdim=True))


def batch(rank, step):
    """Prose uses a few dozen frequent tokens here; rank 1's step-3 document is source code."""
    g = torch.Generator().manual_seed(31 * step + rank)
    high = VOCAB if (rank == 1 and step == HANG_STEP) else 40
    tokens = torch.randint(high, (TOKENS,), generator=g, device="cpu")
    label = torch.randint(4, (1,), generator=g, device="cpu")
    return tokens.to(torch.get_default_device()), label.to(torch.get_default_device())


def main():
    rank, world = init()
    torch.manual_seed(0)
    model = BagOfWordsLM()
    reducer = OverlappedReducer(world)
    for step in range(STEPS):
        tokens, label = batch(rank, step)
        loss = torch.nn.functional.cross_entropy(model(tokens), label)
        model.zero_grad()
        loss.backward()
        for name, p in reversed(list(model.named_parameters())):
            reducer.submit(name, p.grad)
        if step == HANG_STEP:
            hang_point(rank, "queue.get() (comm thread: all_reduce dense embedding grad)" if rank == 1
                       else "queue.get() (comm thread: all_gather sparse row counts)")
        reduced = reducer.wait()
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.sub_(0.1 * reduced[name])
        progress(rank, step)
    finish()


if __name__ == "__main__":
    main()
