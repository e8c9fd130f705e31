"""pytest plugin (``pytest11`` entry point ``hangdoc``): multi-rank tests that never hang.

``@pytest.mark.world_size(n, backend="gloo", timeout=60)`` runs the test once per rank, each rank
in its own process with an initialised process group, and passes only when every rank passed and
all ranks issued the same collectives in the same order with matching signatures. A rank that
outlives ``timeout`` gets its stacks taken, the aggregator's verdict goes into the failure, and
every process is killed. ``backend="fake"`` runs the ranks one after another inside the pytest
process (no communication), for order checks at large world sizes, each rank's turn bounded by
the same timeout. Inactive unless a test uses the mark or the fixtures. See docs/pytest-plugin.md.

    import torch, torch.distributed as dist, pytest

    @pytest.mark.world_size(2)
    def test_allreduce(rank, world_size):
        t = torch.ones(3) * rank
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0, 1.0]
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import pytest

from hangdoc.testing import child as _child
from hangdoc.testing.launch import child_command, child_env, run_dir_for
from hangdoc.testing.evidence import crash_text, hang_text, print_outputs, read_records, take_hang_evidence

DEFAULT_TIMEOUT = 60.0
#: how long ranks may take to get from spawn to the test's setup (imports, collection).
STARTUP_LIMIT = 120.0
#: how long after the first rank started the others may still be importing.
STARTUP_SPREAD = 60.0
BACKENDS = ("gloo", "fake")


@dataclass(frozen=True)
class Spec:
    world_size: int
    backend: str
    timeout: float


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("hangdoc", "hangdoc multi-rank tests")
    group.addoption(
        "--hangdoc-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="timeout of @pytest.mark.world_size tests that do not set one (default: ini hangdoc_timeout or 60)",
    )
    parser.addini("hangdoc_timeout", "default timeout in seconds of @pytest.mark.world_size tests", default="")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "world_size(n, backend='gloo', timeout=60): run the test on n ranks, one process each ('fake': "
        "in-process, no communication) and fail on a collective-order divergence or a hang",
    )
    if _child.in_child():
        session = _child.RankSession()
        config.stash[_RANK_KEY] = session
        config.pluginmanager.register(_RankHooks(session), "hangdoc-rank")
        # The rank runs without the terminal plugin, whose options these are: the parent's values.
        for name, value in session.report_options.items():
            setattr(config.option, name, value)
        session.start_guard()


_RANK_KEY = pytest.StashKey["_child.RankSession"]()
_SAVED_FIXTURES = pytest.StashKey[Sequence[str]]()
#: how the failure's crash line (``--tb=line``, the ``-r`` summary) should read: (path, lineno,
#: message), None for what pytest found, or a callable that rewrites pytest's message.
_CRASH_KEY = pytest.StashKey[Any]()


def _spec(item: pytest.Item) -> Optional[Spec]:
    mark = item.get_closest_marker("world_size")
    if mark is None:
        return None
    args, kwargs = list(mark.args), dict(mark.kwargs)
    n = args.pop(0) if args else kwargs.pop("n", kwargs.pop("world_size", None))
    backend = kwargs.pop("backend", args.pop(0) if args else "gloo")
    timeout = kwargs.pop("timeout", None)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.world_size needs a positive int world size, got {n!r}")
    if backend not in BACKENDS:
        raise pytest.UsageError(f"{item.nodeid}: world_size backend must be one of {BACKENDS}, got {backend!r}")
    if args or kwargs:
        raise pytest.UsageError(f"{item.nodeid}: unexpected world_size arguments {args or ''}{kwargs or ''}")
    if timeout is None:
        timeout = item.config.getoption("hangdoc_timeout")
    if timeout is None:
        ini = item.config.getini("hangdoc_timeout")
        timeout = float(ini) if ini else DEFAULT_TIMEOUT
    return Spec(n, backend, float(timeout))


def _in_process(item: pytest.Item, spec: Spec) -> bool:
    """Fake-backend tests run in-process unless a fixture (not just the test) depends on the rank."""
    if spec.backend != "fake" or not isinstance(item, pytest.Function):
        return False
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            return False
    except ImportError:
        return False
    rec = sys.modules.get("hangdoc.runtime.recorder")
    if rec is not None and rec.get() is not None:
        return False  # this process records its own calls (hangdoc.wrap(record=True), say): leave it alone
    info = item._fixtureinfo
    for name in info.names_closure:
        if name in ("rank", "world_size", "collective_trace"):
            continue
        defs = info.name2fixturedefs.get(name) or ()
        for fd in defs:
            if set(fd.argnames) & {"rank", "world_size"}:
                return False
    return True


# ---------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture
def rank(request: pytest.FixtureRequest) -> int:
    """This process's rank in a ``@pytest.mark.world_size`` test."""
    session = request.config.stash.get(_RANK_KEY, None)
    if session is not None:
        return session.rank
    if _spec(request.node) is not None:
        return 0  # in-process fake runs pass each rank's value to the test function directly
    return _from_dist("rank", "get_rank")


