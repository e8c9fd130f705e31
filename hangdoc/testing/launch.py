"""How the parent starts a rank process of a multi-rank test: its run directory, its command line
(the parent's own pytest options that decide how the test is collected, never ``-n`` or ``--lf``)
and its environment (``hangdoc.testing.child``'s variables and torchrun's).

    >>> import sys
    >>> class Item:  # the two attributes _node_arg reads
    ...     nodeid, path = "tests/test_a.py::test_x[2]", "/repo/tests/test_a.py"
    >>> _node_arg(Item())
    '/repo/tests/test_a.py::test_x[2]'
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from typing import Any, Dict, List, Optional

import pytest

from hangdoc.testing import child as _child

#: the pytest options that shape a traceback, passed on to the rank processes
REPORT_OPTIONS = ("tbstyle", "showlocals", "fulltrace", "verbose")


def run_dir_for(item: pytest.Item) -> str:
    name = re.sub(r"[^\w]+", "_", item.name)[:30] or "test"
    factory = getattr(item.config, "_tmp_path_factory", None)
    if factory is not None:
        try:
            return str(factory.mktemp(f"hangdoc-{name}", numbered=True))
        except Exception:
            pass
    return tempfile.mkdtemp(prefix=f"hangdoc-{name}-")


def _forwarded_args(config: pytest.Config) -> List[str]:
    """Options of the parent's command line that decide how the rank processes collect the test."""
    args = list(config.invocation_params.args)
    out: List[str] = []
    i = 0
    takes_value = {"-p", "--import-mode", "--confcutdir", "-o", "--override-ini", "-c", "--config-file"}
    flags = {"--noconftest"}
    while i < len(args):
        a = str(args[i])
        if a in takes_value and i + 1 < len(args):
            out += [a, str(args[i + 1])]
            i += 2
            continue
        if (a.startswith("-p") and len(a) > 2 and not a.startswith("--")) or a in flags or any(
            a.startswith(k + "=") for k in takes_value if k.startswith("--")
        ):
            out.append(a)
        i += 1
    return out


def child_command(item: pytest.Item, run_dir: str, rank: int) -> List[str]:
    config = item.config
    cmd = [sys.executable, "-m", "pytest"]
    forwarded = _forwarded_args(config)
    cmd += forwarded
    # Loaded through the entry point, the rank process loads it the same way; else name it.
    if config.pluginmanager.get_plugin("hangdoc") is None and "hangdoc.testing.plugin" not in forwarded:
        cmd += ["-p", "hangdoc.testing.plugin"]
    cmd += [
        "--rootdir", str(config.rootpath),
        "-o", "addopts=",
        "-p", "no:cacheprovider",
        "-p", "no:xdist",
        "-p", "no:randomly",
        # xfail marks are judged once, by the parent, on the merged outcome.
        "--runxfail",
        # The rank's output is the test's own, unbuffered into the log the parent shows.
        "--capture=no",
        "-p", "no:terminal",
    ]
    if config.inipath is not None and not any(a in ("-c", "--config-file") for a in forwarded):
        cmd += ["-c", str(config.inipath)]
    # Each rank its own basetemp: ranks must not rotate (delete) each other's tmp_path.
    cmd += ["--basetemp", os.path.join(run_dir, f"tmp-r{rank}"), _node_arg(item)]
    return cmd


def _node_arg(item: pytest.Item) -> str:
    """The node id with an absolute file path: the rank runs in the parent's working directory,
    which need not be the rootdir that node ids are relative to."""
    file_part, sep, rest = item.nodeid.partition("::")
    path = str(item.path) if item.path is not None and sep else file_part
    return path + sep + rest


def child_env(item: pytest.Item, spec: Any, rank: int, run_dir: str, store_addr: str) -> Dict[str, Optional[str]]:
    import hangdoc

    root = os.path.dirname(os.path.dirname(os.path.abspath(hangdoc.__file__)))
    pythonpath = os.environ.get("PYTHONPATH", "")
    env: Dict[str, Optional[str]] = {
        _child.ENV_RANK: str(rank),
        _child.ENV_WORLD_SIZE: str(spec.world_size),
        _child.ENV_BACKEND: spec.backend,
        _child.ENV_STORE: store_addr,
        _child.ENV_DIR: run_dir,
        _child.ENV_NODEID: item.nodeid,
        _child.ENV_TIMEOUT: str(spec.timeout),
        "RANK": str(rank),
        "WORLD_SIZE": str(spec.world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(spec.world_size),
        "PYTHONPATH": root + (os.pathsep + pythonpath if pythonpath else ""),
        # Nothing from the parent's command line environment: no "-n 4", no "--lf" in a rank.
        "PYTEST_ADDOPTS": "",
        _child.ENV_REPORT: json.dumps({k: getattr(item.config.option, k) for k in REPORT_OPTIONS
                                       if isinstance(getattr(item.config.option, k, None), (str, int, float, bool))}),
    }
    if store_addr:
        env["MASTER_ADDR"], _, env["MASTER_PORT"] = store_addr.rpartition(":")
    # A rank is not an xdist worker, nor the test run that started it.
    for k in os.environ:
        if k.startswith("PYTEST_XDIST_") or k == "PYTEST_CURRENT_TEST":
            env[k] = None
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = "1"  # as torchrun does: n ranks must not each spin up a thread per core
    return env
