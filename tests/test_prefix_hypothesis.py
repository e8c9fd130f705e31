"""Launcher prefixes never change a verdict: any prefix added to every line of any real log or dump,
alone or stacked on another, gives the same headline kind and culprits.

A prefix that names a rank is only added to the lines whose rank is already known (as a real
launcher would add the rank that wrote them); the others get the same launcher's lines without
identity (a timestamp, a quote, a colour, a pod or a node name the whole file shares).
"""

import os

import pytest

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hangdoc.analysis.diagnose import diagnose
from hangdoc.analysis.grouping import build_report
from hangdoc.readers import read_text
from hangdoc.readers.prefix import Peeler

HERE = os.path.dirname(os.path.abspath(__file__))
FIX = os.path.join(HERE, "fixtures")


def _fixtures():
    out = []
    for d in ("logs/nccl", "logs/launch", "logs/captured"):
        base = os.path.join(FIX, d)
        out += sorted(os.path.join(base, n) for n in os.listdir(base) if n.endswith(".log"))
    out += [os.path.join(FIX, "gpu", s, "log.txt") for s in ("nccl_skip_broadcast", "nccl_dataloader_deadlock",
                                                             "nccl_pipeline_cycle")]
    dumps = os.path.join(FIX, "dumps")
    out += [os.path.join(dumps, "skip_broadcast", "traceback", "console.log"),
            os.path.join(dumps, "skip_broadcast", "console.log")]
    out += sorted(os.path.join(dumps, "skip_broadcast", "plain", n)
                  for n in os.listdir(os.path.join(dumps, "skip_broadcast", "plain")))
    return out


FIXTURES = _fixtures()
TEXTS = {}


def text_of(path):
    if path not in TEXTS:
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            TEXTS[path] = f.read().splitlines()
    return TEXTS[path]


def headline(lines):
    job = read_text("\n".join(lines) + "\n", name="x.log")
    report = build_report(job, "function+line")
    report.findings = diagnose(report)
    f = report.findings[0]
    return f.kind, sorted(c.rank for c in f.culprits if c.rank is not None)


# (name, prefix of a line with rank r or None) -> str; None: this family cannot label that line
FAMILIES = {
    "iso-time": lambda r, i: f"2025-03-0{1 + i % 9}T10:{i % 60:02d}:{i % 60:02d}.{i % 1000:03d}Z ",
    "log-time": lambda r, i: f"[2025-03-01 10:00:{i % 60:02d},{i % 1000:03d}] ",
    "clock": lambda r, i: f"10:00:{i % 60:02d} ",
    "pid": lambda r, i: "[48211] ",
    "quote": lambda r, i: "> ",
    "ansi": lambda r, i: "\x1b[36m",
    "lost-esc": lambda r, i: "[36m",
    "progress": lambda r, i: "Epoch 0:  6%|#2        | 32/500 [00:10<02:31]\r",
    "pdsh": lambda r, i: "gpu-node7: ",
    "kubectl": lambda r, i: "[pod/trainer-worker-0/pytorch] ",
    "compose": lambda r, i: "trainer-1  | ",
    "ray": lambda r, i: "(RayWorkerWrapper pid=14390) ",
    "glog-py": lambda r, i: f"E0207 07:54:{i % 60:02d}.862000 4712 torch/distributed/run.py:939] ",
    "logger": lambda r, i: f"ERROR 01-29 20:00:{i % 60:02d} multiproc_worker_utils.py:240] ",
    "torch-rank": lambda r, i: None if r is None else f"[rank{r}]: ",
    "tee": lambda r, i: None if r is None else f"[default{r}]:",
    "mpirun": lambda r, i: None if r is None else f"[1,{r}]<stderr>:",
    "horovod": lambda r, i: None if r is None else f"[{r}]<stderr>:",
    "hangdoc": lambda r, i: None if r is None else f"[node1:{r}] ",
    # srun --label: one task a rank ("12: "), or one task running torchrun for the whole job ("0: ")
    "srun": lambda r, i: None if r is None else f"{r}: ",
    "srun-one": lambda r, i: "0: ",
    # DeepSpeed's runner (pdsh): the node's name, two ranks a node
    "deepspeed": lambda r, i: "worker-0: " if r is None else f"worker-{r // 2}: ",
    "tee-role": lambda r, i: None if r is None else f"[trainer{r}]:",
    "template": lambda r, i: None if r is None else f"[vm:{r}]:",
    # stern's default template "{{.PodName}} {{.ContainerName}} {{.Message}}": one pod for the file,
    # or a pod a rank
    "stern": lambda r, i: "trainer-worker-0 pytorch ",
    "stern-pods": lambda r, i: None if r is None else f"trainer-worker-{r} pytorch ",
}
# what a family adds to a line it cannot label with a rank
FALLBACK = {"torch-rank": "quote", "tee": "iso-time", "mpirun": "pid", "horovod": "clock", "hangdoc": "log-time",
            "srun": "clock", "tee-role": "iso-time", "template": "pid", "stern-pods": "stern"}


