"""Testing helpers: the pytest plugin (``hangdoc.testing.plugin``) and collective-order checks.

    >>> from hangdoc.testing import check_collective_order
    >>> import torch, torch.distributed as dist
    >>> check_collective_order(lambda: dist.all_reduce(torch.ones(2)), world_size=4).ops(3)
    ['all_reduce']

See docs/pytest-plugin.md.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "check_collective_order": "hangdoc.testing.order",
    "CollectiveOrderError": "hangdoc.testing.order",
    "CollectiveTrace": "hangdoc.testing.order",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hangdoc.testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