@pytest.fixture
def world_size(request: pytest.FixtureRequest) -> int:
    """The world size of a ``@pytest.mark.world_size`` test."""
    session = request.config.stash.get(_RANK_KEY, None)
    if session is not None:
        return session.world_size
    spec = _spec(request.node)
    if spec is not None:
        return spec.world_size
    return _from_dist("world_size", "get_world_size")


@pytest.fixture
def collective_trace():
    """This rank's recorded collectives so far: ``collective_trace.ops()``, ``.calls()``, ``.records()``."""
    from hangdoc.testing.order import RankTrace

    return RankTrace()


def _from_dist(name: str, getter: str) -> int:
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            return int(getattr(dist, getter)())
    except ImportError:
        pass
    raise pytest.UsageError(f"the {name!r} fixture needs @pytest.mark.world_size(n) on the test (or an initialised process group)")


# ---------------------------------------------------------------------------------------------
# rank processes: the hooks that run inside each one


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_setup(item: pytest.Item):
    session = item.config.stash.get(_RANK_KEY, None)
    if session is not None:
        session.setup()
    else:
        spec = _spec(item)
        if spec is not None and not _in_process(item, spec):
            # The parent only supervises: the test's fixtures are set up in the rank processes.
            item.stash[_SAVED_FIXTURES] = item.fixturenames
            item.fixturenames = []
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item):
    yield
    session = item.config.stash.get(_RANK_KEY, None)
    if session is not None:
        session.teardown()
    elif _SAVED_FIXTURES in item.stash:
        item.fixturenames = item.stash[_SAVED_FIXTURES]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    outcome = yield
    how = item.stash.get(_CRASH_KEY, None)
    if how is None or call.when != "call":
        return
    report = outcome.get_result()
    crash = getattr(report.longrepr, "reprcrash", None)
    if not report.failed or crash is None:
        return
    # pytest's crash line would point into this plugin (where pytest.fail was called) and repeat
    # the whole failure text: point it at the user's code, with the headline.
    path, lineno, message = how
    if callable(message):
        message = message(crash.message)
    if path is not None:
        crash.path, crash.lineno = str(path), int(lineno)
    crash.message = message


class _RankHooks:
    """Hooks that only a rank process has: they collect what the parent needs to judge the test."""

    def __init__(self, session: _child.RankSession) -> None:
        self.session = session

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.session.add_report(report)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.session.add_collect_error(report)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        self.session.teardown()
        self.session.write_result(exitstatus)
        from hangdoc.testing.procs import kill_rank_tree

        kill_rank_tree(os.getpid())  # what the test started outlives no rank, passed or not


# ---------------------------------------------------------------------------------------------
# the parent


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> Optional[bool]:
    if pyfuncitem.config.stash.get(_RANK_KEY, None) is not None:
        return None  # a rank process: run the test as usual
    spec = _spec(pyfuncitem)
    if spec is None:
        return None
    if _in_process(pyfuncitem, spec):
        _run_in_process(pyfuncitem, spec)
    else:
        _run_processes(pyfuncitem, spec)
    return True


