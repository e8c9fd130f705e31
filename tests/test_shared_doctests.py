"""The runnable examples in every module's docstrings run and say what they show.

Every module of the package is walked, so a new module's examples are checked without being
listed here; a module with examples that no longer run fails with its name.
"""

import doctest
import importlib
import pkgutil

import pytest

import hangdoc

MODULES = sorted(m.name for m in pkgutil.walk_packages(hangdoc.__path__, "hangdoc.") if not m.name.endswith("__main__"))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # examples that write use the default output directory
    module = importlib.import_module(name)
    failed, attempted = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert failed == 0


def test_the_walk_finds_the_modules_with_examples():
    with_examples = {n for n in MODULES if doctest.DocTestFinder().find(importlib.import_module(n))
                     and any(t.examples for t in doctest.DocTestFinder().find(importlib.import_module(n)))}
    assert {"hangdoc.readers.records", "hangdoc.analysis.stack_rules", "hangdoc.runtime.recorder",
            "hangdoc.renderers.html", "hangdoc.testing.order"} <= with_examples
