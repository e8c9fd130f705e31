"""NicerTrace: output checked line by line on a small program, on every Python we have."""

from __future__ import annotations

import os
import re
import sys
import textwrap

import pytest

from tests.procs import run

PYTHONS = [sys.executable] + [
    p for p in ("/root/.pyenv/versions/3.12.1/bin/python", "/root/.pyenv/versions/3.13.0/bin/python") if os.path.exists(p)
]

CORE = '''\
import json


def double(x):
    y = x * 2
    return y


def run(n):
    total = 0
    for i in range(n):
        total += double(i)
    return json.dumps({"total": total})
'''

MAIN = '''\
import json, sys, threading
from hangdoc import NicerTrace
from mypkg.core import run, double
pk = sys.argv[1]
packages = None if pk == "none" else ("uninstalled" if pk == "uninstalled" else pk.split(","))
tracer = NicerTrace(packages_to_include=packages, out_dir=sys.argv[2], log_pids=len(sys.argv) > 3)
def main():
    t = threading.Thread(target=double, args=(5,))
    t.start(); t.join()  # one line: the thread's lines come after it, before the next one
    return run(2)
print(tracer.runfunc(main))
print("FILE", tracer.file_path)
print("DUMPS", json.dumps.__code__.co_firstlineno)
'''

STAMP = re.compile(r"^\d\d:\d\d:\d\d ")


@pytest.fixture
def program(tmp_path):
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "core.py").write_text(CORE)
    (tmp_path / "main.py").write_text(MAIN)
    return tmp_path


def trace(program, python, packages, *extra, env=None):
    out = program / "out"
    res = run([python, "main.py", packages, str(out), *extra], cwd=str(program), timeout=60,
              env=dict({"LOCAL_RANK": "1"}, **(env or {})))
    assert res.returncode == 0, res.stderr
    info = dict(line.split(" ", 1) for line in res.stdout.splitlines() if line.startswith(("FILE", "DUMPS")))
    path = info["FILE"]
    lines = open(path).read().splitlines()
    pids = set()
    if extra:  # --log-pids: every line starts with the pid
        pids = {line.split(" ", 1)[0] for line in lines}
        lines = [line.split(" ", 1)[1] for line in lines]
    stamps = [line for line in lines if not line.startswith(" ")]
    assert stamps and all(STAMP.match(line) for line in stamps), stamps[:3]
    # the elapsed time is the only part that may differ from run to run
    return path, [STAMP.sub("T ", line) for line in lines], int(info["DUMPS"]), pids


def expected_user_lines(core):
    body = [
        f"        {core}:9 run",
        "T core.py:    10:     total = 0",
    ]
    for _ in range(2):
        body += [
            "T core.py:    11:     for i in range(n):",
            "T core.py:    12:         total += double(i)",
            f"        {core}:4 double",
            "T core.py:     5:     y = x * 2",
            "T core.py:     6:     return y",
        ]
    body += ["T core.py:    11:     for i in range(n):", 'T core.py:    13:     return json.dumps({"total": total})']
    return body


@pytest.mark.parametrize("python", PYTHONS, ids=lambda p: os.path.basename(os.path.dirname(os.path.dirname(p))) or p)
def test_uninstalled_traces_only_user_code_line_by_line(program, python):
    path, lines, _, _ = trace(program, python, "uninstalled")
    core = str(program / "mypkg" / "core.py")
    main = str(program / "main.py")
    assert lines == [
        f"        {main}:7 main",
        "T main.py:     8:     t = threading.Thread(target=double, args=(5,))",
        "T main.py:     9:     t.start(); t.join()  # one line: the thread's lines come after it, before the next one",
        f"        {core}:4 double",  # in the thread
        "T core.py:     5:     y = x * 2",
        "T core.py:     6:     return y",
        "T main.py:    10:     return run(2)",
    ] + expected_user_lines(core), "\n".join(lines)
    name = os.path.basename(path)
    assert re.fullmatch(r"trace-[^-]+-1-\d+\.txt", name), name


