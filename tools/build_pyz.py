"""Build ``hangdoc.pyz``: hangdoc's core as one file that any Python >= 3.8 runs.

    python3 tools/build_pyz.py                 # writes dist/hangdoc.pyz
    python3 tools/build_pyz.py -o /tmp/hangdoc.pyz
    python3 /tmp/hangdoc.pyz aggregate hangdoc-out/

The core is stdlib only, so the archive is the ``hangdoc`` package as it is in this checkout
(stdlib ``zipapp``, no third-party build tool), less what a copied single file cannot use: the
pytest plugin (``hangdoc/testing``) and byte-code caches. Nothing under ``tests/`` goes in.
"""

import argparse
import os
import sys
import zipapp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: package-relative directories left out of the archive
EXCLUDED_DIRS = ("testing", "__pycache__")


def included(relative: str) -> bool:
    """Whether a path relative to the checkout goes into the archive (zipapp's filter)."""
    parts = relative.replace(os.sep, "/").split("/")
    if parts[0] != "hangdoc":
        return False
    if any(part in EXCLUDED_DIRS for part in parts[1:]):
        return False
    if len(parts) > 1 and not (parts[-1].endswith(".py") or parts[-1] == "py.typed" or "." not in parts[-1]):
        return False  # byte code, editor files: only sources (and directories, which have no dot)
    return True


def build(output: str) -> str:
    """Write the archive to ``output`` (parent created) and return its path."""
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    zipapp.create_archive(
        ROOT,
        target=output,
        interpreter="/usr/bin/env python3",
        main="hangdoc.cli:main",
        filter=lambda path: included(str(path)),
        compressed=True,
    )
    return output


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="build hangdoc.pyz (stdlib zipapp of hangdoc's core)")
    parser.add_argument("-o", "--output", default=os.path.join(ROOT, "dist", "hangdoc.pyz"),
                        help="where to write it (default: dist/hangdoc.pyz)")
    args = parser.parse_args(argv)
    print(build(args.output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
