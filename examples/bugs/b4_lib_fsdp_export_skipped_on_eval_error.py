"""FSDP2: a metric error on rank 1 jumps over the full-state-dict export that the other ranks enter.

A small MLP is sharded with ``fully_shard`` (FSDP2) over a 1-D ``DeviceMesh`` of 4 CPU ranks.
Every ``EVAL_EVERY`` steps each rank evaluates its validation shard and, in the same ``try`` block,
the job exports a consolidated copy of the weights with ``get_model_state_dict(model,
options=StateDictOptions(full_state_dict=True, cpu_offload=True))`` (rank 0 serializes it for
upload). Getting the full state dict all-gathers every sharded parameter (DTensor
``full_tensor()``), so every rank must call it. At the first evaluation (after step 2) rank 1's
validation shard has a label outside the class range: the hand-written confusion matrix raises
``ValueError`` after the forward passes, and the ``except ValueError`` that logs "eval failed,
skipping export" also skips the export. Rank 1 goes on to step 3's forward, where FSDP all-gathers
the first layer's parameters (``FSDPParamGroup.unshard``), while ranks 0, 2, 3 all-gather
``0.weight`` in ``get_model_state_dict``. Both are gloo all-gathers, of different sizes: gloo
matches them and aborts rank 2, which receives from rank 1, within a second (``SIGABRT``,
"op.preamble.length <= op.nbytes. 600 vs 576. Received data size doesn't match expected size");
ranks 1 and 3 then fail with "Connection reset by peer" and torchrun ends the job. The rank that
dies first (2) is not the one whose code went wrong (1).

    torchrun --nproc-per-node 4 examples/bugs/b4_lib_fsdp_export_skipped_on_eval_error.py
"""

import io
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "collective-mismatch", "culprits": [1], "world": 4,
         "why": "rank 1's confusion matrix raises ValueError in the eval after step 2 (a label out of "
                "range); the except skips get_model_state_dict(full_state_dict=True), so rank 1 all-gathers "
                "in step 3's FSDP forward while ranks 0, 2, 3 all-gather in get_model_state_dict; gloo "
                "aborts rank 2 (size mismatch with rank 1's all-gather) within a second"}

DIM = 24
HIDDEN = 48
CLASSES = 5
STEPS = 8
EVAL_EVERY = 3


def batch(rank, step, n=16, split="train"):
    g = torch.Generator().manual_seed({"train": 0, "val": 1}[split] * 100_000 + 1000 * rank + step)
    x = torch.randn(n, DIM, generator=g)
    y = (x[:, :CLASSES] * 2).argmax(1)
    if split == "val" and rank == 1 and step == 1:
        y[5] = CLASSES  # a label of a class that was dropped from this release of the label map
    return x, y


def confusion_matrix(pred, target, classes):
    if target.min() < 0 or target.max() >= classes:
        raise ValueError(f"target label {int(target.max())} outside [0, {classes})")
    cm = torch.zeros(classes, classes, dtype=torch.long)
    cm.index_put_((target, pred), torch.ones_like(target), accumulate=True)
    return cm


@torch.no_grad()
def evaluate(model, rank):
    cm = torch.zeros(CLASSES, CLASSES, dtype=torch.long)
    for i in range(2):
        x, y = batch(rank, i, split="val")
        pred = model(x).argmax(1)
        cm += confusion_matrix(pred, y, CLASSES)
    return cm.diag().sum().item() / cm.sum().item()


def main():
    rank, world = init()
    torch.manual_seed(0)
    mesh = init_device_mesh(torch.get_default_device().type, (world,), mesh_dim_names=("fsdp",))
    model = torch.nn.Sequential(
        torch.nn.Linear(DIM, HIDDEN), torch.nn.GELU(), torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.GELU(),
        torch.nn.Linear(HIDDEN, CLASSES))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    exported_eval = False
    uploads = []
    for step in range(STEPS):
        if step == EVAL_EVERY and not exported_eval:
            hang_point(rank, "FSDP forward: all_gather_into_tensor in unshard (step 3)")
        x, y = batch(rank, step)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        progress(rank, step)
        if (step + 1) % EVAL_EVERY == 0:
            exported_eval = False
            try:
                acc = evaluate(model, rank)
                print(f"rank {rank} step {step}: val acc {acc:.3f}", flush=True)
                if step + 1 == EVAL_EVERY:
                    hang_point(rank, "get_model_state_dict(full_state_dict=True): DTensor all_gather")
                full = get_model_state_dict(
                    model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
                if rank == 0:
                    buf = io.BytesIO()
                    torch.save(full, buf)
                    uploads.append((f"export-step{step}.pt", buf.getvalue()))  # handed to the uploader
                exported_eval = True
            except ValueError as e:  # the bug: the export in the same try block is skipped too
                print(f"rank {rank}: eval failed ({e}), skipping export", flush=True)
    finish()


if __name__ == "__main__":
    main()
