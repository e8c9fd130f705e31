"""A skipped broadcast that NCCL may "complete" silently; the detector says so first.

Every step does two collectives of ``--size`` floats. With ``--pattern A`` (the default) it
all_reduces, then broadcasts from rank 0. At step SKIP, rank 1 skips the broadcast. NCCL may pair
rank 0's broadcast with rank 1's next all_reduce of the same count: both complete with wrong data,
every later pair stays shifted by one call, and the job trains on. At step METRICS every rank
all_reduces 4 × size floats, where the shifted calls differ in size.

On 2 × H200 with NCCL 2.28.9, which of these happens depends on the size:
- with 1,048,576 floats, even the METRICS call completed, and the job ran to its end on wrong
  data;
- with 256 floats, the first mismatched pair hung.

``examples/detect/nccl_skip_probe.py`` finds the silent pairings on a given machine (see
tests/fixtures/detect/).

    torchrun --nproc-per-node 2 -m hangdoc --detect --out /tmp/detect-nccl examples/detect/nccl_silent_skip.py --size 1048576

Each rank prints, and writes to ``DIR/timeline-r{rank}.json``, when the skip happened, when the
detector fired and, if it did, when the hang started (the last host sync before it).

With ``--detect-policy abort``, the ranks raise at their next collective after the detector
fires, so the job fails with a message instead of training on.

``--backend gloo`` runs it on CPU. gloo does not match mismatched calls of pattern A, so there
the job hangs at the skip itself, and the detector still names the rank. ``--pattern B`` (two
broadcasts of equal size) completes silently on both backends, and the detector cannot see that
one (docs/detect.md, Limits).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import threading
import time

import torch
import torch.distributed as dist

SKIP = 20
METRICS = 100
STEP_SECONDS = 0.05  # stands for the forward/backward pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="nccl", choices=("nccl", "gloo"))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--pattern", default="A", choices=("A", "B", "C"),
                    help="A: all_reduce then broadcast per step (default); B: two broadcasts of equal "
                         "size (syncing two same-shaped buffers); C: broadcast then all_reduce")
    ap.add_argument("--size", type=int, default=256, help="elements per collective")
    args = ap.parse_args()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if args.backend == "nccl":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=40))
    rank = dist.get_rank()
    timeline = Timeline(rank)
    x = torch.ones(args.size, device=device)
    params = torch.zeros(args.size, device=device)
    buffers = torch.zeros(args.size, device=device)
    for step in range(args.steps):
        if step == METRICS:
            timeline.event("hang_expected", f"step {step}: all_reduce of {4 * args.size} floats; the shifted calls differ in size now")
            dist.all_reduce(torch.ones(4 * args.size, device=device))
        skip = step == SKIP and rank == 1
        if skip:
            timeline.event("skip", f"step {step}: rank 1 skips the broadcast")  # the bug
        if args.pattern == "A":
            dist.all_reduce(x)
            x /= dist.get_world_size()
            if not skip:
                dist.broadcast(params, src=0)
        elif args.pattern == "B":
            if not skip:
                dist.broadcast(params, src=0)
            dist.broadcast(buffers, src=0)
        else:
            if not skip:
                dist.broadcast(params, src=0)
            dist.all_reduce(x)
            x /= dist.get_world_size()
        timeline.event("host_sync", None, quiet=True)
        loss = (x.sum() + params.sum() + buffers.sum()).item()  # host sync: where a hang shows
        time.sleep(STEP_SECONDS)
        if step % 50 == 0 and rank == 0:
            print(f"step {step} loss {loss:.1f}", flush=True)
    timeline.event("finished", f"all {args.steps} steps done")


class Timeline:
    """When things happened on this rank, printed and kept in the output directory."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.times: dict = {"rank": rank}
        self.path = os.path.join(os.environ.get("HANGDOC_OUT") or _out_dir(), f"timeline-r{rank}.json")
        threading.Thread(target=self._watch_detector, daemon=True).start()

    def event(self, name: str, message, quiet: bool = False) -> None:
        self.times[name] = time.time()
        if name == "host_sync":
            self.times["last_host_sync"] = self.times.pop(name)
        if not quiet:
            print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)
        self._save()

    def _watch_detector(self) -> None:
        """Print when the detector fires, and when the job stopped making progress (the hang)."""
        try:
            from hangdoc.runtime import detect
        except ImportError:
            return
        fired = hung = False
        while not (fired and hung):
            time.sleep(0.05)
            det = detect.get()
            if not fired and det is not None and det.fired_at is not None:
                fired = True
                self.times["detector_fired"] = det.fired_at
                skip = self.times.get("skip") or _peer_skip_time(self.path)
                after = f" ({det.fired_at - skip:.2f}s after the skip)" if skip else ""
                print(f"[{time.strftime('%H:%M:%S')}] detector fired{after}: {det.verdict.summary}", flush=True)
                self._save()
            last = self.times.get("last_host_sync")
            if not hung and last and time.time() - last > 3.0 and "finished" not in self.times:
                hung = True
                self.times["hang_started"] = last
                fired_at = self.times.get("detector_fired")
                when = ("; the detector had not fired yet" if not fired_at
                        else f"; the detector fired {last - fired_at:.2f}s before" if fired_at <= last
                        else f"; the detector fired {fired_at - last:.2f}s after it began")
                print(f"[{time.strftime('%H:%M:%S')}] no progress since {time.strftime('%H:%M:%S', time.localtime(last))}: "
                      f"the job hangs{when}", flush=True)
                self._save()

    def _save(self) -> None:
        try:
            from hangdoc.atomic import write_atomic

            write_atomic(self.path, json.dumps(self.times, indent=1) + "\n")
        except Exception:
            pass


def _out_dir() -> str:
    try:
        from hangdoc.runtime import detect

        det = detect.get()
        if det is not None:
            return det.out_dir
    except ImportError:
        pass
    return "."


def _peer_skip_time(path: str):
    """Rank 1 skips; rank 0 reads the time from rank 1's timeline (same output directory)."""
    try:
        with open(os.path.join(os.path.dirname(path), "timeline-r1.json")) as f:
            return json.load(f).get("skip")
    except (OSError, ValueError):
        return None


if __name__ == "__main__":
    main()
