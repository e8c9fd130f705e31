"""``hangdoc dump``: the stacks of every Python process on this node, tagged with its rank.

Writes ``trace-{host}.out`` (or ``-o FILE``, ``-o -`` for stdout), ready for::

    srun --overlap --jobid $JOB --ntasks-per-node=1 --output=trace-%N.out hangdoc dump -o -
    hangdoc aggregate trace-*.out

Exit status 0 when every process found was dumped, 1 when some could not be (they are in the
output with ``status=unresponsive``), 2 when no Python process was found or on a usage error.
"""

from __future__ import annotations

import argparse
import os
import sys

from hangdoc.cli import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pid", type=int, metavar="LAUNCHER_PID",
                        help="dump this process and its descendants (torchrun, srun step, ...) instead of all of this user's Python processes")
    parser.add_argument("--all-users", action="store_true", help="also other users' processes (needs the privileges to read them)")
    parser.add_argument("--native", action="store_true", help="py-spy --native: C/C++ frames too")
    parser.add_argument("--locals", action="store_true", help="py-spy --locals: local variables of each frame")
    parser.add_argument("--nonblocking", action="store_true", help="py-spy --nonblocking: do not pause the processes")
    parser.add_argument("--timeout", type=float, default=10.0, metavar="S", help="seconds per process for py-spy/gdb (default 10)")
    parser.add_argument("--no-signal", action="store_true", help="never signal hangdoc-wrapped processes for a faulthandler dump")
    parser.add_argument("--no-gdb", action="store_true", help="never fall back to gdb")
    parser.add_argument("--py-spy", metavar="PATH", help="the py-spy executable (default: from PATH)")
    parser.add_argument("-o", "--output", metavar="FILE", help="output file, '-' for stdout (default: trace-{host}.out)")


def run(args: argparse.Namespace) -> int:
    from hangdoc import collect
    from hangdoc.atomic import write_atomic

    if args.timeout <= 0:
        raise UsageError("--timeout must be > 0")
    if not os.path.isdir("/proc/self"):
        raise UsageError("hangdoc dump reads /proc, which this system does not have (Linux only)")
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
    failed = sum(1 for line in text.splitlines() if line.startswith("# hangdoc process ") and " status=unresponsive" in line)
    if args.output == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        out = args.output or collect.default_output()
        write_atomic(out, text)
        print(f"hangdoc dump: {len(procs)} process{'es' if len(procs) != 1 else ''} -> {os.path.abspath(out)}"
              + (f" ({failed} unresponsive)" if failed else ""), file=sys.stderr)
    return 1 if failed else 0
