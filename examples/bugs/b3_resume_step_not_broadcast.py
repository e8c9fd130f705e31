"""Two ranks, no majority: after a resume only rank 0 restores the step counter, so the ranks log at different steps.

A 2-rank data-parallel job checkpoints and resumes (the preemption is modelled in one launch: after
6 steps the trainer saves, is thrown away, and a fresh ``Trainer`` resumes from the checkpoint).
``Trainer.resume`` follows the usual "load on rank 0, broadcast the weights" recipe: rank 0 reads
the checkpoint, restores the weights and ``self.step``, and broadcasts the parameters. The step
counter is never broadcast, so rank 1 resumes at step 0 while rank 0 resumes at step 6. Every
``LOG_EVERY`` (4) steps the trainer all-gathers the per-rank gradient norms: rank 0 reaches step 8
after two steps and waits in ``all_gather``; rank 1 is at its step 2 and goes on to the next step's
gradient ``all_reduce``.

    torchrun --nproc-per-node 2 examples/bugs/b3_resume_step_not_broadcast.py
"""

import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "collective-mismatch", "culprits": [1], "world": 2,
         "why": "after the resume rank 1's step counter restarts at 0 (only rank 0 loads the checkpoint and "
                "the step is not broadcast): rank 0 all_gathers grad norms at its step 8, rank 1 all_reduces "
                "the next step's gradients"}

FEATURES = 32
LOG_EVERY = 4
SEGMENTS = (6, 8)  # steps before the preemption, steps after the resume
HANG_ITER = 7  # the loop iteration (over both segments) whose logging does not match


class Trainer:
    def __init__(self, rank, world):
        self.rank, self.world = rank, world
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.step = 0

    def save(self, ckpt_dir):
        if self.rank == 0:
            torch.save({"model": self.model.state_dict(), "opt": self.opt.state_dict(), "step": self.step},
                       os.path.join(ckpt_dir, "last.pt"))
        dist.barrier()

    def resume(self, ckpt_dir):
        if self.rank == 0:  # only rank 0 reads the file ...
            ckpt = torch.load(os.path.join(ckpt_dir, "last.pt"))
            self.model.load_state_dict(ckpt["model"])
            self.opt.load_state_dict(ckpt["opt"])
            self.step = ckpt["step"]
        for p in self.model.parameters():  # ... and broadcasts the weights; the bug: not self.step
            dist.broadcast(p.data, src=0)

    def train_step(self, x, y):
        loss = torch.nn.functional.mse_loss(self.model(x).squeeze(1), y)
        self.opt.zero_grad()
        loss.backward()
        grads = [p.grad for p in self.model.parameters()]
        local_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).reshape(1)
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= self.world
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        self.opt.step()
        self.step += 1
        return loss.detach(), local_norm

    def log(self, loss, local_norm):
        norms = [torch.zeros_like(local_norm) for _ in range(self.world)]
        dist.all_gather(norms, local_norm)
        if self.rank == 0:
            print(f"step={self.step} loss={loss.item():.4f} grad_norm_per_rank={[round(n.item(), 3) for n in norms]}",
                  flush=True)


def data(rank, i):
    g = torch.Generator().manual_seed(7919 * i + rank)
    x = torch.randn(32, FEATURES, generator=g, device="cpu")
    return x.to(torch.get_default_device()), x.sum(1).to(torch.get_default_device())


def main():
    rank, world = init()
    ckpt_dir = tempfile.mkdtemp(prefix=f"b3-resume-{rank}-")
    it = 0
    try:
        trainer = Trainer(rank, world)
        for segment, steps in enumerate(SEGMENTS):
            if segment > 0:  # preempted and restarted: a fresh trainer resumes from the checkpoint
                trainer = Trainer(rank, world)
                trainer.resume(ckpt_dir)
            for _ in range(steps):
                if it == HANG_ITER + 1 and rank == 1:
                    hang_point(rank, "all_reduce (gradients)")
                loss, local_norm = trainer.train_step(*data(rank, it))
                if trainer.step % LOG_EVERY == 0:
                    if it == HANG_ITER:
                        hang_point(rank, "all_gather (grad norms)")
                    trainer.log(loss, local_norm)
                progress(rank, it)
                it += 1
            trainer.save(ckpt_dir)
    finally:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    finish()


if __name__ == "__main__":
    main()
