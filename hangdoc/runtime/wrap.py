"""``hangdoc.wrap(main, **options)``: run a training entry point with hangdoc's in-job helpers.

    import hangdoc

    def main(epochs):
        ...

    if __name__ == "__main__":
        hangdoc.wrap(main, trace=["mypkg"], hang_timeout=300)(epochs=3)

Options (all off except ``prefix``; what is off costs nothing and imports nothing):

``prefix=True``, ``prefix_template=None``
    Prefix every stdout/stderr line with ``[host:rank] `` (:mod:`hangdoc.runtime.prefix`).
``trace=None``
    NicerTrace: a list of top-level packages (``["mypkg", "torch"]``) or a comma-separated string,
    ``"uninstalled"`` / ``True`` for your own code only, ``"all"`` for everything.
``log_pids=False``
    Start every trace line with the pid.
``out=None``
    The output directory (``$HANGDOC_OUT``, else ``./hangdoc-out``); created only when something
    is written there.
``record=None``
    The collective recorder: ``True`` on, ``False`` off, ``None`` on exactly when the watchdog is.
``hang_timeout=None``
    Seconds without progress after which the watchdog dumps every thread's stack.
``dump_signal="SIGUSR1"``
    The signal that makes the watchdog dump at once (``None`` for none).
``detect=False``
    Catch a diverged collective while the job runs (:mod:`hangdoc.runtime.detect`): ``True`` or
    ``"warn"`` logs the rank that diverged, at which collective, both sides' calls; ``"dump"`` also
    writes every rank's stacks and records; ``"abort"`` raises in every rank at its next
    collective. Turns the recorder on.

With the recorder on, PyTorch's Flight Recorder is turned on too where a GPU is visible
(``flight_recorder_env``: its dumps in the output directory; variables you set yourself win,
``TORCH_FR_BUFFER_SIZE=0`` keeps it off): the recorder reads exact CUDA completion states from it.

The recorder, watchdog and tracer modules are imported only when asked for; a helper that cannot
be imported or started (an ImportError, a tracer already running) is left out after one warning and
the job runs without it. An output directory that cannot be made or written (read-only, a file,
a full disk) costs only the files: the watchdog, the recorder and the detector still run, their
dumps are shared in memory through the job's store, and the verdict is printed.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

__all__ = ["wrap", "Helpers"]

TraceOption = Union[None, bool, str, Sequence[str]]


def _packages(trace: TraceOption) -> Union[None, str, List[str], bool]:
    """NicerTrace's ``packages_to_include`` for a ``trace`` option; False when tracing is off.

        >>> _packages(None), _packages(True), _packages("all"), _packages("mypkg, torch")
        (False, 'uninstalled', None, ['mypkg', 'torch'])
    """
    if trace is None or trace is False or trace == "" or trace == []:
        return False
    if trace is True or trace == "uninstalled":
        return "uninstalled"
    if trace in ("all", "*"):
        return None
    if isinstance(trace, str):
        trace = trace.split(",")
    return [p.strip() for p in trace if p and p.strip()]


def detect_policy(detect: Union[None, bool, str]) -> Optional[str]:
    """The detector policy a ``detect`` option asks for; None when off.

        >>> detect_policy(True), detect_policy("abort"), detect_policy(False)
        ('warn', 'abort', None)
    """
    if detect is None or detect is False or detect == "":
        return None
    if detect is True:
        return "warn"
    policy = str(detect).lower()
    if policy not in ("warn", "dump", "abort"):
        raise ValueError(f"detect must be True, 'warn', 'dump' or 'abort', not {detect!r}")
    return policy


def flight_recorder_env(out_dir: str) -> None:
    """Turn PyTorch's Flight Recorder on for the process groups created from now on (where a GPU
    is visible), its dumps into ``out_dir``; variables already set win (``TORCH_FR_BUFFER_SIZE=0``
    keeps it off).

    It records each collective in C++ (across jobs +0.5 to +7 us per small call on 2 x H200
    NCCL, docs/gpu.md) and tracks completion from the backend's own events: the recorder takes
    exact states from it at a dump for the calls its own spaced CUDA events leave open, and NCCL
    dumps it on a timeout."""
    env = os.environ
    if gpus_visible():  # on gloo it tracks no completion and costs ~1.2 us a call for nothing
        env.setdefault("TORCH_FR_BUFFER_SIZE", "20000")
    env.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    dump_prefix = os.path.join(out_dir, "nccl_trace_rank_")
    env.setdefault("TORCH_FR_DUMP_TEMP_FILE", dump_prefix)
    env.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", dump_prefix)


def gpus_visible() -> bool:
    """Whether this process may use an NVIDIA GPU, without importing torch (the driver's device
    files, and CUDA_VISIBLE_DEVICES not hiding them all)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    try:
        return bool(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return os.path.exists("/dev/nvidia0")


def _enable_detect(out_dir: str, policy: str) -> Any:
    from hangdoc.runtime import detect

    return detect.start(policy, out_dir=out_dir)


class Helpers:
    """The helpers one :func:`wrap` call started; ``stop()`` undoes them (in reverse order)."""

    def __init__(self) -> None:
        self.restore_prefix: Optional[Callable[[], None]] = None
        self.tracer: Any = None
        self.watchdog: Any = None
        self.recorder: Any = None
        self.detector: Any = None

    def start(
        self,
        *,
        prefix: bool = True,
        prefix_template: Optional[str] = None,
        trace: TraceOption = None,
        log_pids: bool = False,
        out: Optional[str] = None,
        record: Optional[bool] = None,
        hang_timeout: Optional[float] = None,
        dump_signal: Union[str, int, None] = "SIGUSR1",
        detect: Union[None, bool, str] = False,
    ) -> "Helpers":
        # A helper that fails to start must not take the job down: warn and run without it.
        if prefix:
            self._try("output prefix", self._start_prefix, prefix_template)
        packages = _packages(trace)
        policy = detect_policy(detect)
        if record is None:
            record = hang_timeout is not None
        if not (detect or record or hang_timeout is not None or packages is not False):
            return self
        from hangdoc.runtime.options import output_dir

        try:
            out_dir = output_dir(out)
        except OSError as e:
            # The watchdog, the recorder, the detector and the exchange need no files: their dumps
            # stay in memory, go through the job's store, and the verdict is printed all the same.
            out_dir = output_dir(out, create=False)
            warnings.warn(f"hangdoc: output directory unusable ({e}); running without files (dumps kept in "
                          "memory and shared through the job's store, the verdict printed)", RuntimeWarning, stacklevel=3)
        if record or policy is not None:
            flight_recorder_env(out_dir)  # before any process group exists (and the recorder)
        if hang_timeout is not None:
            self._try("watchdog", self._start_watchdog, hang_timeout, out_dir, dump_signal, record)
        elif record:
            self._try("recorder", self._start_recorder, out_dir)
        if policy is not None:
            self._try("detect", self._start_detect, out_dir, policy)
        if packages is not False:
            # Started last, so that hangdoc's own start-up is not in the trace.
            self._try("trace", self._start_tracer, packages, log_pids, out_dir)
        return self

    @staticmethod
    def _try(what: str, fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except Exception as e:
            warnings.warn(f"hangdoc: {what} not started ({type(e).__name__}: {e}); running without it", RuntimeWarning, stacklevel=4)

    def _start_prefix(self, template: Optional[str]) -> None:
        from hangdoc.runtime import launcher_prefix
        from hangdoc.runtime.prefix import prefix_output

        fds: Tuple[int, ...] = (1, 2)
        if template is None and not os.environ.get("HANGDOC_PREFIX_TEMPLATE"):
            template, fds = launcher_prefix.choose(fds)  # only what torchrun's own prefix lacks
        if fds:
            self.restore_prefix = prefix_output(template, fds=fds)
            launcher_prefix.note_prefix(template or os.environ.get("HANGDOC_PREFIX_TEMPLATE") or launcher_prefix.DEFAULT_TEMPLATE, fds)

    def _start_watchdog(self, hang_timeout: float, out_dir: str, dump_signal: Any, record: bool) -> None:
        from hangdoc.runtime import watchdog

        self.watchdog = watchdog.start(hang_timeout=hang_timeout, out_dir=out_dir, signum=dump_signal, record=record)

    def _start_recorder(self, out_dir: str) -> None:
        from hangdoc.runtime import recorder

        self.recorder = recorder.enable(out_dir=out_dir)

    def _start_detect(self, out_dir: str, policy: str) -> None:
        self.detector = _enable_detect(out_dir, policy)

    def _start_tracer(self, packages: Any, log_pids: bool, out_dir: str) -> None:
        from hangdoc.runtime.nicertrace import NicerTrace

        self.tracer = NicerTrace(packages_to_include=packages, log_pids=log_pids, out_dir=out_dir).start()

    def stop(self, restore_prefix: bool = True) -> None:
        if self.tracer is not None:
            self._try("trace stop", self.tracer.stop)
            self.tracer = None
        if self.watchdog is not None:
            from hangdoc.runtime import watchdog

            self._try("watchdog stop", watchdog.stop)
            self.watchdog = None
        if self.detector is not None:
            from hangdoc.runtime import detect

            self._try("detect stop", detect.stop)
            self.detector = None
        # The recorder stays on: it dumps its records at exit, which is what a post-mortem needs.
        if restore_prefix and self.restore_prefix is not None:
            self.restore_prefix()
            self.restore_prefix = None


def wrap(
    main: Optional[Callable[..., Any]] = None,
    *,
    prefix: bool = True,
    prefix_template: Optional[str] = None,
    trace: TraceOption = None,
    log_pids: bool = False,
    out: Optional[str] = None,
    record: Optional[bool] = None,
    hang_timeout: Optional[float] = None,
    dump_signal: Union[str, int, None] = "SIGUSR1",
    detect: Union[None, bool, str] = False,
) -> Callable[..., Any]:
    """Return a callable that runs ``main(*args, **kwargs)`` with the helpers the options ask for.

    Used bare as a decorator (``@hangdoc.wrap``) or with options (``@hangdoc.wrap(trace="mypkg")``).
    If ``main`` raises, output stays prefixed until the process exits, so the traceback is too.

        >>> import hangdoc
        >>> hangdoc.wrap(lambda a, b: a + b, prefix=False)(2, 3)
        5
    """
    options = dict(
        prefix=prefix, prefix_template=prefix_template, trace=trace, log_pids=log_pids, out=out,
        record=record, hang_timeout=hang_timeout, dump_signal=dump_signal, detect=detect,
    )
    detect_policy(detect)  # a bad value fails here, not inside the job
    if main is None:
        return lambda fn: wrap(fn, **options)  # type: ignore[arg-type]

    @functools.wraps(main)
    def run(*args: Any, **kwargs: Any) -> Any:
        helpers = Helpers().start(**options)  # type: ignore[arg-type]
        ok = False
        try:
            result = main(*args, **kwargs)
            ok = True
            return result
        except Exception as e:
            if helpers.watchdog is not None:  # the others will wait for this rank: tell their report why
                helpers.watchdog.raised(e)
            if helpers.detector is not None:  # and the detector's verdict
                helpers.detector.raised(e)
            raise
        finally:
            helpers.stop(restore_prefix=ok)

    return run
