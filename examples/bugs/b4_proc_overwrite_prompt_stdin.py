"""Rank 1 blocks in ``input()`` on an "overwrite? [y/N]" prompt when it saves its checkpoint shard.

Each rank saves its shard of the checkpoint (model replica checksum, optimizer state, RNG state)
to its node-local scratch every 3 steps, then the ranks agree in an ``all_reduce`` that every shard
was written before the checkpoint is marked complete. ``save_shard`` refuses to clobber an existing
directory silently: it asks ``input("... exists, overwrite? [y/N] ")``, a convenience meant for
interactive runs. The previous attempt of this job was preempted while saving step 5: rank 1's node
had already created ``step_000005/``, rank 0's had not. The requeued attempt resumes from the last
complete checkpoint (step 2), trains steps 3 to 5 again, and at step 5 rank 1 finds the stale
directory and prompts. Its stdin is the launcher's pipe (``srun``/a wrapper script that keeps it
open, modelled here by a FIFO this scenario opens read-write); nobody ever answers, rank 1 blocks in
``read()``, rank 0 waits in the ``all_reduce``.

    torchrun --nproc-per-node 2 examples/bugs/b4_proc_overwrite_prompt_stdin.py
"""

import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "collective-mismatch", "culprits": [1], "world": 2,
         "why": "rank 1 blocks reading stdin in input() (overwrite prompt for a stale step_000005 dir left "
                "by the preempted attempt on its node); rank 0 waits in the checkpoint all_reduce"}

SAVE_EVERY = 3
STEPS = 8
# What the preempted previous attempt left on the nodes' scratch disks: step 2 complete everywhere,
# step 5 half-written (the node of rank 1 had created its directory when the job was killed).
PREVIOUS_ATTEMPT = {"complete": [2], "partial": {5: [1]}}


def job_tmpdir(tag):
    """Scratch shared by this job's ranks (one torchrun agent: the parent pid); any rank's ``finally`` removes it."""
    base = os.path.join(tempfile.gettempdir(), f"b4-proc-{tag}-{os.getppid()}")
    os.makedirs(base, exist_ok=True)
    return base


def attach_launcher_stdin(base, rank):
    """The launcher keeps each task's stdin open as a pipe that nobody writes to (srun, a tee wrapper).

    Under a plain ``torchrun ... < /dev/null`` stdin would be at EOF and ``input()`` would raise; the
    real job's stdin is an open, silent pipe, modelled by a FIFO opened read-write.
    """
    fifo = os.path.join(base, f"stdin-{rank}")
    os.mkfifo(fifo)
    sys.stdin = os.fdopen(os.open(fifo, os.O_RDWR), "r")


def ckpt_dir(scratch, step):
    return os.path.join(scratch, "ckpt", f"step_{step:06d}")


def replay_previous_attempt(scratch, rank, model, opt):
    for step in PREVIOUS_ATTEMPT["complete"]:
        os.makedirs(ckpt_dir(scratch, step))
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step},
                   os.path.join(ckpt_dir(scratch, step), f"rank{rank}.pt"))
        open(os.path.join(ckpt_dir(scratch, step), "COMPLETE"), "w").close()
    for step, ranks in PREVIOUS_ATTEMPT["partial"].items():
        if rank in ranks:
            os.makedirs(ckpt_dir(scratch, step))


def latest_complete(scratch):
    root = os.path.join(scratch, "ckpt")
    done = [int(d.split("_")[1]) for d in os.listdir(root) if os.path.exists(os.path.join(root, d, "COMPLETE"))]
    return max(done) if done else -1


def save_shard(scratch, rank, step, model, opt):
    path = ckpt_dir(scratch, step)
    if os.path.isdir(path):
        answer = input(f"[rank {rank}] checkpoint {path} exists, overwrite? [y/N] ")  # the bug: a prompt in a batch job
        if answer.strip().lower() != "y":
            return False
        shutil.rmtree(path)
    os.makedirs(path)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                "rng": torch.get_rng_state()}, os.path.join(path, f"rank{rank}.pt"))
    return True


def main():
    rank, world = init()
    base = job_tmpdir("ckpt")
    try:
        attach_launcher_stdin(base, rank)
        scratch = tempfile.mkdtemp(prefix=f"node-of-rank{rank}-", dir=base)  # node-local scratch
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        replay_previous_attempt(scratch, rank, model, opt)
        start = latest_complete(scratch) + 1
        state = torch.load(os.path.join(ckpt_dir(scratch, start - 1), f"rank{rank}.pt"))
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        gen = torch.Generator().manual_seed(1000 + rank)
        dev = next(model.parameters()).device
        for step in range(start, STEPS):
            x = torch.randn(8, 16, generator=gen, device="cpu").to(dev)
            y = x[:, :1] * 0.5
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
            opt.step()
            if step % SAVE_EVERY == SAVE_EVERY - 1:
                if step == 5 and rank == 1:
                    hang_point(rank, "input() overwrite prompt, reads stdin")
                ok = save_shard(scratch, rank, step, model, opt)
                flag = torch.tensor([1 if ok else 0])
                if step == 5 and rank != 1:
                    hang_point(rank, "all_reduce checkpoint flags")
                dist.all_reduce(flag, op=dist.ReduceOp.MIN)
                if flag.item() == 1:
                    open(os.path.join(ckpt_dir(scratch, step), "COMPLETE"), "w").close()
            progress(rank, step)
        finish()
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
