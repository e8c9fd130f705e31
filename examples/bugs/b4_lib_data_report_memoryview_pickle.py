"""``all_gather_object`` of a data-quality report: rank 3's report holds ``memoryview``s, pickling raises.

Each rank reads its shard of length-prefixed binary records (features, a label byte) from one
buffer and hands out zero-copy ``memoryview`` slices of it (the loader avoids copies). Records with
a bad length or label byte are counted and the first few are kept for the report ("for
debugging"). At the end of every epoch the ranks exchange their reports with
``dist.all_gather_object`` so that rank 0 can log a job-wide summary. Only rank 3's shard has bad
records (two 0xFF label bytes of a torn write), so only its report contains ``memoryview`` objects:
``all_gather_object`` pickles the object before its first collective (``_object_to_tensor``) and
raises ``TypeError: cannot pickle memoryview objects`` on rank 3, which exits. Ranks 0, 1, 2 are
in the ``all_gather`` of object sizes inside ``all_gather_object``; under gloo they fail within a
second with "Connection closed by peer" once rank 3's process is gone (or torchrun tears them down).

    torchrun --nproc-per-node 4 examples/bugs/b4_lib_data_report_memoryview_pickle.py
"""

import os
import struct
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import finish, hang_point, init, progress  # noqa: E402

TRUTH = {"kind": "rank-failed", "culprits": [3], "world": 4,
         "why": "rank 3's epoch-0 data report keeps memoryview slices of its bad records; "
                "all_gather_object raises TypeError (cannot pickle memoryview objects) on rank 3 before any "
                "collective and it exits; ranks 0-2 wait in all_gather_object's size all_gather"}

DIM = 8
RECORDS = 48
BATCH = 8
EPOCHS = 2


def make_shard(rank):
    """Bytes of ``RECORDS`` records, each ``<I length>`` + ``DIM`` float32 + ``<B label>``."""
    g = torch.Generator().manual_seed(77 + rank)
    out = bytearray()
    for i in range(RECORDS):
        label = 0xFF if (rank == 3 and i in (41, 42)) else i % 2  # two records of a torn write, 0xFF filler
        payload = struct.pack(f"<{DIM}f", *torch.randn(DIM, generator=g).tolist()) + bytes([label])
        out += struct.pack("<I", len(payload)) + payload
    return bytes(out)


class RecordReader:
    def __init__(self, blob):
        self.view = memoryview(blob)
        self.bad = []
        self.n_bad = 0

    def __iter__(self):
        off = 0
        while off + 4 <= len(self.view):
            (length,) = struct.unpack_from("<I", self.view, off)
            rec = self.view[off + 4:off + 4 + length]  # zero-copy slice
            off += 4 + length
            if length != 4 * DIM + 1 or rec[-1] > 1:
                self.n_bad += 1
                if len(self.bad) < 4:
                    self.bad.append({"offset": off, "raw": rec})  # kept for the report
                continue
            yield torch.frombuffer(bytearray(rec[:-1]), dtype=torch.float32), int(rec[-1])


def batches(reader):
    xs, ys = [], []
    for x, y in reader:
        xs.append(x)
        ys.append(y)
        if len(xs) == BATCH:
            yield torch.stack(xs), torch.tensor(ys)
            xs, ys = [], []
    if xs:
        yield torch.stack(xs), torch.tensor(ys)


def main():
    rank, world = init()
    torch.manual_seed(0)
    w = torch.zeros(DIM, 2, requires_grad=True)
    blob = make_shard(rank)
    step = 0
    for epoch in range(EPOCHS):
        reader = RecordReader(blob)
        for x, y in batches(reader):
            loss = torch.nn.functional.cross_entropy(x @ w, y)
            loss.backward()
            dist.all_reduce(w.grad)
            with torch.no_grad():
                w -= 0.1 * w.grad / world
            w.grad = None
            progress(rank, step)
            step += 1
        report = {"rank": rank, "epoch": epoch, "bad_records": reader.n_bad, "examples": reader.bad}
        reports = [None] * world
        hang_point(rank, "all_gather_object: pickling raises" if reader.bad else "all_gather_object")
        dist.all_gather_object(reports, report)
        if rank == 0:
            total = sum(r["bad_records"] for r in reports)
            print(f"epoch {epoch}: {total} bad records over {world} ranks", flush=True)
    finish()


if __name__ == "__main__":
    main()
