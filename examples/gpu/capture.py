"""Run the NCCL hang scenarios on a 2-GPU host and capture everything hangdoc reads.

For each scenario: start it under torchrun (optionally through ``python -m hangdoc`` with the
recorder and watchdog), wait until it hangs, take py-spy dumps of every process of the job (plain,
--native, --locals; back to back per file as ``srun --output=trace-%N.out`` leaves them), wait for
PyTorch's Flight Recorder dump on the NCCL timeout, then kill the whole job. Every run is bounded.

    python examples/gpu/capture.py --out /tmp/captures [--hangdoc] [scenario ...]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # run from a checkout without installing

from hangdoc.proctree import descendants, free_port, kill_tree  # noqa: E402
SCENARIOS = ["nccl_skip_broadcast", "nccl_dataloader_deadlock", "nccl_pipeline_cycle", "nccl_stream_misplacement"]


def pyspy(pid: int, *flags: str) -> str:
    try:
        r = subprocess.run(["py-spy", "dump", "--pid", str(pid), *flags], capture_output=True, text=True, timeout=30)
        return r.stdout + r.stderr
    except subprocess.TimeoutExpired:
        return f"Error: py-spy dump of {pid} timed out\n"


def capture(name: str, out: str, use_hangdoc: bool, hang_wait: float, nccl_timeout: float, fr_wait: float) -> None:
    d = os.path.join(out, name)
    os.makedirs(os.path.join(d, "fr"), exist_ok=True)
    env = dict(os.environ)
    env.update(
        PYTHONUNBUFFERED="1",
        SCENARIO_NCCL_TIMEOUT=str(nccl_timeout),
        TORCH_NCCL_TRACE_BUFFER_SIZE="2000",
        TORCH_NCCL_DUMP_ON_TIMEOUT="1",
        TORCH_FR_DUMP_TEMP_FILE=os.path.join(d, "fr", "nccl_trace_rank_"),
        TORCH_NCCL_DEBUG_INFO_TEMP_FILE=os.path.join(d, "fr", "nccl_trace_rank_"),
        NCCL_NVLS_ENABLE="0",
        TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
        NVSHMEM_DISABLE_NVLS="1",
        # the ranks run in examples/gpu: hangdoc comes from this checkout
        PYTHONPATH=os.pathsep.join(p for p in (os.path.dirname(os.path.dirname(HERE)), os.environ.get("PYTHONPATH")) if p),
    )
    script = os.path.join(HERE, name + ".py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())]
    if use_hangdoc:
        cmd += ["-m", "hangdoc", "--record", "--hang-timeout", "8", "--out", os.path.join(d, "hangdoc-out"), script]
    else:
        cmd += [script]
    with open(os.path.join(d, "log.txt"), "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=HERE, start_new_session=True)
        try:
            time.sleep(hang_wait)
            pids = descendants(proc.pid)
            for fname, flags in (("trace-gpu1.out", ()), ("trace-gpu1-native.out", ("--native",)), ("trace-gpu1-locals.out", ("--locals",))):
                with open(os.path.join(d, fname), "w") as f:
                    for pid in [proc.pid] + pids:
                        f.write(pyspy(pid, *flags))
                        f.write("\n")
            # wait for the NCCL timeout's Flight Recorder dump, bounded
            deadline = time.time() + fr_wait
            while time.time() < deadline and proc.poll() is None:
                if len(os.listdir(os.path.join(d, "fr"))) >= 2:
                    time.sleep(3)
                    break
                time.sleep(1)
        finally:
            kill_tree(proc.pid)  # torchrun's ranks run in sessions of their own
            proc.wait(timeout=30)
    print(f"{name}: {sorted(os.listdir(d))} fr={sorted(os.listdir(os.path.join(d, 'fr')))}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--hangdoc", action="store_true", help="run through python -m hangdoc --record --hang-timeout 8")
    ap.add_argument("--hang-wait", type=float, default=20.0)
    ap.add_argument("--nccl-timeout", type=float, default=30.0)
    ap.add_argument("--fr-wait", type=float, default=None, help="seconds to wait for Flight Recorder dumps after the stacks (default: NCCL timeout + 25)")
    ap.add_argument("--no-archive", action="store_true")
    ap.add_argument("scenarios", nargs="*", default=SCENARIOS)
    a = ap.parse_args()
    for name in a.scenarios:
        capture(name, a.out, a.hangdoc, a.hang_wait, a.nccl_timeout, a.fr_wait if a.fr_wait is not None else a.nccl_timeout + 25)
    if not a.no_archive:
        shutil.make_archive(a.out.rstrip("/") + "-captures", "gztar", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
