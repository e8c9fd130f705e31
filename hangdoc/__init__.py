"""hangdoc: find out why a multi-rank PyTorch job hangs, and which rank is to blame.

In the training script::

    import hangdoc
    from hangdoc import printflock as print

    hangdoc.wrap(main, trace=["mypkg"], record=True, hang_timeout=300)()

After a hang::

    hangdoc aggregate trace-*.out hangdoc-out/

The in-job names below are imported lazily so that ``import hangdoc`` costs next to nothing.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
    "printflock": "hangdoc.runtime.printflock",
    "prefix_output": "hangdoc.runtime.prefix",
    "get_logger": "hangdoc.runtime.log",
    "NicerTrace": "hangdoc.runtime.nicertrace",
    "wrap": "hangdoc.runtime.wrap",
    "identity": "hangdoc.runtime.identity",
    "phase": "hangdoc.runtime.recorder",
    "step": "hangdoc.runtime.watchdog",
    "heartbeat": "hangdoc.runtime.watchdog",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hangdoc' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return __all__
