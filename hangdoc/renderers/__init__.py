"""Renderers: a :class:`~hangdoc.model.Report` in, text out. They never analyse.

Each format is a module with ``render(report, options: RenderOptions) -> str``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Optional

#: format name -> module
FORMATS = {
    "text": "hangdoc.renderers.text",
    "json": "hangdoc.renderers.json",
    "markdown": "hangdoc.renderers.markdown",
    "html": "hangdoc.renderers.html",
    "dot": "hangdoc.renderers.dot",
    "svg": "hangdoc.renderers.svg",
}


@dataclass
class RenderOptions:
    color: bool = False
    #: show library plumbing frames (launcher wrappers, torch internals) instead of folding them.
    show_plumbing: bool = False
    #: cap on tree depth/width for huge inputs; None = renderer's default.
    max_groups: Optional[int] = None
    #: every evidence and detail line of the headline (``-v``); terse by default.
    verbose: bool = False


def render(report, fmt: str = "text", options: Optional[RenderOptions] = None) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose from {', '.join(FORMATS)}")
    module = importlib.import_module(FORMATS[fmt])
    return module.render(report, options or RenderOptions())
