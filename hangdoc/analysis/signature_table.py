"""The signature table: which frames are a collective, a send or receive, a host sync, a DataLoader
wait, a lock, a sleep or I/O (:mod:`hangdoc.analysis.signatures` reads stacks with it), and which
files are library code.

One row per way a frame can look: torch 1.x-2.x (with and without the ``c10d_logger`` wrappers),
DeepSpeed's ``deepspeed.comm`` and pipe engine, Megatron's mappings, the standard library, and the
native frames of py-spy ``--native``, gdb and pystack. A new library is new rows here.

    >>> [row[0] for row in SIGNATURES if "deepspeed/runtime/pipe" in (row[3] or "")]
    ['p2p']
"""

from __future__ import annotations

import re
from typing import Iterable, List, Optional, Tuple

_HOST_SYNC_NAMES = {"item": ".item()", "synchronize": "CUDA synchronize", "wait": "Work.wait"}


# --- the table -----------------------------------------------------------------------------------

_C10D = r"torch/distributed/(distributed_c10d|c10d_logger|_functional_collectives|_functional_collectives_impl|device_mesh)\.py"
_COLLECTIVE_OPS = (
    "broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base",
    "all_gather_coalesced", "all_reduce_coalesced", "reduce_scatter", "reduce_scatter_tensor",
    "_reduce_scatter_base", "all_to_all", "all_to_all_single", "gather", "scatter", "barrier",
    "monitored_barrier", "broadcast_object_list", "all_gather_object", "gather_object",
    "scatter_object_list", "broadcast_multigpu", "all_reduce_multigpu", "all_gather_multigpu",
    "reduce_multigpu", "reduce_scatter_multigpu", "all_reduce_inplace", "all_gather_tensor",
    "reduce_scatter_tensor_coalesced", "all_gather_into_tensor_coalesced",
)
_P2P_OPS = ("send", "recv", "isend", "irecv", "batch_isend_irecv", "send_object_list", "recv_object_list")
_RECV_OPS = frozenset({"recv", "irecv", "recv_object_list"})
_ROOTED = frozenset({"broadcast", "reduce", "gather", "scatter", "broadcast_object_list", "gather_object",
                     "scatter_object_list", "broadcast_multigpu", "reduce_multigpu"})
#: Rooted one-to-many collectives: with gloo the receivers may finish before the root does.
ONE_TO_MANY = frozenset({"broadcast", "scatter", "broadcast_object_list", "scatter_object_list", "broadcast_multigpu"})

_GLOO_OPS = {
    "allreduce": "all_reduce", "broadcast": "broadcast", "allgather": "all_gather", "allgatherv": "all_gather",
    "barrier": "barrier", "reduce": "reduce", "gather": "gather", "scatter": "scatter", "alltoall": "all_to_all",
    "alltoallv": "all_to_all", "reduce_scatter": "reduce_scatter", "_allgather_base": "all_gather",
}
_NCCL_OPS = {
    "AllReduce": "all_reduce", "Broadcast": "broadcast", "AllGather": "all_gather", "ReduceScatter": "reduce_scatter",
    "Reduce": "reduce", "Send": "send", "Recv": "recv",
}