def _run_in_process(item: pytest.Function, spec: Spec) -> None:
    from hangdoc.testing.deadline import RankDeadline
    from hangdoc.testing.order import _note, run_in_process
    from hangdoc.testing.verdict import collective_order

    fn = item.obj
    testargs = {arg: item.funcargs[arg] for arg in item._fixtureinfo.argnames}

    def call(r: int) -> None:
        if "rank" in testargs:
            testargs["rank"] = r
        if "world_size" in testargs:
            testargs["world_size"] = spec.world_size
        fn(**testargs)

    deadline = RankDeadline(spec.timeout, on_stuck=lambda hang: _end_session(item, spec, hang),
                            test_code=getattr(fn, "__code__", None))
    try:
        with deadline:
            records, errors = run_in_process(call, spec.world_size, deadline=deadline)
    finally:
        deadline.kill_new_processes()  # passed or not: the ranks' processes outlive no test
    hang = deadline.hung
    if hang is None and errors:
        order = collective_order(records, spec.world_size, "fake", set(errors))
        if not order.relevant:
            # The exception is the whole story: raise it as pytest would, so that its traceback,
            # --tb and xfail(raises=...) work as for any test.
            r, err = min(errors.items())
            others = sorted(set(errors) - {r})
            _note(err, f"raised on rank {r} of {spec.world_size} (fake backend, ranks run one after another in-process)"
                  + (f"; ranks {others} raised too" if others else ""))
            item.stash[_CRASH_KEY] = (None, None, lambda message: f"rank {r} failed: {message}")
            raise err
    failures = [_in_process_failure(item, r, err) for r, err in sorted(errors.items())]
    hang_report = None
    if hang is not None:
        hang_report = _in_process_hang(item, spec, hang, records)
        if hang.records_wrapped:
            records = {r: v for r, v in records.items() if r != hang.rank}
        else:
            records = _cap_hung(records, hang.rank)
    _fail_with(item, spec, failures, records, hang_report)


def _in_process_failure(item: pytest.Function, rank: int, err: BaseException):
    """A rank's exception as the failure of a rank process would carry it: its traceback shaped by
    --tb, by pytest."""
    from hangdoc.testing.verdict import RankFailure

    excinfo = pytest.ExceptionInfo.from_exc_info((type(err), err, err.__traceback__))
    try:
        rep = item.repr_failure(excinfo)
        text = str(rep)
        crash = getattr(rep, "reprcrash", None)
    except Exception:  # pragma: no cover - formatting must not hide the failure
        import traceback

        text, crash = "".join(traceback.format_exception(type(err), err, err.__traceback__)), None
    summary = crash.message if crash is not None else excinfo.exconly(tryshort=True)
    where = (str(crash.path), int(crash.lineno)) if crash is not None else None
    return RankFailure(rank, "failed", summary, text, where, at=float(rank))


def _in_process_hang(item: pytest.Function, spec: Spec, hang, records):
    from hangdoc.ranges import describe_ranks
    from hangdoc.testing.deadline import format_threads, innermost
    from hangdoc.testing.schedule import _site
    from hangdoc.testing.verdict import HangReport

    r, n = hang.rank, spec.world_size
    done, rest = list(range(r)), list(range(r + 1, n))
    head = f"hang: rank {r} did not finish within {spec.timeout:g} s (world size {n}, fake backend)"
    bits = ([f"{describe_ranks(done)} finished"] if done else []) + ([f"{describe_ranks(rest)} did not run"] if rest else [])
    if bits:
        head += "; " + ", ".join(bits) + " (the ranks run one after another in this process)"
    text = [f"---- rank {r} stacks at the timeout ----", format_threads(hang)]
    mine = records.get(r) or []
    if mine:
        last = mine[-1]
        count = f"more than {hang.records_wrapped:,}" if hang.records_wrapped else f"{len(mine):,}"
        text.append(f"rank {r} issued {count} collective call{'s' if len(mine) != 1 else ''} before the timeout, "
                    f"the last {last.describe()} at {_site(last)}"
                    + (" (more than the recorder holds: its order is not compared)" if hang.records_wrapped else ""))
    if hang.killed:
        text.append("killed the processes started during the test: "
                    + ", ".join(f"{pid} ({cmd[:80]})" for pid, cmd in hang.killed))
    frame = innermost(hang, str(item.path)) or innermost(hang)
    where = f"{frame.filename}:{frame.lineno}: stuck in {frame.name}" if frame else "stuck"
    return HangReport(head, "\n".join(text), [f"rank {r}: {where} at the timeout"], stopped=[r],
                      location=(frame.filename, frame.lineno) if frame else None)


