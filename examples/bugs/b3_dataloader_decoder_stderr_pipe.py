"""Rank 1's DataLoader worker waits for its decoder subprocess, which is blocked writing to a full stderr pipe.

Samples are stored in a legacy record format and decoded by a helper process (as with an
``ffmpeg``/``sox`` decoder): each DataLoader worker starts one with
``subprocess.Popen(..., stdout=PIPE, stderr=PIPE)``, writes a path to its stdin and reads the
decoded line from its stdout. Nobody ever reads the decoder's stderr. The decoder warns on stderr
about every record that still has the old header (a dump of the header fields, about 6 KiB). Rank
1's shard holds old-format records from sample 16 on: after 11 warnings the 64 KiB pipe buffer is
full, the decoder blocks in ``write(2)`` on stderr and the worker blocks for ever in
``readline()`` on stdout (the deadlock the ``subprocess`` documentation warns about). Rank 1's
main thread waits for that batch; ranks 0, 2 and 3 wait in ``all_reduce``.

    torchrun --nproc-per-node 4 examples/bugs/b3_dataloader_decoder_stderr_pipe.py
"""

import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "dataloader-stall", "culprits": [1], "world": 4,
         "why": "rank 1's DataLoader worker blocks in readline() on its decoder's stdout; the decoder is "
                "blocked writing warnings into a full, never-read stderr pipe (old-format records)"}

SAMPLES = 64
BATCH = 4
HANG_BATCH = 6  # the batch (0-based) rank 1's loader never delivers; see the docstring

DECODER = r'''
import sys
for line in sys.stdin:
    path = line.strip()
    with open(path) as f:
        header, payload = f.read().split("\n", 1)
    if header.startswith("v1"):
        fields = header.split(";")
        sys.stderr.write("decoder: warning: %s: legacy v1 header, converting. fields=%r\n" % (path, fields))
    values = [float(v) for v in payload.split()]
    sys.stdout.write(" ".join("%.4f" % v for v in values) + "\n")
    sys.stdout.flush()
'''


def write_shard(root, rank):
    """Stand-in for the node's data shard: rank 1's shard is an older export (v1 headers from sample 16 on)."""
    os.makedirs(root, exist_ok=True)
    for i in range(SAMPLES):
        legacy = rank == 1 and i >= 16
        header = ("v1;" + ";".join(f"field{k}=0x{k:04x}" for k in range(400))) if legacy else "v2"
        with open(os.path.join(root, f"{i:05d}.rec"), "w") as f:
            f.write(header + "\n" + " ".join(str(float(i + j)) for j in range(4)))


class DecodedDataset(Dataset):
    def __init__(self, root, decoder_path):
        self.root, self.decoder_path = root, decoder_path
        self.proc = None

    def __len__(self):
        return SAMPLES

    def _decoder(self):
        if self.proc is None:  # one decoder per worker process, started lazily after the fork
            self.proc = subprocess.Popen([sys.executable, "-u", self.decoder_path], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        return self.proc

    def __getitem__(self, index):
        proc = self._decoder()
        proc.stdin.write(os.path.join(self.root, f"{index:05d}.rec") + "\n")
        proc.stdin.flush()
        line = proc.stdout.readline()  # the bug: stderr=PIPE is never drained
        return torch.tensor([float(v) for v in line.split()], device="cpu")  # a forked worker: never CUDA


def main():
    rank, world = init()
    workdir = tempfile.mkdtemp(prefix=f"b3-decoder-{rank}-")
    try:
        decoder_path = os.path.join(workdir, "decoder.py")
        with open(decoder_path, "w") as f:
            f.write(DECODER)
        write_shard(os.path.join(workdir, "shard"), rank)
        loader = DataLoader(DecodedDataset(os.path.join(workdir, "shard"), decoder_path), batch_size=BATCH,
                            num_workers=1, multiprocessing_context="fork")
        weight = torch.zeros(4)
        batches = iter(loader)
        for step in range(len(loader)):
            if step == HANG_BATCH:
                hang_point(rank, f"next(loader): batch {HANG_BATCH}" if rank == 1 else "all_reduce")
            batch = next(batches)
            grad = (batch.to(weight.device) - weight).mean(0)
            dist.all_reduce(grad)
            weight += 0.1 * grad / world
            progress(rank, step)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    finish()


if __name__ == "__main__":
    main()