# (category, op, function regex, file regex or None, native: True/False/None, context)
# op "" means "the function name"; ops that are not known collective names keep the table's op.
_Row = Tuple[str, str, str, Optional[str], Optional[bool], bool]
SIGNATURES: List[_Row] = [
    # torch.distributed, every version: the API functions (and torch 2.x's wrappers around them).
    ("collective", "", "|".join(_COLLECTIVE_OPS), _C10D, False, False),
    ("p2p", "", "|".join(_P2P_OPS), _C10D, False, False),
    ("collective", "", "|".join(_COLLECTIVE_OPS), r"torch/distributed/_functional_collectives\.py", False, False),
    # Group creation: every rank must call new_group (a store rendezvous), so it is waited in like
    # a collective of the whole job.
    ("collective", "new_group", r"new_group|new_subgroups(_by_enumeration)?|_new_group_with_tag|_new_process_group_helper|_store_based_barrier",
     _C10D, False, False),
    # torch._C._distributed_c10d.Work.wait as a Python frame (pystack), and the future of a p2p op.
    ("host-sync", "wait", r"wait|_wait|wait_tensor", r"torch/distributed/_functional_collectives(_impl)?\.py", False, False),
    # DeepSpeed's communication layer and its torch backend; Megatron's mappings.
    ("collective", "", "|".join(_COLLECTIVE_OPS + ("inference_all_reduce", "all_gather_base", "reduce_scatter_base", "allgather_fn", "reduce_scatter_fn")),
     r"deepspeed/comm/(comm|torch|backend|ccl)\.py", False, False),
    ("p2p", "", "|".join(_P2P_OPS), r"deepspeed/comm/(comm|torch|backend|ccl)\.py", False, False),
    ("p2p", "", "send|recv|isend|irecv|send_obj|recv_obj|_send|_recv", r"deepspeed/runtime/pipe/p2p\.py", False, False),
    ("collective", "all_reduce", r"_reduce|_reduce_scatter_along_first_dim", r"megatron/(core/tensor_parallel|mpu)/mappings\.py", False, False),
    ("collective", "all_gather", r"_gather|_gather_along_first_dim|_gather_along_last_dim", r"megatron/(core/tensor_parallel|mpu)/mappings\.py", False, False),
    ("p2p", "", r"_communicate|_batched_p2p_ops|_p2p_ops|send_forward|recv_forward|send_backward|recv_backward|send_forward_recv_backward|send_backward_recv_forward",
     r"megatron/(core/pipeline_parallel/)?p2p_communication\.py", False, False),
    # DDP's Python frames around its C++ collectives (dist._broadcast_coalesced, the parameter
    # check): the buffer broadcast before each forward, the parameter sync at construction.
    ("collective", "broadcast_coalesced", r"_distributed_broadcast_coalesced", r"torch/nn/parallel/distributed\.py", False, False),
    ("collective", "broadcast_coalesced", r"_sync_params_and_buffers", r"torch/distributed/utils\.py", False, False),
    ("collective", "verify_params_across_processes", r"_verify_param_shape_across_processes", r"torch/distributed/utils\.py", False, False),
    # Host-side waits for device work (NCCL collectives are asynchronous to the host).
    ("host-sync", "synchronize", r"synchronize", r"torch/cuda/(__init__|streams)\.py", False, False),
    ("host-sync", "wait", r"wait", r"torch/futures/__init__\.py", False, False),
    # DataLoader, main side: waiting for the next batch from the workers (torch 1.0 named it _get_batch).
    ("dataloader-wait", "next batch", r"_try_get_data|_get_data|_get_batch", r"torch/utils/data/dataloader\.py", False, False),
    ("dataloader-wait", "next batch", r"_next_data|__next__", r"torch/utils/data/dataloader\.py", False, True),
    # DataLoader, worker side.
    ("dataloader-worker", "worker", r"_worker_loop", r"torch/utils/data/_utils/worker\.py", False, False),
    # Locks, sleeps and I/O in the standard library.
    ("lock", "lock", r"wait|acquire|join|_wait_for_tstate_lock|wait_for|__enter__", r"(^|/)threading\.py", False, False),
    ("lock", "lock", r"acquire|__enter__|wait", r"multiprocessing/(synchronize|managers)\.py", False, False),
    ("lock", "queue", r"get|put|join", r"(^|/)queue\.py", False, False),
    ("io", "io", r"select|poll|_poll|wait|recv|_recv|_recv_bytes|recv_bytes|recv_into|readinto|read|accept|connect|create_connection|sendall|send|readline|_readline",
     r"(^|/)(selectors|socket|ssl|multiprocessing/connection|multiprocessing/queues|subprocess|http/client|asyncio/[a-z_]+)\.py", False, False),
    ("sleep", "sleep", r"sleep", r"(^|/)asyncio/tasks\.py", False, False),
    # Native frames: py-spy --native, gdb, pystack --native.
    ("collective", "", r"(c10d::)?ProcessGroup(Gloo|NCCL|MPI|UCC)?::(allreduce|broadcast|allgather|_allgather_base|reduce_scatter|_reduce_scatter_base|alltoall|alltoall_base|barrier|reduce|gather|scatter)\b.*", None, True, False),
    ("p2p", "recv", r"(c10d::)?ProcessGroup\w*::(RecvWork|recv|recvAnysource)\b.*", None, True, False),
    ("p2p", "send", r"(c10d::)?ProcessGroup\w*::(SendWork|send)\b.*", None, True, False),
    ("host-sync", "synchronize", r"(c10d::)?ProcessGroupNCCL::WorkNCCL::(synchronize|wait|synchronizeStreams)\b.*", None, True, False),
    ("collective", "", r"gloo::(allreduce|broadcast|allgather|allgatherv|barrier|reduce|gather|scatter|alltoall|alltoallv|reduce_scatter)\b.*", None, True, False),
    ("collective", "gloo", r"gloo::.*", None, True, False),
    ("collective", "", r"nccl(AllReduce|Broadcast|AllGather|ReduceScatter|Reduce|Send|Recv)\b.*", None, True, False),
    ("collective", "nccl", r"ncclGroupEnd|ncclCommInitRank\w*|ncclCommAbort|ncclCommDestroy", None, True, False),
    ("host-sync", "synchronize", r"cuda(Stream|Device|Event)Synchronize\w*|cudaMemcpy|cudaMemcpy2D|cu(Stream|Ctx|Event)Synchronize\w*|cuMemcpyDtoH\w*|hip(Stream|Device|Event)Synchronize\w*|hipMemcpy|c10::cuda::device_synchronize|THCPModule_cudaSynchronize|c10::cuda::stream_synchronize\w*", None, True, False),
    ("host-sync", "item", r"(at::native::)?_local_scalar_dense\w*|(at::)?_ops::_local_scalar_dense\b.*|THPVariable_item|at::Tensor::item\b.*", None, True, False),
    ("host-sync", "wait", r"(c10d::)?Work::wait\b.*|c10::ivalue::Future::wait\b.*", None, True, False),
    ("dataloader-worker", "worker", r"_worker_loop", None, True, False),
    ("lock", "lock", r"PyThread_acquire_lock\w*|acquire_timed|lock_PyThread_acquire_lock|pthread_mutex_\w*lock|pthread_cond_\w*wait|__pthread_cond_wait\w*|sem_\w*wait|__new_sem_wait\w*|do_futex_wait\w*|__futex_abstimed_wait\w*|futex_wait\w*|std::condition_variable::wait\w*|std::mutex::lock|take_gil|drop_gil|_PyMutex_LockTimed|PyMUTEX_LOCK|PyCOND_\w*WAIT", None, True, False),
    # a process that signalled itself (os.kill(os.getpid(), SIGSTOP)) and is now stopped
    ("sleep", "stopped by a signal", r"kill|tgkill|raise|pthread_kill|os_kill\w*|__pthread_kill\w*", None, True, False),
    ("sleep", "sleep", r"sleep|pysleep|time_sleep|_{0,2}clock_nanosleep\w*|_{0,2}nanosleep\w*|usleep|std::this_thread::sleep_for\b.*", None, True, False),
    ("io", "io", r"_{0,2}(libc_)?(select|poll|epoll_wait|epoll_pwait|recv|recvfrom|recvmsg|read|accept4?|connect|ppoll|pselect6?)\w*|select|poll|epoll_wait|recv|read|accept", None, True, False),
]