def _cap_hung(records, rank: int):
    """A hung rank that looped over collectives until the deadline: its first calls are enough to
    compare (the diff shows a few), the rest would only slow the comparison down."""
    mine = records.get(rank) or []
    others = max((len(v) for k, v in records.items() if k != rank), default=0)
    if len(mine) <= others + 50:
        return records
    return {**records, rank: mine[:others + 50]}


def _end_session(item: pytest.Item, spec: Spec, hang) -> None:
    """The hung rank ignores the interruption (blocked in C code): the test can neither finish nor
    fail, so say why and end the pytest process instead of hanging it."""
    from hangdoc.testing.deadline import format_threads

    text = (f"\nhangdoc: {item.nodeid}: rank {hang.rank} did not finish within {spec.timeout:g} s (fake backend, "
            f"in this process) and did not leave the test when interrupted (it catches the interruption, or it is "
            f"blocked outside Python):\n"
            f"{format_threads(hang)}\nhangdoc: ending this pytest process, the only way not to hang it.\n")
    capman = item.config.pluginmanager.getplugin("capturemanager")
    try:
        if capman is not None:
            capman.suspend_global_capture(in_=True)
    except Exception:
        pass
    try:
        os.write(2, text.encode())
    except OSError:
        pass
    os._exit(1)


def _fail_with(item: pytest.Item, spec: Spec, failures, records, hang) -> None:
    """Fail the test with the verdict, if there is one; the crash line points at the user's code."""
    from hangdoc.testing.verdict import compose

    tbstyle = item.config.getoption("tbstyle", "auto") or "auto"
    verdict = compose(spec.world_size, spec.backend, failures, records, tbstyle, hang)
    if verdict is None:
        return
    path, lineno = verdict.location or _test_location(item)
    item.stash[_CRASH_KEY] = (path, lineno, verdict.title)
    pytest.fail(verdict.text, pytrace=False)


def _test_location(item: pytest.Item):
    path, lineno, _ = item.location
    return str(item.path) if item.path is not None else path, (lineno or 0) + 1


def _run_processes(item: pytest.Function, spec: Spec) -> None:
    from hangdoc.testing.procs import RankProcesses

    run_dir = run_dir_for(item)
    store = None
    store_addr = ""
    if spec.backend == "gloo":
        import torch.distributed as dist

        from datetime import timedelta

        # Port 0: the kernel picks a free port, so parallel tests (xdist) never collide.
        store = dist.TCPStore("127.0.0.1", 0, spec.world_size, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=spec.timeout * 2 + 60))
        store_addr = f"127.0.0.1:{store.port}"
    cmds = [child_command(item, run_dir, r) for r in range(spec.world_size)]
    envs = [child_env(item, spec, r, run_dir, store_addr) for r in range(spec.world_size)]
    ranks = RankProcesses(cmds, envs, log_dir=run_dir, cwd=str(item.config.invocation_params.dir), warm=True)
    hang: Optional[Dict[str, Any]] = None
    try:
        clock = _Clock(run_dir, ranks, spec.timeout)
        finished = ranks.wait(STARTUP_LIMIT + spec.timeout, until=clock.deadline)
        if not finished:
            hang = take_hang_evidence(ranks, run_dir, spec.world_size)
            hang["started"] = clock.all_started is not None
    finally:
        ranks.kill_all()
        del store
    _judge(item, spec, ranks, run_dir, hang)


