"""``hangdoc run`` / ``python -m hangdoc [options] script.py [args]``: an unmodified script, wrapped.

    torchrun --nproc-per-node 4 -m hangdoc --trace mypkg --hang-timeout 300 train.py --lr 0.1

runs ``train.py --lr 0.1`` in every rank as ``python train.py --lr 0.1`` would (``sys.argv``,
``sys.path[0]`` and ``__name__ == "__main__"`` as usual), with the helpers of
:func:`hangdoc.wrap` that the options ask for. ``-m MODULE`` runs a module instead of a script.
Everything after the script name belongs to the script.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", metavar="DIR", help="output directory for everything hangdoc writes ($HANGDOC_OUT, default ./hangdoc-out)")
    parser.add_argument("--trace", metavar="PKG[,PKG]", help="NicerTrace these top-level packages plus your own code ('uninstalled': only your code, 'all': everything)")
    parser.add_argument("--log-pids", action="store_true", help="start each trace line with the pid")
    parser.add_argument("--no-prefix", dest="prefix", action="store_false", help="do not prefix output lines with [host:rank]")
    parser.add_argument("--prefix-template", metavar="T", help="output prefix, e.g. '[${role_name}${rank}] ' (default '[{host}:{rank}] ')")
    record = parser.add_mutually_exclusive_group()
    record.add_argument("--record", dest="record", action="store_true", default=None, help="record every collective call (on with --hang-timeout)")
    record.add_argument("--no-record", dest="record", action="store_false", help="no collective recorder, even with --hang-timeout")
    parser.add_argument("--hang-timeout", metavar="S", help="dump every thread's stack after S seconds without progress; "
                        "'auto' (or 'auto:FLOOR') learns the limit from the job's own pauses: 3x the longest so far, "
                        "at least FLOOR seconds (default 60)")
    parser.add_argument("--dump-signal", default="SIGUSR1", metavar="SIG", help="signal that dumps stacks at once (default SIGUSR1; 'none' for none)")
    parser.add_argument("--detect", action="store_true", help="catch a diverged collective while the job runs: rolling signatures compared through the store (turns the recorder on)")
    parser.add_argument("--detect-policy", choices=("warn", "dump", "abort"), default=None, help="on a divergence: warn (log it, default), dump (also every rank's stacks and records), abort (raise at the next collective); implies --detect")
    # REMAINDER: everything after `-m MODULE` is the module's, as with `python -m`
    parser.add_argument("-m", dest="module", nargs=argparse.REMAINDER, metavar="MODULE", help="run a module (like python -m) instead of a script")
    parser.add_argument("script", nargs="?", help="the training script")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")


def run(args: argparse.Namespace) -> int:
    from hangdoc.cli import UsageError
    from hangdoc.runtime.wrap import wrap

    if args.module is not None:
        if not args.module:
            raise UsageError("-m needs a module name")
        args.module, args.args = args.module[0], args.module[1:]
    if not args.module and not args.script:
        raise UsageError("no script given: hangdoc [options] script.py [args]")
    if args.script and not os.path.exists(args.script):
        raise UsageError(f"can't open file {args.script!r}: no such file")
    options = wrap_options(args)
    # the job is wrapped by this command line: a $HANGDOC it inherited (hangdoc.startup's opt-in)
    # must not wrap the script's own child processes a second time
    os.environ.pop("HANGDOC", None)
    if args.module:
        import importlib.util

        # as `python -m` says it: one line, exit status 1 (a package that raises while imported
        # other than with ImportError is the script's error, shown with its traceback later)
        try:
            missing = None if importlib.util.find_spec(args.module) is not None else f"No module named {args.module}"
        except ImportError as e:
            missing = f"Error while finding module specification for {args.module!r} ({type(e).__name__}: {e})"
        except Exception:
            missing = None
        if missing:
            print(f"{sys.executable}: {missing}", file=sys.stderr)
            return 1

    def main() -> None:
        if args.module:
            sys.argv = [args.module] + list(args.args)
            sys.path.insert(0, os.getcwd())
            runpy.run_module(args.module, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [args.script] + list(args.args)
            sys.path.insert(0, os.path.dirname(os.path.abspath(args.script)))
            runpy.run_path(os.path.abspath(args.script), run_name="__main__")  # __file__ absolute, as python sets it

    def main_with_clean_traceback() -> None:
        try:
            main()
        except KeyboardInterrupt as e:
            # Ctrl-C: the traceback Python shows (where the script was), then death by SIGINT
            e.with_traceback(_strip_wrapper_frames(e.__traceback__))
            _excepthook()(type(e), e, e.__traceback__)
            interrupted.append(True)
            raise SystemExit(130) from None
        except Exception as e:
            # Show the traceback as `python script.py` would: from the script's first frame on,
            # without hangdoc's and runpy's frames in front of it. Exit status 1, as Python's.
            # (the default hook prints e.__traceback__, not its tb argument: set both)
            e.with_traceback(_strip_wrapper_frames(e.__traceback__))
            _excepthook()(type(e), e, e.__traceback__)
            _record_for_torchelastic(e)
            from hangdoc.runtime import watchdog

            dog = watchdog.get()
            if dog is not None:  # the others will wait for this rank: tell their report why
                dog.raised(e)
            from hangdoc.runtime import detect

            det = detect.get()
            if det is not None:  # and the detector's verdict
                det.raised(e)
            raise SystemExit(1) from None

    interrupted: list = []
    try:
        wrap(main_with_clean_traceback, **options)()
    except SystemExit:
        if interrupted:
            _die_by_sigint()
        raise
    return 0


def _die_by_sigint() -> None:
    """End as Python ends on Ctrl-C: exit handlers run, then killed by SIGINT, so a shell loop or a
    launcher sees the signal (an exit status of 130 does not stop `for ...; do hangdoc ...; done`)."""
    import atexit
    import signal

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    try:
        atexit._run_exitfuncs()
    except Exception:
        pass
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)


def wrap_options(args: argparse.Namespace) -> dict:
    """The keyword arguments of :func:`hangdoc.wrap` that parsed options ask for (shared with
    :mod:`hangdoc.startup`, so ``HANGDOC="..."`` means what the same options of ``-m hangdoc`` do);
    raises ``UsageError`` for a value ``wrap`` would refuse inside the job.

        >>> parser = argparse.ArgumentParser(); add_arguments(parser)
        >>> options = wrap_options(parser.parse_args(["--hang-timeout", "300", "--dump-signal", "none"]))
        >>> options["hang_timeout"], options["dump_signal"], options["record"]
        (300.0, None, None)
    """
    from hangdoc.cli import UsageError

    if args.hang_timeout is not None:
        from hangdoc.runtime.watchdog import parse_hang_timeout

        try:
            auto, seconds = parse_hang_timeout(args.hang_timeout)
        except ValueError:
            raise UsageError("--hang-timeout must be positive seconds, 'auto' or 'auto:SECONDS'") from None
        args.hang_timeout = args.hang_timeout.strip() if auto else seconds
    signal_name = None if str(args.dump_signal).lower() in ("none", "", "0") else args.dump_signal
    if signal_name is not None:
        from hangdoc.runtime.options import signal_number

        try:
            signal_number(signal_name)
        except (AttributeError, ValueError):
            raise UsageError(f"--dump-signal {signal_name}: no such signal (e.g. SIGUSR1, SIGUSR2, 'none')")
    return dict(
        prefix=args.prefix,
        prefix_template=args.prefix_template,
        trace=args.trace,
        log_pids=args.log_pids,
        out=args.out,
        record=args.record,
        hang_timeout=args.hang_timeout,
        dump_signal=signal_name,
        detect=(args.detect_policy or "warn") if (args.detect or args.detect_policy) else False,
    )


def _strip_wrapper_frames(tb):
    import hangdoc

    skip = (os.path.dirname(os.path.abspath(hangdoc.__file__)) + os.sep, os.path.abspath(runpy.__file__), "<frozen runpy>")
    first = tb
    while first is not None and first.tb_frame.f_code.co_filename.startswith(skip):
        first = first.tb_next
    return first if first is not None else tb


def _excepthook():
    """``sys.excepthook``, less the ``[rankN]: `` that torch's (installed by init_process_group)
    puts on each traceback line where every line carries the rank already (hangdoc's prefix, or
    torchrun's on one node): ``[vm:1] [rank1]: Traceback`` was the rank twice."""
    from hangdoc.runtime.launcher_prefix import rank_shown

    hook = sys.excepthook
    if getattr(hook, "__name__", "") != "_distributed_excepthook" or \
            getattr(hook, "__module__", "") != "torch.distributed.distributed_c10d":
        return hook
    try:
        inner = hook.__closure__[hook.__code__.co_freevars.index("old_hook")].cell_contents  # type: ignore[index]
    except (AttributeError, ValueError, IndexError, TypeError):
        return hook  # another torch: keep its hook rather than guess
    return inner if callable(inner) and rank_shown(2) else hook


def _record_for_torchelastic(e: BaseException) -> None:
    """Under torchrun, leave the script's exception in the rank's ``TORCHELASTIC_ERROR_FILE``, as
    torch's ``@record`` does, so torchrun's failure table shows the script's traceback and error
    (its title names the launched entrypoint, ``hangdoc`` for ``-m hangdoc``: torchrun builds it from
    its own command line, out of the rank's reach; ``HANGDOC="options" torchrun ... train.py``,
    :mod:`hangdoc.startup`, keeps ``train.py`` there). A file already there (the script's own
    ``@record``) is kept."""
    import json
    import time
    import traceback

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": f"{type(e).__name__}: {e}", "extraInfo": {
        "py_callstack": "".join(traceback.format_exception(type(e), e, e.__traceback__)),
        "timestamp": str(int(time.time()))}}}
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except OSError:
        return
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
