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
#: The line ``hangdoc dump`` writes instead of a tag and a dump for a process that exited before it
#: could be dumped. It is no tag (no dump follows it, so it must not name the next one): the
#: readers read it as a process of its own with status ``exited`` (see :func:`parse_exited`).
EXITED_PREFIX = "# hangdoc exited "


def format_tag(**fields: object) -> str:
    """One line; ``None`` values are left out, values must not contain spaces (they are replaced)."""
    parts = [f"{k}={str(v).replace(' ', '_')}" for k, v in fields.items() if v is not None]
    return PREFIX + " ".join(parts)


def format_exited(**fields: object) -> str:
    """The :data:`EXITED_PREFIX` line: the fields of a tag line, for a process that is gone.

    >>> format_exited(host="node1", pid=42, rank=3, reason="exited")
    '# hangdoc exited host=node1 pid=42 rank=3 reason=exited'
    >>> parse_tag(format_exited(pid=42)) is None
    True
    """
    return EXITED_PREFIX + format_tag(**fields)[len(PREFIX):]


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


def parse_exited(line: str) -> Optional[Dict[str, str]]:
    """The fields of an :data:`EXITED_PREFIX` line, or None when ``line`` is not one.

    >>> parse_exited("# hangdoc exited host=n1 pid=7 rank=1 reason=exited")["pid"]
    '7'
    """
    line = line.strip()
    if not line.startswith(EXITED_PREFIX.strip()):
        return None
    return parse_tag(PREFIX + line[len(EXITED_PREFIX.strip()):].strip())
