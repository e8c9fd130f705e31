"""Rank 0 deadlocks with its own metadata subprocess: ``Popen(stdout=PIPE)``, then ``wait()`` before reading.

Rank 0 is the logging rank: every 3 steps it records the run's code state (the untracked and
modified files of the working tree, as ``git status --porcelain --untracked-files=all`` prints them)
next to the loss. ``collect_code_state`` starts the helper with ``stdout=subprocess.PIPE`` and calls
``proc.wait()`` before ``proc.stdout.read()``. Meanwhile every rank writes its evaluation
generations into ``outputs/`` inside the same working tree (the run directory was left inside the
checkout), so the listing grows every step: at step 0 it is 22 to 44 KB (256 to 512 files) and fits
in the 64 KiB pipe buffer; at step 3 it is over 88 KB (1024 files or more), the helper blocks in
``write()`` on the full pipe, and rank 0 blocks in ``waitpid()`` for a child that can never finish.
Ranks 1-3 go on to step 4's gradient ``all_reduce`` and wait there. (The helper is a small Python
stand-in for ``git status``, so that the scenario does not need git.)

    torchrun --nproc-per-node 4 examples/bugs/b4_proc_git_status_pipe_wait.py
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "collective-mismatch", "culprits": [0], "world": 4,
         "why": "rank 0 blocks in Popen.wait() on its git-status helper, which blocks writing to the full, "
                "unread stdout pipe (88+ KB listing at step 3); ranks 1-3 wait in step 4's all_reduce"}

STEPS = 7
LOG_EVERY = 3
GENERATIONS = 64  # eval generations written per rank and step
VOCAB = 100

# Stand-in for `git status --porcelain --untracked-files=all`: one line per untracked file.
GIT_STATUS = r"""
import os, sys
root = sys.argv[1]
for d, subdirs, files in os.walk(root):
    subdirs.sort()
    if ".git" in subdirs:
        subdirs.remove(".git")
    for f in sorted(files):
        rel = os.path.relpath(os.path.join(d, f), root)
        if rel not in ("train.py", "README.md"):
            print("?? " + rel)
"""


def job_tmpdir(tag):
    """Scratch shared by this job's ranks (one torchrun agent: the parent pid); any rank's ``finally`` removes it."""
    base = os.path.join(tempfile.gettempdir(), f"b4-proc-{tag}-{os.getppid()}")
    os.makedirs(base, exist_ok=True)
    return base


def collect_code_state(checkout):
    proc = subprocess.Popen([sys.executable, "-c", GIT_STATUS, checkout], stdout=subprocess.PIPE)
    proc.wait()  # the bug: waits for the child before draining its stdout (use communicate())
    lines = proc.stdout.read().decode().splitlines()
    return {"untracked": len(lines), "dirty": bool(lines)}


def write_generations(checkout, rank, step, logits):
    out = os.path.join(checkout, "outputs", "samples", f"step_{step:06d}", f"rank{rank}")
    os.makedirs(out, exist_ok=True)
    tokens = logits.argmax(-1).tolist()
    for i in range(GENERATIONS):
        name = f"generation_{i:04d}_temp0.7_topp0.9_maxlen128.jsonl"
        with open(os.path.join(out, name), "w") as f:
            f.write(json.dumps({"step": step, "tokens": tokens[i % len(tokens)][:8]}) + "\n")


def main():
    rank, world = init()
    checkout = job_tmpdir("checkout")
    try:
        if rank == 0:
            os.makedirs(os.path.join(checkout, ".git"), exist_ok=True)
            for name in ("train.py", "README.md"):
                open(os.path.join(checkout, name), "w").close()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(VOCAB, 32), nn.Linear(32, VOCAB))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(rank)
        dev = next(model.parameters()).device
        for step in range(STEPS):
            tokens = torch.randint(0, VOCAB, (8, 17), generator=gen, device="cpu").to(dev)
            logits = model(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            with torch.no_grad():
                write_generations(checkout, rank, step, logits)
            if step == 4 and rank != 0:
                hang_point(rank, "all_reduce gradients (step 4)")
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
            opt.step()
            if rank == 0 and step % LOG_EVERY == 0:
                if step == 3:
                    hang_point(rank, "Popen.wait() on the git-status helper (stdout pipe full)")
                meta = collect_code_state(checkout)
                print(f"[rank 0] step {step} loss {loss.item():.3f} code {meta}", flush=True)
            progress(rank, step)
        finish()
    finally:
        shutil.rmtree(checkout, ignore_errors=True)


if __name__ == "__main__":
    main()
