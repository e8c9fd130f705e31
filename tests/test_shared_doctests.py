"""The runnable examples in the docstrings of the modules both sides share."""

import doctest
import importlib

import pytest

MODULES = ["hangdoc.model", "hangdoc.ranges", "hangdoc.tags", "hangdoc.atomic", "hangdoc.proctree", "hangdoc.analysis"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    failed, attempted = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert attempted > 0, f"{name} has no runnable example"
    assert failed == 0
