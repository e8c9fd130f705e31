"""The examples in the in-job helpers' docstrings run as written."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["printflock", "prefix", "log", "nicertrace", "options", "wrap", "identity"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # examples that write use the default output directory
    module = importlib.import_module(f"hangdoc.runtime.{name}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted > 0
