"""hangdoc as cluster users install it: a wheel from a standard PEP 517 build, installed into a
fresh environment without torch, and the single-file ``hangdoc.pyz``; each run on a real fixture
with Python 3.8 (where one is on this machine) and with the current Python."""

import glob
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "dumps", "skip_broadcast", "plain")
#: the skip_broadcast fixture's verdict from stacks alone: rank 0 (pid 12610) waits in the
#: broadcast that one of the other three skipped; stacks cannot tell which, so all three are
#: named as candidates and none is blamed (culprits empty)
EXPECTED = ("collective-mismatch", set(), {12611, 12612, 12613})


def _python38():
    """A working Python 3.8: ``python3.8`` on PATH, else a pyenv one; None when there is none (a
    pyenv shim for a version that is not selected exists but fails, so each candidate is run)."""
    candidates = [shutil.which("python3.8")] + sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.8*/bin/python3.8")))
    for candidate in candidates:
        if not candidate:
            continue
        try:
            version = subprocess.run([candidate, "-c", "import sys; print(sys.version_info[:2] == (3, 8))"],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, universal_newlines=True,
                                     env=_clean_env(), timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            continue
        if version == "True":
            return candidate
    return None


def _clean_env():
    """An environment that cannot reach this checkout or the test venv's packages."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")}
    env["PYTHONNOUSERSITE"] = "1"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _run(cmd, cwd, timeout=120, env=None):
    proc = subprocess.run(cmd, cwd=cwd, env=_clean_env() if env is None else env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True, timeout=timeout)
    assert proc.returncode == 0, "%s failed (%d):\n%s\n%s" % (cmd, proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:])
    return proc.stdout


def _check_verdict(report_json):
    report = json.loads(report_json)
    headline = report["findings"][0]
    assert (headline["kind"], {c["pid"] for c in headline["culprits"]},
            {c["pid"] for c in headline.get("candidates", [])}) == EXPECTED
    assert report["processes"] == 4


@pytest.fixture(scope="module")
def pyz(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("pyz") / "hangdoc.pyz")
    _run([sys.executable, os.path.join(ROOT, "tools", "build_pyz.py"), "-o", out], cwd=ROOT)
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """A wheel built by a PEP 517 front end (``python -m build``, else ``pip wheel``) from a copy of
    the sources: setuptools writes build/ and *.egg-info beside the sources, not into the checkout."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(os.path.join(ROOT, name), str(src / name))
    shutil.copytree(os.path.join(ROOT, "hangdoc"), str(src / "hangdoc"),
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = str(tmp_path_factory.mktemp("dist"))
    if importlib.util.find_spec("build") is not None:
        cmd = [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", dist, str(src)]
    else:
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
               "--wheel-dir", dist, str(src)]
    _run(cmd, cwd=str(src), timeout=180, env=dict(os.environ))  # the front end as this interpreter finds it
    wheels = glob.glob(os.path.join(dist, "hangdoc-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_pyz_holds_only_the_core(pyz):
    import zipfile

    names = zipfile.ZipFile(pyz).namelist()
    assert "__main__.py" in names and "hangdoc/cli/aggregate.py" in names
    assert not [n for n in names if n.startswith(("tests/", "hangdoc/testing/")) or n.endswith(".pyc")]


def test_pyz_runs_aggregate_with_the_current_python_without_torch(pyz, tmp_path):
    venv_python = _fresh_venv(sys.executable, str(tmp_path / "venv"))
    assert _run([venv_python, "-c", "import importlib.util; print(importlib.util.find_spec('torch') is None)"],
                cwd=str(tmp_path)).strip() == "True"
    _check_verdict(_run([venv_python, pyz, "aggregate", "--format", "json", FIXTURE], cwd=str(tmp_path)))


def test_pyz_runs_aggregate_with_python38(pyz, tmp_path):
    python38 = _python38()
    if python38 is None:
        pytest.skip("no Python 3.8 on this machine (python3.8 on PATH or ~/.pyenv/versions/3.8*)")
    venv_python = _fresh_venv(python38, str(tmp_path / "venv38"))
    _check_verdict(_run([venv_python, pyz, "aggregate", "--format", "json", FIXTURE], cwd=str(tmp_path)))


def _fresh_venv(python, where):
    """A fresh venv without pip (and so without torch or anything else); returns its python."""
    _run([python, "-m", "venv", "--without-pip", where], cwd=os.path.dirname(where))
    return os.path.join(where, "bin", "python")


def _install_wheel(venv_python, wheel, cwd):
    # This interpreter's pip installs into the venv (pip >= 22.3 --python), offline, no dependencies:
    # the core has none.
    _run([sys.executable, "-m", "pip", "--python", venv_python, "install", "--quiet", "--no-deps",
          "--no-index", wheel], cwd=cwd)


def test_wheel_in_a_fresh_venv_without_torch(wheel, tmp_path):
    venv_python = _fresh_venv(sys.executable, str(tmp_path / "venv"))
    _install_wheel(venv_python, wheel, str(tmp_path))
    probe = _run([venv_python, "-c", "import importlib.util, hangdoc; "
                  "print(importlib.util.find_spec('torch') is None, hangdoc.__file__)"], cwd=str(tmp_path))
    no_torch, location = probe.split()
    assert no_torch == "True" and location.startswith(str(tmp_path / "venv"))
    hangdoc_script = os.path.join(str(tmp_path / "venv"), "bin", "hangdoc")
    _check_verdict(_run([hangdoc_script, "aggregate", "--format", "json", FIXTURE], cwd=str(tmp_path)))


def test_wheel_with_python38(wheel, tmp_path):
    python38 = _python38()
    if python38 is None:
        pytest.skip("no Python 3.8 on this machine (python3.8 on PATH or ~/.pyenv/versions/3.8*)")
    venv_python = _fresh_venv(python38, str(tmp_path / "venv38"))
    site = _run([venv_python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=str(tmp_path)).strip()
    # This interpreter's pip (it may be too new to run under 3.8) installs into the 3.8 venv's
    # site-packages; the venv's own python then runs it (its console script would name this python).
    _run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--target", site, wheel],
         cwd=str(tmp_path))
    hangdoc_cmd = [venv_python, "-m", "hangdoc"]
    _check_verdict(_run(hangdoc_cmd + ["aggregate", "--format", "json", FIXTURE], cwd=str(tmp_path)))


# -- HANGDOC="options" torchrun ... script.py: the wheel's startup hook (hangdoc/startup.py) ----------

FAILING = """\
import os
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
dist.all_reduce(torch.ones(1))
print("rank", dist.get_rank(), "sees HANGDOC =", os.environ.get("HANGDOC"), flush=True)
def step():
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 gave up")
    dist.barrier()
step()
"""


@pytest.fixture(scope="module")
def venv_with_wheel_and_torch(wheel, tmp_path_factory):
    """A fresh venv with the wheel installed, and this environment's torch reachable through a
    .pth that site reads after hangdoc's (the case of a venv made with --system-site-packages)."""
    where = tmp_path_factory.mktemp("startup")
    venv_python = _fresh_venv(sys.executable, str(where / "venv"))
    _install_wheel(venv_python, wheel, str(where))
    site = _run([venv_python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=str(where)).strip()
    torch_spec = importlib.util.find_spec("torch")
    if torch_spec is None:
        pytest.skip("torch is not installed here (pip install torch)")
    with open(os.path.join(site, "zz-torch-from-the-test-env.pth"), "w") as f:
        f.write(os.path.dirname(os.path.dirname(torch_spec.origin)) + "\n")
    return venv_python, site


def test_wheel_holds_and_installs_the_startup_pth(wheel, venv_with_wheel_and_torch, tmp_path):
    import zipfile

    from hangdoc.startup import PTH_LINE, PTH_NAME

    assert zipfile.ZipFile(wheel).read(PTH_NAME).decode() == PTH_LINE
    venv_python, site = venv_with_wheel_and_torch
    with open(os.path.join(site, PTH_NAME)) as f:
        assert f.read() == PTH_LINE
    # without $HANGDOC the line imports nothing of hangdoc's; a bad value is one line, not a failure
    probe = "import sys; print(sorted(m for m in sys.modules if m.startswith('hangdoc')))"
    assert _run([venv_python, "-c", probe], cwd=str(tmp_path)).strip() == "[]"
    script = tmp_path / "ok.py"
    script.write_text("print('ran')\n")
    env = _clean_env()
    env["HANGDOC"] = "--record --no-such-option"
    proc = subprocess.run([venv_python, str(script)], cwd=str(tmp_path), env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, universal_newlines=True, timeout=60)
    assert (proc.returncode, proc.stdout) == (0, "ran\n"), proc.stderr
    assert re.fullmatch(r"hangdoc: \$HANGDOC: unrecognized arguments: --no-such-option; the job runs without hangdoc\n",
                        proc.stderr), proc.stderr
    assert not (tmp_path / "hangdoc-out").exists()


def test_hangdoc_env_under_torchrun_names_the_script_in_the_failure_table(venv_with_wheel_and_torch, tmp_path):
    from tests.procs import kill_group

    venv_python, _ = venv_with_wheel_and_torch
    script = tmp_path / "failing_train.py"
    script.write_text(FAILING)
    env = _clean_env()
    env.update(HANGDOC="--record", OMP_NUM_THREADS="1")
    cmd = [venv_python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--monitor-interval=0.1",
           str(script)]
    proc = subprocess.Popen(cmd, cwd=str(tmp_path), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            universal_newlines=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        kill_group(proc)
    assert proc.returncode == 1, out[-4000:]
    # torchrun's table is titled with the script, and shows its traceback (hangdoc's error file)
    assert re.search(r"^\S*failing_train\.py FAILED$", out, re.M), out[-4000:]
    assert "hangdoc FAILED" not in out
    table = out[out.index("Root Cause (first observed failure):"):]
    assert 'failing_train.py", line 9, in step' in table and "RuntimeError: rank 1 gave up" in table, table
    # the same runtime as -m hangdoc: output prefixed once, without torch's "[rank1]: "
    assert re.search(r"^\[[^\]]+:1\] RuntimeError: rank 1 gave up$", out, re.M), out[-4000:]
    assert "[rank1]:" not in out
    # the rank took the variable out of its environment: its children are not wrapped again
    assert re.search(r"^\[[^\]]+:1\] rank 1 sees HANGDOC = None$", out, re.M), out[-4000:]
    # --record: hangdoc's output directory, with the raising rank's records dumped at its exit
    out_dir = tmp_path / "hangdoc-out"
    assert out_dir.is_dir(), out[-4000:]
    assert glob.glob(str(out_dir / "collectives-*-r1-*.jsonl")), sorted(os.listdir(str(out_dir)))