class _Clock:
    """The hang clock starts once every rank reached the test (or exited), not at spawn."""

    def __init__(self, run_dir: str, ranks, timeout: float) -> None:
        self.run_dir = run_dir
        self.ranks = ranks
        self.timeout = timeout
        self.first_started: Optional[float] = None
        self.all_started: Optional[float] = None

    def deadline(self) -> Optional[float]:
        if self.all_started is not None:
            return None
        n = len(self.ranks.procs)
        ready = [os.path.exists(os.path.join(self.run_dir, f"started-r{r}")) or self.ranks.procs[r].poll() is not None
                 for r in range(n)]
        now = time.monotonic()
        if any(ready) and self.first_started is None:
            self.first_started = now
        if all(ready):
            self.all_started = now
            return now + self.timeout
        if self.first_started is not None:
            return self.first_started + STARTUP_SPREAD + self.timeout
        return None


# ---------------------------------------------------------------------------------------------
# the verdict


def _judge(item: pytest.Item, spec: Spec, ranks, run_dir: str, hang: Optional[Dict[str, Any]]) -> None:
    """Fail the test with what went wrong on its ranks; skip it when every rank skipped."""
    from hangdoc.ranges import describe_ranks
    from hangdoc.testing.verdict import HangReport, RankFailure

    n = spec.world_size
    results = {r: _child.read_result(run_dir, r) for r in range(n)}
    failures: List[RankFailure] = []
    skipped: Dict[int, str] = {}
    for r in range(n):
        if hang is not None and r in hang["alive"]:
            continue
        res = results[r]
        if res is None:
            how, text = crash_text(r, ranks.procs[r].returncode, ranks.output(r, limit=256_000))
            failures.append(RankFailure(r, "crashed", how, text))
            continue
        failure = _rank_failure(r, res, ranks)
        if failure is not None:
            failures.append(failure)
            continue
        skips = [e["longrepr"] for e in res["reports"] if e["outcome"] == "skipped"]
        if skips:
            skipped[r] = skips[0]

    hang_report = None
    if hang is not None:
        hung = hang["alive"]
        head = (f"hang: {describe_ranks(hung)} did not finish within {spec.timeout:g} s "
                f"(world size {n}, {spec.backend} backend)")
        if not hang.get("started"):
            head += "; not every rank reached the test"
        failed = {f.rank for f in failures}
        ok = [r for r in range(n) if r not in hung and r not in failed]
        if ok:
            head += f"; {describe_ranks(ok)} finished"
        tbstyle = item.config.getoption("tbstyle", "auto")
        hang_report = HangReport(head, hang_text(run_dir, hang, ranks, fake=spec.backend == "fake")
                                 if tbstyle not in ("no", "line") else "",
                                 # a fake group never blocks: a hung rank is stuck in its own code
                                 stopped=hung if spec.backend == "fake" else ())

    records = read_records(run_dir)
    crashed = [f.rank for f in failures if f.kind == "crashed"]
    print_outputs(ranks, [r for r in range(n) if r not in crashed])
    if not failures and hang is None and skipped and len(skipped) == n:
        pytest.skip(next(iter(skipped.values())))
    _fail_with(item, spec, failures, records, hang_report)


def _rank_failure(rank: int, res: Dict[str, Any], ranks):
    """The failure a rank process reported (its phases that failed, its collection errors), or None."""
    from hangdoc.testing.verdict import RankFailure

    bad = [e for e in res["reports"] if e["outcome"] == "failed"]
    texts = [f"{e['when']}: {e['longrepr']}" if e["when"] != "call" else e["longrepr"] for e in bad]
    texts += [f"collection failed:\n{t}" for t in res.get("collect_errors", ())]
    if not res["reports"] and not texts:
        texts.append(f"the test did not run in the rank process (pytest exit status {res['exitstatus']}); output:\n"
                     + ranks.output(rank))
    if not texts:
        return None
    first = bad[0] if bad else None
    crash = (first or {}).get("crash")
    if crash:
        summary, where = crash["message"], (crash["path"], crash["lineno"])
    else:
        summary, where = next((ln for ln in texts[0].splitlines() if ln.strip()), "failed"), None
    return RankFailure(rank, "failed", summary, "\n".join(texts), where,
                       at=float((first or {}).get("at", 0.0)), when=(first or {}).get("when", "collect"))
