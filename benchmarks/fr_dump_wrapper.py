"""Run a script with a Flight Recorder dump on demand: the gloo stand-in for NCCL's dump on timeout.

    TORCH_FR_BUFFER_SIZE=20000 FR_DUMP_DIR=/tmp/fr FR_DUMP_TRIGGER=/tmp/fr-now torchrun --nproc-per-node 4 \\
        benchmarks/fr_dump_wrapper.py examples/bugs/skip_broadcast.py

gloo has no watchdog that dumps Flight Recorder on a timeout (NCCL's ``TORCH_NCCL_DUMP_ON_TIMEOUT``),
so a daemon thread waits for ``$FR_DUMP_DIR/dump-now`` to appear and then writes
``torch._C._distributed_c10d._dump_fr_trace()`` to ``$FR_DUMP_DIR/fr_trace_rank_<RANK>``, the
name ``fr_trace`` expects (``-p fr_trace_rank_``). A script that raises is dumped on its way out,
as NCCL's watchdog would dump on the error. The thread polls (0.2 s) a file instead of handling a
signal: a Python signal handler would only run once the main thread leaves the hung collective.
"""

import os
import runpy
import sys
import threading
import time


def dump(out_dir):
    import torch._C._distributed_c10d as c10d_c

    rank = os.environ.get("RANK", "0")
    nccl = getattr(c10d_c, "_dump_nccl_trace", None)  # CUDA builds: NCCL's entries live in their own recorder
    data = nccl() if nccl is not None and os.environ.get("BUG_BACKEND") == "nccl" else c10d_c._dump_fr_trace()
    tmp = os.path.join(out_dir, f".fr_trace_rank_{rank}.{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, os.path.join(out_dir, f"fr_trace_rank_{rank}"))


def wait_and_dump(out_dir, trigger):
    while not os.path.exists(trigger):
        time.sleep(0.2)
    dump(out_dir)


def main():
    out_dir = os.environ["FR_DUMP_DIR"]
    threading.Thread(target=wait_and_dump, args=(out_dir, os.environ["FR_DUMP_TRIGGER"]), name="fr-dumper", daemon=True).start()
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    try:
        runpy.run_path(script, run_name="__main__")
    except BaseException:
        try:
            dump(out_dir)
        except Exception as e:  # no process group yet, or FR off: the script's error is the story
            print(f"fr_dump_wrapper: no dump: {type(e).__name__}: {e}", file=sys.stderr)
        raise


if __name__ == "__main__":
    main()
