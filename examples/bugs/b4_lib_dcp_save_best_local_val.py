"""DCP "save the best checkpoint" decided on each rank's *local* val accuracy: rank 2 skips ``dcp.save``.

A classifier is trained with ``DistributedDataParallel`` on 4 ranks. After each epoch every rank
evaluates its own validation shard and keeps the best checkpoint with
``if acc > best_acc: dcp.save(state, checkpoint_id=ckpt_dir)`` (``torch.distributed.checkpoint``).
``dcp.save`` is collective: it gathers every rank's save plan on the coordinator (``gather_object``,
which starts with an ``all_gather`` of the pickled sizes), scatters the final plans, and gathers the
write results. The accuracy is not all-reduced, so the decision is rank-local: after epoch 1 the
accuracy on rank 2's shard is no higher than after epoch 0 (it ties), and rank 2 alone skips the
save. Ranks 0, 1, 3 wait in ``dcp.save``'s plan ``gather_object`` while rank 2 runs epoch 2's first
step and waits in DDP's bucket ``all_reduce`` (issued by the reducer during ``backward()``). Under
gloo the two ops do not match: all four ranks stay stuck until the gloo timeout.

    torchrun --nproc-per-node 4 examples/bugs/b4_lib_dcp_save_best_local_val.py
"""

import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "collective-mismatch", "culprits": [2], "world": 4,
         "why": "after epoch 1 rank 2's local val accuracy does not beat its best (a tie) and it skips "
                "dcp.save; it waits in epoch 2's DDP bucket all_reduce while ranks 0, 1, 3 wait in "
                "dcp.save's plan gather_object (all_gather of sizes)"}

SEED = 24
DIM = 10
CLASSES = 4
BATCH = 16
STEPS_PER_EPOCH = 5
EPOCHS = 3


def data(rank, split, epoch, step):
    g = torch.Generator().manual_seed(
        SEED * 1_000_003 + {"train": 0, "val": 7}[split] * 10007 + rank * 101 + epoch * 13 + step)
    x = torch.randn(BATCH, DIM, generator=g)
    y = (x[:, :CLASSES] + 0.5 * torch.randn(BATCH, CLASSES, generator=g)).argmax(1)
    return x, y


@torch.no_grad()
def local_val_accuracy(model, rank):
    model.eval()
    accs = []
    for i in range(2):
        x, y = data(rank, "val", 0, i)
        accs.append((model(x).argmax(1) == y).float().mean().item())
    model.train()
    return sum(accs) / len(accs)


def shared_ckpt_dir(rank):
    """Rank 0 makes the run's checkpoint directory and tells the others."""
    holder = [tempfile.mkdtemp(prefix="b4-lib-dcp-best-") if rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def main():
    rank, world = init()
    torch.manual_seed(0)
    ckpt_dir = shared_ckpt_dir(rank)
    net = torch.nn.Sequential(torch.nn.Linear(DIM, 32), torch.nn.ReLU(), torch.nn.Linear(32, CLASSES))
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    best_acc = -1.0
    saved_last = True
    step = 0
    try:
        for epoch in range(EPOCHS):
            for i in range(STEPS_PER_EPOCH):
                x, y = data(rank, "train", epoch, i)
                loss = torch.nn.functional.cross_entropy(model(x), y)
                if epoch == 2 and i == 0 and not saved_last:
                    hang_point(rank, "DDP backward: reducer bucket all_reduce (epoch 2, step 0)")
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                progress(rank, step)
                step += 1
            acc = local_val_accuracy(model, rank)
            print(f"rank {rank} epoch {epoch}: local val acc {acc:.4f} (best {best_acc:.4f})", flush=True)
            saved_last = False
            if acc > best_acc:  # the bug: a rank-local decision around a collective save
                best_acc = acc
                state = {"model": model.module.state_dict(), "optim": opt.state_dict(),
                         "epoch": epoch, "val_acc": acc}
                if epoch == 1:
                    hang_point(rank, "dcp.save: plan gather_object (all_gather of sizes)")
                dcp.save(state, checkpoint_id=ckpt_dir)
                saved_last = True
    finally:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    finish()


if __name__ == "__main__":
    main()
