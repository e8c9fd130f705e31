"""Run a bug scenario with torch's debug server started in every rank, as its docs tell a user.

    DBGSRV_PORT=29714 TORCH_FR_BUFFER_SIZE=20000 torchrun --nproc-per-node 4 \\
        benchmarks/dbgsrv_wrapper.py examples/bugs/skip_broadcast.py

``torch.distributed.debug.start_debug_server(port=...)`` (torch >= 2.10) starts an HTTP worker
server in every rank and, on rank 0, the frontend at ``port`` that gathers every rank's stacks
(``/stacks``) and Flight Recorder (``/fr_trace``, ``/fr_trace_json``). It needs only torchrun's
``MASTER_ADDR``/``MASTER_PORT`` store, not the process group, so it is started here before the
scenario runs (the scenarios in ``examples/bugs`` are left as they are).
``DBGSRV_FETCH_TIMEOUT`` (default 10 s) is how long the frontend waits for a worker that does
not answer (a stopped or dead rank) before it shows that rank as failed.
"""

import os
import runpy
import sys


def main():
    from torch.distributed.debug import start_debug_server

    start_debug_server(port=int(os.environ.get("DBGSRV_PORT", "25999")),
                       fetch_timeout=float(os.environ.get("DBGSRV_FETCH_TIMEOUT", "10")))
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
