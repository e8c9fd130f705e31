"""The rank side of ``@pytest.mark.world_size``: one pytest process per rank runs one test.

The parent starts ``python -m pytest NODEID`` once per rank with the ``HANGDOC_TESTING_*``
environment below; in such a process the plugin initialises the process group before the test's
fixtures, records every collective, and writes what happened into the run directory for the
parent to judge:

* ``started-r{rank}``: the test's setup began (the parent's hang clock starts from here, so slow
  imports under a busy CI machine do not count against ``timeout``);
* ``collectives-{host}-r{rank}-{pid}.jsonl``: the recorder's records (at teardown, or on request);
* ``faulthandler-{host}-r{rank}-{pid}.txt``: all thread stacks, tagged, when the parent asks;
* ``result-r{rank}.json``: outcome, failure text (shaped by the parent's ``--tb``), where and
  when it failed, and captured output of each phase.
"""

from __future__ import annotations

import faulthandler
import json
import os
import time
from datetime import timedelta
from typing import Any, Dict, List, Optional

from hangdoc.atomic import write_atomic

ENV_RANK = "HANGDOC_TESTING_RANK"
ENV_WORLD_SIZE = "HANGDOC_TESTING_WORLD_SIZE"
ENV_BACKEND = "HANGDOC_TESTING_BACKEND"
ENV_STORE = "HANGDOC_TESTING_STORE"
ENV_DIR = "HANGDOC_TESTING_DIR"
ENV_NODEID = "HANGDOC_TESTING_NODEID"
ENV_TIMEOUT = "HANGDOC_TESTING_TIMEOUT"
#: JSON of the parent's reporting options (``tbstyle``, ``showlocals``, ...): a rank formats its
#: tracebacks as the parent's own would be.
ENV_REPORT = "HANGDOC_TESTING_REPORT"


def in_child() -> bool:
    """True in a rank process started by the plugin."""
    return ENV_RANK in os.environ and ENV_DIR in os.environ


class RankSession:
    """State of the one rank this process is; created once per process by the plugin."""

    def __init__(self) -> None:
        env = os.environ
        self.rank = int(env[ENV_RANK])
        self.world_size = int(env[ENV_WORLD_SIZE])
        self.backend = env.get(ENV_BACKEND, "gloo")
        self.store_addr = env.get(ENV_STORE, "")
        self.dir = env[ENV_DIR]
        self.nodeid = env.get(ENV_NODEID, "")
        self.timeout = float(env.get(ENV_TIMEOUT, "60"))
        try:
            self.report_options: Dict[str, Any] = dict(json.loads(env.get(ENV_REPORT) or "{}"))
        except (ValueError, TypeError):
            self.report_options = {}
        # Read once and forget: a test that starts pytest itself must not make that one a rank too.
        from hangdoc.testing.procs import CONTROL_FD_ENV

        fd = env.get(CONTROL_FD_ENV)
        self.control_fd: Optional[int] = int(fd) if fd else None
        for name in [n for n in env if n.startswith("HANGDOC_TESTING_")]:
            del env[name]
        self.reports: List[Dict[str, Any]] = []
        self.collect_errors: List[str] = []
        self.recorder = None
        self.initialised = False
        from hangdoc.runtime.identity import short_hostname

        self.host = env.get("HANGDOC_HOST") or short_hostname()
        self.pid = os.getpid()

    def path(self, kind: str, ext: str) -> str:
        return os.path.join(self.dir, f"{kind}-{self.host}-r{self.rank}-{self.pid}.{ext}")

    def start_guard(self) -> None:
        from hangdoc.testing.procs import start_guard

        if self.control_fd is not None:
            os.set_inheritable(self.control_fd, False)
            start_guard(self.control_fd, self.dump_for_parent)

    def dump_for_parent(self) -> None:
        """Called from the guard thread while the main thread may be blocked in a collective."""
        from hangdoc.tags import format_tag

        self.dump_records()
        path = self.path("faulthandler", "txt")
        with open(path + ".part", "w") as f:
            f.write(
                format_tag(host=self.host, pid=self.pid, rank=self.rank, local_rank=self.rank,
                           world_size=self.world_size, ppid=os.getppid())
                + "\n"
            )
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        os.replace(path + ".part", path)
        write_atomic(os.path.join(self.dir, f"dumped-r{self.rank}"), "")

    # -- process group -------------------------------------------------------------------------

    def setup(self) -> None:
        write_atomic(os.path.join(self.dir, f"started-r{self.rank}"), str(self.pid))
        if self.initialised:
            return
        import torch.distributed as dist

        # The process group's own timeout sits well past the parent's, so that a hang is seen
        # (and dumped) by the parent instead of ending as an unrelated gloo timeout error.
        pg_timeout = timedelta(seconds=self.timeout * 2 + 60)
        if self.backend == "fake":
            from torch.testing._internal.distributed.fake_pg import FakeStore

            store = FakeStore()
        else:
            host, _, port = self.store_addr.rpartition(":")
            store = dist.TCPStore(host, int(port), self.world_size, is_master=False, timeout=pg_timeout)
        dist.init_process_group(self.backend, store=store, rank=self.rank, world_size=self.world_size,
                                timeout=pg_timeout)
        self.initialised = True
        self.recorder = _enable_recorder()

    def dump_records(self) -> None:
        rec = self.recorder
        if rec is None:
            return
        rec.dump(self.path("collectives", "jsonl"))

    def teardown(self) -> None:
        self.dump_records()
        if self.recorder is not None:
            # Off before exit: the recorder's own exit-time dump would land in the user's directory.
            from hangdoc.runtime import recorder

            recorder.disable()
            self.recorder = None
        if not self.initialised:
            return
        import torch.distributed as dist

        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # a peer that crashed can make the shutdown complain; the verdict is elsewhere
            pass
        self.initialised = False

    # -- results -------------------------------------------------------------------------------

    def add_report(self, report) -> None:
        entry: Dict[str, Any] = {
            "when": report.when,
            "outcome": report.outcome,
            "longrepr": _longrepr_text(report),
            "sections": [list(s) for s in report.sections],
            "duration": report.duration,
            # when it failed: the parent names the rank that failed first in the headline
            "at": time.time(),
        }
        crash = getattr(report.longrepr, "reprcrash", None)
        if crash is not None:
            entry["crash"] = {"path": str(crash.path), "lineno": int(crash.lineno), "message": str(crash.message)}
        if hasattr(report, "wasxfail"):
            entry["wasxfail"] = report.wasxfail
        self.reports.append(entry)

    def add_collect_error(self, report) -> None:
        self.collect_errors.append(_longrepr_text(report) or f"collection of {report.nodeid} failed")

    def write_result(self, exitstatus: int) -> None:
        data = {
            "rank": self.rank,
            "pid": self.pid,
            "host": self.host,
            "exitstatus": int(exitstatus),
            "reports": self.reports,
            "collect_errors": self.collect_errors,
        }
        write_atomic(os.path.join(self.dir, f"result-r{self.rank}.json"), json.dumps(data))


def _longrepr_text(report) -> str:
    if report.longrepr is None:
        return ""
    if isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
        return str(report.longrepr[2])  # a skip: (path, line, reason)
    try:
        return report.longreprtext
    except Exception:
        return str(report.longrepr)


def _enable_recorder():
    try:
        from hangdoc.runtime import recorder
    except ImportError:
        return None
    rec = recorder.enable()
    return rec


def read_result(directory: str, rank: int) -> Optional[Dict[str, Any]]:
    try:
        with open(os.path.join(directory, f"result-r{rank}.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