def test_package_list_adds_package_qualified_calls(program):
    _, lines, dumps_line, _ = trace(program, sys.executable, "json")
    calls = [line.strip() for line in lines if line.startswith(" ")]
    assert f"json:{dumps_line} dumps" in calls
    assert any(c.startswith("json.encoder:") and c.endswith(" encode") for c in calls)
    # stdlib modules not listed (threading) stay out; json's own lines are in, by basename
    assert not any(c.startswith("threading:") for c in calls)
    assert any(line.startswith("T __init__.py:") for line in lines)
    assert any(line.startswith("T encoder.py:") for line in lines)


def test_none_traces_everything_and_log_pids(program):
    _, lines, _, pids = trace(program, sys.executable, "none", "--log-pids")
    assert len(pids) == 1 and pids.pop().isdigit()
    calls = [line.strip() for line in lines if line.startswith(" ")]
    assert any(c.startswith("threading:") for c in calls), calls[:5]
    assert any(line.startswith("T threading.py:") for line in lines)


def test_decision_is_cached_per_code_object(tmp_path):
    from hangdoc.runtime.nicertrace import NicerTrace

    tracer = NicerTrace(packages_to_include="uninstalled", path=str(tmp_path / "t.txt"))
    decided = []
    real = tracer._decide
    tracer._decide = lambda code: decided.append(code) or real(code)

    def leaf(i):
        return i + 1

    def loop():
        return sum(leaf(i) for i in range(50)) + len(os.path.join("a", "b"))

    import gc

    # a collection during one run only would trace whatever gc callback a plugin registered
    # (hypothesis's gc_callback) once: the cache is what is measured here, not the collector
    gc.collect()
    gc.disable()
    try:
        tracer.runfunc(loop)
        tracer.runfunc(loop)  # a second run starts with a fresh cache
    finally:
        gc.enable()
    names = [c.co_name for c in decided]
    assert names.count("leaf") == 2 and names.count("join") == 2, names
    assert all(names.count(n) == 2 for n in set(names)), names
    text = open(tmp_path / "t.txt").read()
    assert text.count(" leaf\n") == 100 and "posixpath" not in text


def test_module_names(tmp_path):
    import json.decoder

    from hangdoc.runtime.nicertrace import NicerTrace

    t = NicerTrace()
    assert t.module_name(json.decoder.__file__) == ("json.decoder", True)
    assert t.module_name(json.__file__) == ("json", True)
    assert t.module_name(str(tmp_path / "x.py")) == (str(tmp_path / "x.py"), False)
    lib = tmp_path / "libs" / "minipkg"
    lib.mkdir(parents=True)
    t2 = NicerTrace(installed_dirs=[str(tmp_path / "libs")])
    assert t2.module_name(str(lib / "mod.py")) == ("minipkg.mod", True)
    with pytest.raises(ValueError):
        NicerTrace(packages_to_include=["x"], ignoredirs=["/usr"])


def test_forked_child_writes_its_own_file(tmp_path):
    script = tmp_path / "fork.py"
    script.write_text(textwrap.dedent('''\
        import os, sys
        from hangdoc import NicerTrace
        def work():
            pid = os.fork()
            if pid == 0:
                x = 1
                os._exit(0)
            os.waitpid(pid, 0)
            y = 2
        NicerTrace(packages_to_include="uninstalled", out_dir=sys.argv[1]).runfunc(work)
        '''))
    res = run([sys.executable, str(script), str(tmp_path / "out")], timeout=60)
    assert res.returncode == 0, res.stderr
    files = sorted(os.listdir(tmp_path / "out"))
    assert len(files) == 2, files
    texts = [open(tmp_path / "out" / f).read() for f in files]
    assert sum("x = 1" in t for t in texts) == 1 and sum("y = 2" in t for t in texts) == 1
    assert not any("x = 1" in t and "y = 2" in t for t in texts)
