"""Shared set-up of the record examples: gloo group, the recorder, and a no-progress dumper.

The watchdog (hangdoc.runtime.watchdog) is what a real job would use; these examples keep their
own tiny daemon thread so that they only depend on the recorder: after ``IDLE`` seconds without a
completed call it writes this rank's records, its Flight Recorder dump (when
``TORCH_FR_BUFFER_SIZE`` is set) and a faulthandler stack dump with the hangdoc tag line, then
keeps the process as it is (hung) for the launcher to kill.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # run from a checkout without installing

import torch  # noqa: E402,F401  (re-exported to the examples)
import torch.distributed as dist  # noqa: E402

from hangdoc.runtime import recorder  # noqa: E402

IDLE = float(os.environ.get("HANGDOC_EXAMPLE_IDLE", "2.0"))


def setup():
    """Recorder on, gloo group up; returns (rank, world_size)."""
    out = os.environ.get("HANGDOC_OUT", "hangdoc-out")
    rec = recorder.enable(capacity=10_000, out_dir=out)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    threading.Thread(target=_dump_when_idle, args=(rec, out, rank, world), daemon=True, name="hangdoc-example-dumper").start()
    return rank, world


def _dump_when_idle(rec, out, rank, world):
    while True:
        time.sleep(0.2)
        rec.progress  # observe async completions
        if time.monotonic() - rec.last_progress < IDLE or not rec.pending():
            continue
        os.makedirs(out, exist_ok=True)
        from hangdoc.runtime.identity import short_hostname
        from hangdoc.tags import format_tag

        host, pid = os.environ.get("HANGDOC_HOST") or short_hostname(), os.getpid()
        stacks = os.path.join(out, f"stacks-{host}-r{rank}-{pid}.txt")
        with open(stacks + ".tmp", "w") as f:
            f.write(format_tag(host=host, pid=pid, rank=rank, local_rank=rank, world_size=world) + "\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
        os.replace(stacks + ".tmp", stacks)
        if os.environ.get("TORCH_FR_BUFFER_SIZE"):
            try:
                import torch._C._distributed_c10d as c10d_c

                data = c10d_c._dump_fr_trace()
                with open(os.path.join(out, f".fr_trace_rank_{rank}"), "wb") as f:
                    f.write(data)
                os.replace(os.path.join(out, f".fr_trace_rank_{rank}"), os.path.join(out, f"fr_trace_rank_{rank}"))
            except Exception as e:  # FR absent in this build: the records are enough
                print(f"rank {rank}: no Flight Recorder dump: {e}", file=sys.stderr)
        rec.dump()
        return


def finish():
    dist.destroy_process_group()
