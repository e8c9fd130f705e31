"""``python -m hangdoc``: the same as the ``hangdoc`` command."""

import sys

from hangdoc.cli import main

sys.exit(main())
