"""The process tag line that hangdoc writes in front of every stack dump it takes.

Both sides use it: the in-job watchdog and ``hangdoc dump`` write it, the readers parse it, so a
dump names its host, pid and rank whatever format follows (py-spy, faulthandler, gdb).

    >>> line = format_tag(host="node1", pid=42, rank=3, local_rank=3, world_size=8)
    >>> line
    '# hangdoc process host=node1 pid=42 rank=3 local_rank=3 world_size=8'
    >>> parse_tag(line)["rank"]
    '3'
    >>> parse_tag("Thread 0x1 (most recent call first):") is None
    True
"""

from __future__ import annotations

from typing import Dict, Optional

PREFIX = "# hangdoc process "


def format_tag(**fields: object) -> str:
    """One line; ``None`` values are left out, values must not contain spaces (they are replaced)."""
    parts = [f"{k}={str(v).replace(' ', '_')}" for k, v in fields.items() if v is not None]
    return PREFIX + " ".join(parts)


def parse_tag(line: str) -> Optional[Dict[str, str]]:
    """The fields of a tag line as strings, or None when ``line`` is not one."""
    line = line.strip()
    if not line.startswith(PREFIX.strip()):
        return None
    fields: Dict[str, str] = {}
    for part in line[len(PREFIX.strip()):].split():
        if "=" in part:
            k, v = part.split("=", 1)
            fields[k] = v
    return fields
