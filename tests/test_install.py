"""hangdoc as cluster users install it: a wheel from a standard PEP 517 build, installed into a
fresh environment without torch, and the single-file ``hangdoc.pyz``; each run on a real fixture
with Python 3.8 (where one is on this machine) and with the current Python."""

import glob
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "dumps", "skip_broadcast", "plain")
#: the skip_broadcast fixture's verdict from stacks alone: rank 0 (pid 12610) waits in the
#: broadcast that one of the other three skipped; stacks cannot tell which, so all three are named
EXPECTED = ("collective-mismatch", {12611, 12612, 12613})


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
    assert (headline["kind"], {c["pid"] for c in headline["culprits"]}) == EXPECTED
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
    for name in ("pyproject.toml", "README.md"):
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