def prefixed(lines, families):
    peeler = Peeler()
    peeler.learn(lines)
    ranks = [peeler.peel(x)[0][1] for x in lines]
    out = list(lines)
    for fam in reversed(families):  # the first family is the outermost
        make = FAMILIES[fam]
        new = []
        for i, (line, r) in enumerate(zip(out, ranks)):
            p = make(r, i)
            if p is None:
                p = FAMILIES[FALLBACK[fam]](r, i)
            if p.endswith("\r") and not lines[i]:
                # "...\r" before a line that was empty (colour codes aside) reads as a CRLF line end
                p = ""
            new.append(p + line)
        out = new
    return out


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.sampled_from(FIXTURES), families=st.lists(st.sampled_from(sorted(FAMILIES)), min_size=1, max_size=2))
def test_any_prefix_or_two_stacked_keep_the_verdict(path, families):
    lines = text_of(path)
    assert headline(prefixed(lines, families)) == headline(lines), families


@pytest.mark.parametrize("family", ["srun", "srun-one", "deepspeed", "tee-role", "template", "stern", "stern-pods"])
def test_each_launcher_family_alone_keeps_every_verdict(family):
    # every fixture, not a sample: "0: " before every line once moved 12 verdicts (the task id
    # taken for the rank over "[default3]:" and "[Rank 3]"), stern's "pod container " 25
    changed = [(os.path.relpath(p, FIX), headline(lines), headline(prefixed(lines, [family])))
               for p in FIXTURES for lines in [text_of(p)]]
    assert [c for c in changed if c[1] != c[2]] == []


def test_srun_task_id_is_the_rank_only_when_nothing_inside_names_one():
    one = Peeler()
    one.learn(["0: [default3]:a", "0: [default1]:b", "0: c"] * 3)
    assert one.task_is is None  # one task for the whole file: a launcher's, no rank
    assert one.peel("0: [default3]:x") == ((None, None, 3), "x")
    assert one.peel("0: [Rank 3] Watchdog") == ((None, None, None), "[Rank 3] Watchdog")
    nodes = Peeler()
    nodes.learn(["0: [default0]:a", "1: [default0]:b", "0: [default1]:c", "1: [default1]:d"] * 3)
    assert nodes.task_is == "node"  # srun ran torchrun a node: the task tells the nodes apart
    assert nodes.peel("1: [default1]:x") == (("task1", None, 1), "x")
    ranks = Peeler()
    ranks.learn(["0: a", "1: b", "0: c", "1: d"] * 3)
    assert ranks.peel("1: Traceback") == ((None, 1, None), "Traceback")
    # a label no head line taught, confirmed by the rank inside it
    assert Peeler().peel("3: [rank3]: boom") == ((None, 3, None), "boom")
    assert Peeler().peel("3: [rank2]: boom") == ((None, None, None), "3: [rank2]: boom")


def test_stern_pod_prefix_is_learnt_from_the_file():
    lines = [f"trainer-worker-{r} pytorch [rank{r}]: line {i}" for i in range(4) for r in range(3)]
    p = Peeler()
    p.learn(lines)
    assert p.peel("trainer-worker-2 pytorch [rank2]: Traceback") == (("trainer-worker-2", 2, None), "Traceback")
    q = Peeler()  # words that do not end in a replica's number are no pod
    q.learn(["loss is 0.3", "epoch3 done here", "step 12 loss 0.1"] * 5)
    assert q.pods == set() and q.peel("loss is 0.3") == ((None, None, None), "loss is 0.3")


def test_every_fixture_is_tried():
    assert len(FIXTURES) >= 130
