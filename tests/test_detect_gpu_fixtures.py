"""The detector on 2 x H200 (tests/fixtures/detect/): what NCCL does with a skipped broadcast, and
the divergence report arriving long before any hang. CPU CI keeps checking the committed runs."""

import json
import os

from hangdoc.analysis import analyse
from hangdoc.readers import read_paths

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "detect")


def load(*parts):
    with open(os.path.join(HERE, *parts)) as f:
        return json.load(f)


def test_probe_found_pairings_nccl_completes_silently():
    probe = load("gpu-probe.json")
    trials = {(t["pattern"], t["n"], t["proto"], t["algo"]): t for t in probe["trials"]}
    assert len(trials) == 32
    # broadcast on rank 0 matched by rank 1's all_reduce of the same count: wrong data, no hang
    silent = trials[("A", 1048576, "default", "default")]
    assert silent["outcome"] == "silent" and silent["steps_done"] == [12, 12] and silent["corrupt_from"] == [4, 4]
    # the same at 256 floats hangs one step after the skip (what the first GPU run of the detector saw)
    assert trials[("A", 256, "default", "default")]["outcome"] == "hang-later"
    # with NCCL_PROTO=Simple every size of that pairing completes silently
    assert all(trials[("A", n, "Simple", "default")]["outcome"] == "silent" for n in (256, 4096, 65536, 1048576))
    # two equal broadcasts shifted by one: always silent (and invisible to signatures, see docs/detect.md)
    assert all(t["outcome"] == "silent" for k, t in trials.items() if k[0] == "B")


def test_silent_skip_reported_within_a_second_and_the_job_never_hung():
    r0, r1 = load("gpu-silent", "timeline-r0.json"), load("gpu-silent", "timeline-r1.json")
    skip = r1["skip"]
    for t in (r0, r1):
        assert 0 < t["detector_fired"] - skip < 2.0  # 0.83 / 0.84 s measured
        assert "finished" in t and "hang_started" not in t  # trained on, on wrong data, to the end
    v = load("gpu-silent", "divergence.json")
    assert (v["deviants"], v["agreeing"], v["index"]) == ([1], [0], 41)
    assert v["summary"].startswith("rank 1 diverged from rank 0 in default_pg at collective #41: "
                                   "all_reduce([1048576] float32) at nccl_silent_skip.py:65 vs "
                                   "broadcast([1048576] float32, src=0) at nccl_silent_skip.py:68")
    with open(os.path.join(HERE, "gpu-silent", "log.txt")) as f:
        log = f.read()
    assert "hangdoc: DIVERGENCE: rank 1 diverged" in log and "all 200 steps done" in log


def test_records_of_the_silent_run_name_the_same_collective_offline():
    job = read_paths([os.path.join(HERE, "gpu-silent")])
    f = analyse(job).findings[0]
    assert f.kind == "collective-mismatch" and {c.rank for c in f.culprits} == {1}
    assert f.summary.startswith("rank 1 skipped broadcast #41 (nccl_silent_skip.py:68)")
