"""The examples in the readers' and normalize's docstrings run and say what they show."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "hangdoc.readers",
    "hangdoc.readers._base",
    "hangdoc.readers.pyspy",
    "hangdoc.readers.faulthandler",
    "hangdoc.readers.traceback",
    "hangdoc.readers.pystack",
    "hangdoc.readers.gdb",
    "hangdoc.analysis.normalize",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
