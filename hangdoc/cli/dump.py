"""``hangdoc dump``: the stacks of every Python process on this node, tagged with its rank.

Writes ``trace-{host}.out`` (or ``-o FILE``, ``-o -`` for stdout), ready for::

    srun --overlap --jobid $JOB --ntasks-per-node=1 --output=trace-%N.out hangdoc dump -o -
    hangdoc aggregate trace-*.out

Exit status 0 when every process found was dumped (or exited meanwhile: ``# hangdoc exited``
lines), 1 when some could not be (they are in the output with ``status=unresponsive``), 2 when no
Python process was found or on a usage error (an output file that cannot be created is found
before anything is dumped), 3 when the output file could not be written after the dump: the
stacks then go to stdout, so they are not lost.
"""

from __future__ import annotations

import argparse
import os
import sys

from hangdoc.cli import UsageError, write_stdout


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pid", type=int, metavar="LAUNCHER_PID",
                        help="dump this process and its descendants (torchrun, srun step, ...) instead of all of this user's Python processes")
    parser.add_argument("--all-users", action="store_true", help="also other users' processes (needs the privileges to read them)")
    parser.add_argument("--native", action="store_true", help="py-spy --native: C/C++ frames too")
    parser.add_argument("--locals", action="store_true", help="py-spy --locals: local variables of each frame")
    parser.add_argument("--nonblocking", action="store_true", help="py-spy --nonblocking: do not pause the processes")
    parser.add_argument("--timeout", type=float, default=None, metavar="S",
                        help="seconds per process for py-spy/gdb (default 10); with --debug-server, per request (default 75)")
    parser.add_argument("--no-signal", action="store_true", help="never signal hangdoc-wrapped processes for a faulthandler dump")
    parser.add_argument("--no-gdb", action="store_true", help="never fall back to gdb")
    parser.add_argument("--py-spy", metavar="PATH", help="the py-spy executable (default: from PATH)")
    parser.add_argument("--debug-server", metavar="HOST[:PORT]",
                        help="instead of this node's processes, fetch every rank's stacks and Flight Recorder entries from "
                             "torch's debug server (start_debug_server(); its frontend on rank 0, port 25999 by default) "
                             "into the directory -o (default: debug-server-HOST/)")
    parser.add_argument("-o", "--output", metavar="FILE",
                        help="output file, '-' for stdout (default: trace-{host}.out); its directory is checked before "
                             "dumping (exit 2 if it cannot be written there); should the write still fail after the "
                             "dump, the stacks go to stdout instead and the exit status is 3")
    parser.epilog = ("exit status: 0 all dumped (processes that exited meanwhile are listed, not dumped), "
                     "1 some unresponsive, 2 nothing found or a usage error, 3 the output file failed after the dump "
                     "(the stacks went to stdout)")


def _check_writable(path: str) -> None:
    """Fail before dumping (and pausing every rank for nothing) when ``path`` cannot be created:
    a file is created and removed in its directory, or in the nearest existing parent of a
    directory still to be made (the write makes missing directories)."""
    import tempfile

    if os.path.isdir(path):
        raise UsageError(f"cannot write {path}: it is a directory")
    directory = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(directory) and os.path.dirname(directory) != directory:
        directory = os.path.dirname(directory)
    try:
        with tempfile.NamedTemporaryFile(prefix=".hangdoc-", suffix=".tmp", dir=directory):
            pass
    except OSError as e:
        raise UsageError(f"cannot write {path}: {e.strerror or e}") from None


def run(args: argparse.Namespace) -> int:
    from hangdoc import collect
    from hangdoc.atomic import write_atomic
    from hangdoc.tags import EXITED_PREFIX

    if args.timeout is not None and args.timeout <= 0:
        raise UsageError("--timeout must be > 0")
    if args.debug_server is not None:
        return _run_debug_server(args)
    if args.timeout is None:
        args.timeout = 10.0
    if not os.path.isdir("/proc/self"):
        raise UsageError("hangdoc dump reads /proc, which this system does not have (Linux only)")
    out = None if args.output == "-" else (args.output or collect.default_output())
    if out is not None:
        _check_writable(out)
    try:
        procs = collect.find_processes(args.pid, all_users=args.all_users)
    except LookupError as e:
        raise UsageError(str(e)) from None
    if not procs:
        print("hangdoc dump: no Python process found" + (f" under pid {args.pid}" if args.pid else ""), file=sys.stderr)
        return 2
    options = collect.Options(native=args.native, locals=args.locals, nonblocking=args.nonblocking,
                              timeout=args.timeout, use_signal=not args.no_signal, use_gdb=not args.no_gdb,
                              pyspy=args.py_spy)
    text = collect.dump(procs, options)
    lines = text.splitlines()
    failed = sum(1 for line in lines if line.startswith("# hangdoc process ") and " status=unresponsive" in line)
    exited = sum(1 for line in lines if line.startswith(EXITED_PREFIX))
    notes = [f"{failed} unresponsive"] * bool(failed) + [f"{exited} exited while dumping, not dumped"] * bool(exited)
    if out is None:  # stdout: nothing else is printed (srun --output may send stderr to the same file)
        write_stdout(text)
        return 1 if failed else 0
    try:
        write_atomic(out, text, mode=0o600)  # stacks, maybe --locals: the caller's alone
    except OSError as e:
        # the dump is taken (every rank was paused for it): a file system error must not lose it
        print(f"hangdoc dump: cannot write {out}: {e.strerror or e}; the stacks follow on stdout", file=sys.stderr)
        write_stdout(text)
        return 3
    print(f"hangdoc dump: {len(procs)} process{'es' if len(procs) != 1 else ''} -> {os.path.abspath(out)}"
          + (f" ({', '.join(notes)})" if notes else ""), file=sys.stderr)
    return 1 if failed else 0


def _run_debug_server(args: argparse.Namespace) -> int:
    """``--debug-server``: exit 0 when every rank's stacks were fetched, 1 when some were not
    (the others are written), 2 when the frontend could not be read."""
    import urllib.parse

    from hangdoc import debug_server

    try:
        url = debug_server.parse_address(args.debug_server)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.output == "-":
        raise UsageError("--debug-server writes a directory (-o DIR), not stdout")
    host = (urllib.parse.urlsplit(url).hostname or "host").replace(":", "_")  # an IPv6 address too
    out = args.output or f"debug-server-{host}"
    timeout = args.timeout if args.timeout is not None else debug_server.DEFAULT_TIMEOUT
    try:
        fetched = debug_server.fetch(args.debug_server, timeout=timeout)
        paths, missing = debug_server.write(fetched, out)
    except debug_server.DebugServerError as e:
        print(f"hangdoc dump: {e}", file=sys.stderr)
        return 2
    for line in fetched.problems + missing:
        print(f"hangdoc dump: {line}", file=sys.stderr)
    got = sum(1 for s in fetched.stacks if s.error is None)
    print(f"hangdoc dump: stacks of {got} of {len(fetched.stacks)} ranks from {url}, {len(paths)} files -> "
          f"{os.path.abspath(out)} (hangdoc aggregate {out})", file=sys.stderr)
    return 0 if got == len(fetched.stacks) else 1
