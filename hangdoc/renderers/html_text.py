"""Text for the HTML report: escaping (HTML text, attributes, SVG) and fitting into boxes.

Everything that came from a dump goes through :func:`esc`; control characters and lone surrogates
become U+FFFD, so nothing a dump holds can break out of an element or an attribute.
"""

from __future__ import annotations

import html
import re
from typing import List

_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ud800-\udfff\ufffe\uffff]")


def esc(value: object) -> str:
    """Escape for HTML text *and* attribute values (also SVG in HTML): ``<>&"'`` and control chars.

    >>> esc('<img src=x onerror="alert(1)">')
    '&lt;img src=x onerror=&quot;alert(1)&quot;&gt;'
    """
    text = _CONTROL.sub("\ufffd", str(value))
    return html.escape(text, quote=True)


def inline(text: str) -> str:
    """Escaped text whose `backticked` spans (the Markdown the rules write) become ``<code>``.

    >>> inline("run `hangdoc dump` <now>")
    'run <code>hangdoc dump</code> &lt;now&gt;'
    >>> inline("an odd ` stays")
    'an odd ` stays'
    """
    parts = text.split("`")
    if len(parts) < 3:
        return esc(text)
    if len(parts) % 2 == 0:  # an unpaired backtick: the last one stays as it is
        parts[-2:] = [parts[-2] + "`" + parts[-1]]
    return "".join(f"<code>{esc(x)}</code>" if k % 2 else esc(x) for k, x in enumerate(parts))


def clip(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters with an ellipsis (before escaping)."""
    return text if len(text) <= limit else text[: max(1, limit - 1)] + "…"


def wrap(text: str, width: int, lines: int) -> List[str]:
    """At most ``lines`` rows of ``width``, broken after a comma or space when one is near; the rest clipped.

    >>> wrap("ranks 1-127,129-242,244-255,257-383,400-511", 20, 2)
    ['ranks 1-127,129-242,', '244-255,257-383,400…']
    """
    rows: List[str] = []
    while text and len(rows) < lines - 1 and len(text) > width:
        cut = max(text.rfind(",", 0, width), text.rfind(" ", 0, width))
        cut = cut + 1 if cut >= width // 3 else width
        rows.append(text[:cut].rstrip())
        text = text[cut:].lstrip()
    if text:
        rows.append(clip(text, width))
    return rows


def num(n: int) -> str:
    return f"{n:,}"


def plural(n: int, word: str) -> str:
    return f"{num(n)} {word}{'' if n == 1 else 'es' if word.endswith('s') else 's'}"
