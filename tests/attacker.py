"""A second local user for the shared-node attack tests (issue 20): files and processes of someone
else on the same node.

``attacker()`` gives ``(uid, gid, prefix)``, ``prefix`` the command prefix that runs a program as
that user (``setpriv``); it skips the test, with the reason, where the machine does not allow it
(not root, no ``setpriv``/``useradd``, or the user cannot run this Python).
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from typing import List, Tuple

import pytest

NAME = "hdattacker"


def attacker() -> Tuple[int, int, List[str]]:
    if os.geteuid() != 0:
        pytest.skip("acting as a second local user needs root (to create it and switch to it)")
    if shutil.which("setpriv") is None:
        pytest.skip("no setpriv to run a process as a second user")
    try:
        user = pwd.getpwnam(NAME)
    except KeyError:
        if shutil.which("useradd") is None:
            pytest.skip(f"no user {NAME} and no useradd to create it")
        r = subprocess.run(["useradd", "-M", "-r", "-s", "/bin/sh", NAME], capture_output=True, text=True)
        if r.returncode not in (0, 9):  # 9: it exists (another test created it meanwhile)
            pytest.skip(f"useradd {NAME} failed: {r.stderr.strip()}")
        user = pwd.getpwnam(NAME)
    prefix = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups", "--"]
    probe = subprocess.run(prefix + [sys.executable, "-c", "import os; print(os.getuid())"],
                           capture_output=True, text=True, timeout=60)
    if probe.returncode != 0 or probe.stdout.strip() != str(user.pw_uid):
        pytest.skip(f"{NAME} cannot run {sys.executable}: {probe.stderr.strip()[-200:]}")
    return user.pw_uid, user.pw_gid, prefix


def attacker_dir(uid: int, gid: int) -> str:
    """A fresh directory the attacker owns (in the temp dir: pytest's tmp_path is root's alone)."""
    d = tempfile.mkdtemp(prefix="hangdoc-attack-")
    os.chown(d, uid, gid)
    os.chmod(d, 0o755)
    return d
