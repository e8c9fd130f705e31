"""Exercise the recorder on every kind of call, then exit normally (records dumped at exit).

    torchrun --nproc-per-node 3 examples/records/fidelity.py

Used by tests/test_recorder_fidelity.py; the ``# mark:`` comments let the test find call-site lines.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from hangdoc.runtime import recorder  # noqa: E402

rec = recorder.enable(capacity=1000, out_dir=os.environ.get("HANGDOC_OUT", "hangdoc-out"))
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()


class AllReduceInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, g):
        dist.all_reduce(g)  # mark:backward
        return g


def main():
    t = torch.ones(8)
    dist.all_reduce(t)  # mark:all_reduce
    dist.broadcast(torch.arange(5), src=world - 1)  # mark:broadcast
    sub = dist.new_group([1, 2])  # mark:new_group
    if rank in (1, 2):
        dist.broadcast(torch.zeros(3, 2, dtype=torch.float64), group=sub, group_src=1)  # mark:sub_broadcast
        dist.reduce(torch.ones(4), dst=1, group=sub)  # mark:sub_reduce
    dist.new_subgroups_by_enumeration([[0], [1, 2]])  # mark:subgroups
    work = dist.all_reduce(torch.ones(2, 2), async_op=True)  # mark:async
    work.wait()
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    ops = [dist.P2POp(dist.isend, torch.ones(6), nxt), dist.P2POp(dist.irecv, torch.empty(6), prv)]
    for w in dist.batch_isend_irecv(ops):  # mark:batch
        w.wait()
    out = [torch.empty(2, dtype=torch.int32) for _ in range(world)]
    dist.all_gather(out, torch.ones(2, dtype=torch.int32))  # mark:all_gather
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank})  # mark:all_gather_object
    with recorder.phase("eval"):
        dist.barrier()  # mark:phase
    x = torch.ones(4, requires_grad=True)
    AllReduceInBackward.apply(x).sum().backward()
    if rank == 0:
        dist.send(torch.ones(7), dst=2)  # mark:send
    elif rank == 2:
        dist.recv(torch.empty(7), src=0)  # mark:recv
    # DDP's construction-time collectives go through torch.distributed bindings (recorded); its
    # gradient all_reduces run in the C++ Reducer (not recorded).
    torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 3))  # mark:ddp


main()
dist.destroy_process_group()
