"""Two threads take two locks in opposite order: a lock-order deadlock, no torch needed.

The main thread holds ``A`` and waits for ``B``; the ``loader`` thread holds ``B`` and waits for
``A``. Used to capture the same hang under several Python versions (3.11, 3.12, 3.13), whose
standard-library paths and line numbers differ, for the readers' normalisation tests.

    python examples/hangs/lock_cycle.py
"""

import faulthandler
import signal
import threading
import time

A = threading.Lock()
B = threading.Lock()


def load_batches(ready):
    with B:
        ready.set()
        time.sleep(0.2)
        with A:  # the main thread holds A and waits for B: never
            pass


def main():
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    ready = threading.Event()
    with A:
        threading.Thread(target=load_batches, args=(ready,), name="loader", daemon=True).start()
        ready.wait()
        print("HANG-POINT rank=0", flush=True)
        with B:
            pass


if __name__ == "__main__":
    main()