def _compile(rows: Iterable[_Row]):
    out = []
    for category, op, fn, path, native, context in rows:
        out.append((category, op, re.compile(rf"(?:{fn})"), re.compile(rf"(?:{path})$") if path else None, native, context))
    return out


_TABLE = _compile(SIGNATURES)

#: Library code: its frames are part of the wait chain even when no signature names them.
_LIBRARY = re.compile(
    r"(^|/)(torch|torchvision|torchaudio|triton|deepspeed/comm|deepspeed/utils|deepspeed/runtime/pipe/p2p\.py|deepspeed/runtime/comm"
    r"|megatron/(core/)?(tensor_parallel|mpu)/mappings\.py|megatron/core/parallel_state\.py|megatron/core/pipeline_parallel/p2p_communication\.py"
    r"|accelerate/utils/operations\.py|lightning/fabric/utilities/distributed\.py|pytorch_lightning/utilities/distributed\.py"
    r"|hangdoc/runtime|multiprocessing|concurrent|asyncio|importlib|logging|http|email|json|encodings|collections|contextlib\.py"
    r"|threading\.py|queue\.py|selectors\.py|socket\.py|ssl\.py|subprocess\.py|functools\.py|runpy\.py|weakref\.py|typing\.py|typing_extensions\.py"
    r")(?=/|$)"
)
_STDLIB = re.compile(r"/lib/python3\.\d+/(?!site-packages|dist-packages)|^<frozen |^<string>")
