"""2-stage pipeline: stage 1 sends the loss "back" with ``dst=self.rank`` (a typo); rank 0 waits in recv.

Rank 0 runs the first half of the model and sends activations to rank 1, which computes the loss
and sends the activation gradient back. Every ``LOG_EVERY`` steps stage 1 also sends the loss to
stage 0, which does the logging; that call was written ``dst=self.rank`` instead of
``dst=self.prev``. It first runs at step 3. ``torch.distributed.send`` rejects a send to one's own
rank before any communication: rank 1 raises ``ValueError: Invalid destination rank`` and exits,
and rank 0, waiting in ``recv(src=1)`` for the loss, fails when the connection to rank 1 closes
(or the launcher stops it). Measured on gloo: the job dies in under a second.

    torchrun --nproc-per-node 2 examples/bugs/pipeline2_loss_send_self.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "rank-failed", "culprits": [1], "world": 2,
         "why": "stage 1 sent the loss with dst=self.rank (itself) at step 3; torch.distributed.send raised ValueError on rank 1, which exited while rank 0 waited in recv(src=1)"}

BATCH, DIM, LOG_EVERY = 8, 64, 3


class Stage:
    def __init__(self, rank):
        self.rank, self.prev, self.next = rank, rank - 1, rank + 1
        torch.manual_seed(rank)
        self.layer = torch.nn.Linear(DIM, DIM)
        self.opt = torch.optim.SGD(self.layer.parameters(), lr=0.01)

    def step(self, step):
        self.opt.zero_grad()
        if self.rank == 0:
            x = torch.randn(BATCH, DIM, generator=torch.Generator().manual_seed(step), device="cpu").to(torch.get_default_device())
            act = self.layer(x)
            dist.send(act.detach(), dst=self.next)
            grad = torch.empty_like(act)
            dist.recv(grad, src=self.next)
            act.backward(grad)
            if step % LOG_EVERY == 0 and step > 0:
                loss = torch.empty(1)
                hang_point(self.rank, f"recv(src={self.next}) of the loss")
                dist.recv(loss, src=self.next)
                print(f"step {step} loss {loss.item():.4f}", flush=True)
        else:
            act = torch.empty(BATCH, DIM, requires_grad=True)
            dist.recv(act.data, src=self.prev)
            loss = self.layer(act).pow(2).mean()
            loss.backward()
            dist.send(act.grad, dst=self.prev)
            if step % LOG_EVERY == 0 and step > 0:
                hang_point(self.rank, "send(dst=1) of the loss, to itself (raises)")
                dist.send(loss.detach().reshape(1), dst=self.rank)  # the bug: should be dst=self.prev
        self.opt.step()


def main():
    rank, world = init()
    stage = Stage(rank)
    for step in range(8):
        stage.step(step)
        progress(rank, step)
    finish()


if __name__ == "__main__":
    main()
