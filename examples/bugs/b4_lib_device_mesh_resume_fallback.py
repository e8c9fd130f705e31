"""DeviceMesh built by only three of four ranks: rank 3's TP shard is truncated and it "falls back" to DDP.

A 2 x 2 job (data parallel x tensor parallel) resumes from Megatron-style per-rank shards
``mp_rank_XX.pt`` that the previous job wrote; rank 3 was preempted while writing its shard, so its
file is truncated. Start-up is wrapped in a "graceful" fallback::

    try:
        shard = torch.load(f"mp_rank_{rank:02d}.pt")      # rank 3: RuntimeError (truncated zip)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = parallelize_module(...)                    # ColwiseParallel / RowwiseParallel
    except (OSError, RuntimeError):
        model = DDP(full_model)                            # "start a fresh data-parallel run"

Ranks 0, 1, 2 load their shards and enter ``init_device_mesh``, which creates one gloo subgroup per
mesh row and column with ``new_group``; a gloo group connects all its members, so each of them waits
for a peer that is either rank 3 or itself waiting for rank 3 (rank 1 in ``[1, 3]`` of "dp", rank 0
in ``[0, 1]`` and rank 2 in ``[2, 3]`` of "tp"). Rank 3 takes the except branch and constructs
``DistributedDataParallel``, whose constructor runs collectives on the world group (parameter-shape
check ``_verify_param_shape_across_processes``, then ``_sync_module_states``) that nobody else
joins. All four ranks are stuck inside torch: rank 3 until the gloo timeout (then it raises and
torchrun ends the job), ranks 0-2 in group creation (torn down by torchrun when rank 3 fails).

    torchrun --nproc-per-node 4 examples/bugs/b4_lib_device_mesh_resume_fallback.py
"""

import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "collective-mismatch", "culprits": [3], "world": 4,
         "why": "rank 3's resume shard mp_rank_03.pt is truncated; torch.load raises and the except branch "
                "skips init_device_mesh and builds DDP (world-group collectives in its constructor), while "
                "ranks 0-2 wait in init_device_mesh's new_group for the subgroups that contain rank 3"}

DIM = 32
HIDDEN = 64
TP = 2
STEPS = 6


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(DIM, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def previous_job_save(ckpt_dir, rank):
    """What the previous job left behind: one shard per rank; rank 3's write was cut off."""
    tp_rank = rank % TP
    g = torch.Generator().manual_seed(5)
    full = {"fc1.weight": torch.randn(HIDDEN, DIM, generator=g) * 0.1, "fc1.bias": torch.zeros(HIDDEN),
            "fc2.weight": torch.randn(DIM, HIDDEN, generator=g) * 0.1, "fc2.bias": torch.zeros(DIM)}
    shard = {"fc1.weight": full["fc1.weight"].chunk(TP, 0)[tp_rank].clone(),
             "fc1.bias": full["fc1.bias"].chunk(TP, 0)[tp_rank].clone(),
             "fc2.weight": full["fc2.weight"].chunk(TP, 1)[tp_rank].clone(),
             "fc2.bias": full["fc2.bias"], "step": 1200}
    path = os.path.join(ckpt_dir, f"mp_rank_{rank:02d}.pt")
    torch.save(shard, path)
    if rank == 3:  # preempted mid-write: only the first part of the file reached the disk
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 3)


def load_tp_model(ckpt_dir, rank):
    shard = torch.load(os.path.join(ckpt_dir, f"mp_rank_{rank:02d}.pt"), weights_only=True)
    hang_point(rank, "init_device_mesh: new_group for the dp/tp subgroups")
    mesh = init_device_mesh(torch.get_default_device().type, (dist.get_world_size() // TP, TP), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(MLP(), mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.copy_(shard[name])
    return model, mesh["dp"].get_group(), shard["step"]


def main():
    rank, world = init()
    holder = [tempfile.mkdtemp(prefix="b4-lib-mesh-resume-") if rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    ckpt_dir = holder[0]
    try:
        previous_job_save(ckpt_dir, rank)
        dist.barrier()  # the previous job's files are in place
        try:
            model, dp_group, start = load_tp_model(ckpt_dir, rank)
        except (OSError, RuntimeError) as e:  # the bug: a local fallback around collective set-up
            print(f"rank {rank}: cannot resume tensor-parallel run ({str(e).splitlines()[0]}); "
                  "starting a fresh data-parallel run", flush=True)
            hang_point(rank, "DDP constructor: _verify_param_shape_across_processes on the world group")
            model, dp_group, start = DDP(MLP()), None, 0
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for step in range(start, start + STEPS):
            g = torch.Generator().manual_seed(step * 10 + rank // TP)
            x = torch.randn(8, DIM, generator=g)
            loss = (model(x) - x).pow(2).mean()
            loss.backward()
            if dp_group is not None:
                for p in model.parameters():
                    grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                    dist.all_reduce(grad, group=dp_group)
                    grad /= dist.get_world_size(dp_group)
            opt.step()
            opt.zero_grad()
            progress(rank, step)
    finally:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    finish()


if __name__ == "__main__":
    main()
