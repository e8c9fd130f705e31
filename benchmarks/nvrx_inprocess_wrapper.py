"""Run a bug scenario under nvidia-resiliency-ext's in-process restart (``inprocess.Wrapper``).

    NVRX_SOFT_TIMEOUT=8 NVRX_STORE_PORT=29777 torchrun --nproc-per-node 4 benchmarks/nvrx_inprocess_wrapper.py examples/bugs/skip_broadcast.py

The other hang detector of nvidia-resiliency-ext: ``inprocess.Wrapper`` wraps the training function;
its progress watchdog stamps the time whenever the main thread runs Python (automatically, no
call in the script), and a rank whose stamp is older than ``soft_timeout`` is recorded as
``Interruption.SOFT_TIMEOUT`` and every rank's wrapped call is interrupted and restarted (once
here: ``RetryController(max_iterations=1)``, so a hang ends the job instead of looping). The
scenario's ``main`` runs as the wrapped function; the script is not changed.
"""

import logging
import os
import runpy
import sys
from datetime import timedelta


def main():
    from nvidia_resiliency_ext import inprocess

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    soft = float(os.environ.get("NVRX_SOFT_TIMEOUT", "8"))
    script = sys.argv[1]
    sys.argv = sys.argv[1:]

    def train():
        runpy.run_path(script, run_name="__main__")

    port = os.environ.get("NVRX_STORE_PORT")  # its own store: torchrun's sits on MASTER_PORT
    wrapped = inprocess.Wrapper(
        store_kwargs={"port": int(port)} if port else None,
        initialize=inprocess.initialize.RetryController(max_iterations=1),
        soft_timeout=timedelta(seconds=soft), hard_timeout=timedelta(seconds=soft * 3),
        heartbeat_timeout=timedelta(seconds=soft * 2), barrier_timeout=timedelta(seconds=60),
        completion_timeout=timedelta(seconds=60),
    )(train)
    wrapped()


if __name__ == "__main__":
    main()
