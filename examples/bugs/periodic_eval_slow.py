"""Slow, not hung: rank 1 runs a 20 s generation eval every 10 steps (twice) under an 8 s hang timeout.

Rank 1, the last rank, owns the generation benchmark: every 10 steps it samples answers from the
model and has a scoring service grade them, 20 s each time, while rank 0 waits in the next step's
``all_reduce``. Both times the job resumes; it has 21 steps and ends normally about 45 s after
start. A verdict that blames rank 1 for a hang and is never retracted is wrong, once or twice.
(``EVAL_SECONDS`` changes the 20 s; keep it 2.5 times the hang timeout.)

    torchrun --nproc-per-node 2 examples/bugs/periodic_eval_slow.py
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "slow-not-hung", "culprits": [], "world": 2, "slow": [1],
         "why": "rank 1 runs a 20 s generation eval after steps 9 and 19; the job then finishes"}

EVAL_EVERY = 10


def generation_eval(weights, seconds):
    deadline, scores = time.monotonic() + seconds, []
    prompt = torch.randn(4, 64)
    while time.monotonic() < deadline:
        tokens = torch.tanh(prompt @ weights.view(64, 64)).argmax(-1)  # one decoding step
        time.sleep(0.2)  # the scoring service answers
        scores.append(float(tokens.float().mean()))
    return sum(scores) / max(1, len(scores))


def main():
    rank, world = init()
    weights = torch.randn(64 * 64) * 0.1
    dist.broadcast(weights, src=0)
    seconds = float(os.environ.get("EVAL_SECONDS", "20"))
    eval_rank = world - 1
    for step in range(2 * EVAL_EVERY + 1):
        if step == EVAL_EVERY and rank != eval_rank:
            hang_point(rank, "all_reduce (waits for the eval)")
        grad = torch.randn(64 * 64) * 1e-3
        dist.all_reduce(grad)
        weights -= grad / world
        progress(rank, step)
        if rank == eval_rank and (step + 1) % EVAL_EVERY == 0:
            if step + 1 == EVAL_EVERY:
                hang_point(rank, f"generation eval ({seconds:.0f} s)")
            score = generation_eval(weights, seconds)
            print(f"step {step}: generation score {score:.2f}", flush=True)
    finish()


if __name__ == "__main__":
    main()
