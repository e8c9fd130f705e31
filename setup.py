"""Everything is in pyproject.toml; this file only puts ``hangdoc-startup.pth`` (hangdoc.startup's
``HANGDOC=...`` opt-in) at the top of the wheel, beside the package, where pip installs it into
site-packages, and into the editable wheel of ``pip install -e .`` (as pytest-cov ships its .pth)."""

import importlib.util
import os

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def _startup():
    # by path: hangdoc/startup.py imports only the standard library at module level
    spec = importlib.util.spec_from_file_location("_hangdoc_startup", os.path.join(HERE, "hangdoc", "startup.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PTH_NAME, module.PTH_LINE


class BuildPyWithStartupPth(build_py):
    def run(self):
        super().run()
        name, line = _startup()
        target = os.path.join(self.build_lib, name)
        with open(target, "w") as f:
            f.write(line)


cmdclass = {"build_py": BuildPyWithStartupPth}

try:
    from setuptools.command.editable_wheel import editable_wheel
except ImportError:  # setuptools < 64: no PEP 660 editable wheels, nothing to add to
    editable_wheel = None

if editable_wheel is not None and hasattr(editable_wheel, "_select_strategy"):

    class _StrategyWithStartupPth:
        """setuptools' editable strategy (a finder or a path .pth), plus hangdoc-startup.pth."""

        def __init__(self, inner):
            self.inner = inner

        def __enter__(self):
            self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def __call__(self, wheel, files, mapping):
            self.inner(wheel, files, mapping)
            name, line = _startup()
            wheel.writestr(name, line.encode())

    class EditableWheelWithStartupPth(editable_wheel):
        def _select_strategy(self, *args, **kwargs):
            return _StrategyWithStartupPth(super()._select_strategy(*args, **kwargs))

    cmdclass["editable_wheel"] = EditableWheelWithStartupPth

setup(cmdclass=cmdclass)
