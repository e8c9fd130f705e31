"""The ``hangdoc`` command: wires stages together, holds no logic of its own.

``hangdoc SUBCOMMAND ...`` runs a subcommand; anything else (``hangdoc [options] script.py args``,
also ``python -m hangdoc`` and ``torchrun -m hangdoc``) runs a training script with the in-job
helpers enabled, like ``hangdoc run``.

Each subcommand is a module here with ``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import List, Optional

#: subcommand -> (module, one-line help)
SUBCOMMANDS = {
    "aggregate": ("hangdoc.cli.aggregate", "read stack dumps and records of all ranks, merge them, diagnose the hang"),
    "dump": ("hangdoc.cli.dump", "dump the stacks of every Python process on this node, tagged with its rank"),
    "demo": ("hangdoc.cli.demo", "run a bundled hang on CPU/gloo and let hangdoc diagnose it"),
    "run": ("hangdoc.cli.run", "run a script with hangdoc's in-job helpers (the default)"),
}


class UsageError(Exception):
    """A usage problem: printed as one line, exit status 2."""


def write_stdout(text: str) -> None:
    """A report or dump to stdout: characters the terminal cannot show replaced, a reader that
    went away (``| head``) no error."""
    try:
        try:
            sys.stdout.reconfigure(errors="replace")  # a terminal that cannot show '←' still gets the report
        except (AttributeError, ValueError):
            pass
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        # `hangdoc aggregate ... | head`: the reader is gone, which is fine; keep Python from
        # complaining about the flush at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def build_parser() -> argparse.ArgumentParser:
    from hangdoc import __version__

    parser = argparse.ArgumentParser(
        prog="hangdoc",
        description="Find out why a multi-rank PyTorch job hangs, and which rank is to blame.",
        epilog="Without a subcommand, 'hangdoc [options] script.py [args]' is 'hangdoc run'.",
    )
    parser.add_argument("--version", action="version", version=f"hangdoc {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] not in SUBCOMMANDS and argv[0] not in ("-h", "--help", "--version"):
        argv.insert(0, "run")
    if not argv:
        argv = ["--help"]
    if argv[0] in SUBCOMMANDS:
        # Build only the parser that is needed: importing every subcommand costs time in each rank.
        module = importlib.import_module(SUBCOMMANDS[argv[0]][0])
        parser = argparse.ArgumentParser(prog=f"hangdoc {argv[0]}", description=SUBCOMMANDS[argv[0]][1])
        module.add_arguments(parser)
        args = parser.parse_args(argv[1:])
        try:
            return int(module.run(args) or 0)
        except UsageError as e:
            print(f"hangdoc {argv[0]}: error: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            return 130
    build_parser().parse_args(argv)
    return 0
