"""Capture what ``--detect`` publishes while a job runs (for fixtures; not part of hangdoc).

Put this directory first on ``PYTHONPATH`` and set ``DBG_OUT`` to a directory: every rank (a process
with ``RANK`` set) looks twice a second for 30 s and writes its publication, as the detector makes it
for a quiet rank (``Detector._make(True)``), to ``DBG_OUT/pub-r<rank>-<look>.json`` while it lists
calls queued on its GPU (``h``, :mod:`hangdoc.runtime.detect_queue`), six at most.

    DBG_OUT=/tmp/cap PYTHONPATH=examples/detect/peek:. torchrun --nproc-per-node 2 -m hangdoc --detect ...
"""

import json
import os
import sys
import threading
import time


def _peek():
    out = os.environ["DBG_OUT"]
    kept = 0
    for i in range(60):
        time.sleep(0.5)
        try:
            from hangdoc.runtime import detect

            d = detect.get()
            if d is None or d.node is None:
                continue
            pub = d._make(True)
            if pub.get("h") and kept < 6:
                kept += 1
                with open(os.path.join(out, f"pub-r{os.environ['RANK']}-{i:02d}.json"), "w") as f:
                    json.dump(pub, f, indent=1)
        except Exception as e:
            print("peek:", repr(e), file=sys.stderr, flush=True)


if os.environ.get("RANK") is not None and os.environ.get("DBG_OUT"):
    threading.Thread(target=_peek, daemon=True).start()
