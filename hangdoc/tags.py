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

from hangdoc.textsafe import strip_ansi

PREFIX = "# hangdoc process "
#: The line ``hangdoc dump`` writes instead of a tag and a dump for a process that exited before it
#: could be dumped. It is no tag (no dump follows it, so it must not name the next one): the
#: readers read it as a process of its own with status ``exited`` (see :func:`parse_exited`).
EXITED_PREFIX = "# hangdoc exited "


def quote(value: object) -> str:
    """A tag value as written: spaces become ``_`` (as they always have), and a value holding
    anything but printable non-space characters (a newline in ``HANGDOC_HOST``, a quote, a
    backslash, a bidi override) is written in double quotes with backslash escapes, so that no
    value can end the line or start a forged one. Simple values stay bare (what older readers read).

    >>> quote("node1"), quote("a b"), quote('n1\\n# hangdoc process rank=0')
    ('node1', 'a_b', '"n1\\\\n#_hangdoc_process_rank=0"')
    """
    text = str(value).replace(" ", "_")
    if text and all(ch.isprintable() and ch not in _UNSAFE for ch in text):
        return text
    out = []
    for ch in text:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ch.isprintable():
            out.append(ch)
        else:
            code = ord(ch)
            out.append("\\x%02x" % code if code < 0x100 else "\\u%04x" % code if code < 0x10000 else "\\U%08x" % code)
    return '"' + "".join(out) + '"'


_UNSAFE = frozenset('"\\ ')
_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}
_UNESCAPES = {"n": "\n", "r": "\r", "t": "\t"}


def unquote(text: str) -> str:
    """The value :func:`quote` wrote (a bare value is itself).

    >>> unquote(quote("a\\nb")) == "a\\nb", unquote("plain")
    (True, 'plain')
    """
    if len(text) < 2 or text[0] != '"' or text[-1] != '"':
        return text
    body, out, i = text[1:-1], [], 0
    while i < len(body):
        ch = body[i]
        if ch != "\\" or i + 1 == len(body):
            out.append(ch)
            i += 1
            continue
        nxt = body[i + 1]
        width = {"x": 2, "u": 4, "U": 8}.get(nxt, 0)
        digits = body[i + 2:i + 2 + width]
        if width and len(digits) == width and all(c in "0123456789abcdefABCDEF" for c in digits) \
                and int(digits, 16) <= 0x10FFFF:
            out.append(chr(int(digits, 16)))
            i += 2 + width
        else:
            out.append(_UNESCAPES.get(nxt, nxt))
            i += 2
    return "".join(out)


def format_tag(**fields: object) -> str:
    """One line; ``None`` values are left out, every value goes through :func:`quote`.

    >>> format_tag(host="n1\\n# hangdoc process host=forged", pid=7)
    '# hangdoc process host="n1\\\\n#_hangdoc_process_host=forged" pid=7'
    """
    parts = [f"{k}={quote(v)}" for k, v in fields.items() if v is not None]
    return PREFIX + " ".join(parts)


def defang(text: str) -> str:
    """``text`` (a dumper's output: py-spy prints the process's command line, faulthandler its file
    names) with every ``# hangdoc `` made ``#_hangdoc `` and every ``=== Rank `` ``===_Rank ``:
    nothing a process controls can read as a tag or ``exited`` line of hangdoc's own, nor as a
    section header that names the rank and host of the lines after it.

    The readers drop NUL bytes and terminal escape sequences (colours, OSC titles, which may span
    lines) before they look for a tag, so ``#\\x1b[0m hangdoc process`` would read as one: the same
    normalisation is applied here first, and what it leaves of an escape (a lone ESC or CSI byte)
    goes too, so that no later stripping can join a ``#`` to a `` hangdoc`` again.

    >>> defang("Process 7: python x\\n# hangdoc process host=forged rank=0")
    'Process 7: python x\\n#_hangdoc process host=forged rank=0'
    >>> defang("x\\n#\\x1b[0m hangdoc process host=forged\\n#\\x00 hangdoc exited pid=1")
    'x\\n#_hangdoc process host=forged\\n#_hangdoc exited pid=1'
    """
    if "\x1b" in text or "\x9b" in text or "\x00" in text:
        # one pass of the readers' own stripping (NULs first, as they do), then every ESC, CSI and
        # NUL byte left over: the text that comes out holds nothing a reader would remove
        text = strip_ansi(text.replace("\x00", "")).translate(_DROP)
    for word, safe in _WORDS:
        if word in text:
            text = text.replace(word, safe)
    return text


_DROP = {0x00: None, 0x1B: None, 0x9B: None}
#: what would read as hangdoc's own (a tag or exited line) or give the lines after it an identity
#: (the ``=== Rank N: host ===`` section header of torch's debug server)
_WORDS = (("# hangdoc ", "#_hangdoc "), ("=== Rank ", "===_Rank "))


#: the ``reason`` of an exited line for a rank that died while the job ran (rank 0's exit verdict,
#: :mod:`hangdoc.runtime.exit_verdict`), as against one gone before ``hangdoc dump`` reached it
DIED_IN_JOB = "died_while_the_job_ran"


def format_exited(**fields: object) -> str:
    """The :data:`EXITED_PREFIX` line: the fields of a tag line, for a process that is gone.

    >>> format_exited(host="node1", pid=42, rank=3, reason="exited")
    '# hangdoc exited host=node1 pid=42 rank=3 reason=exited'
    >>> parse_tag(format_exited(pid=42)) is None
    True
    """
    return EXITED_PREFIX + format_tag(**fields)[len(PREFIX):]


def parse_tag(line: str) -> Optional[Dict[str, str]]:
    """The fields of a tag line as strings, or None when ``line`` is not one. Quoted values
    (:func:`quote`) are unquoted (they hold no whitespace: parts split on it, as they always have);
    a part without ``=`` is ignored.

    >>> parse_tag('# hangdoc process host="a\\\\nb" pid=7 junk')
    {'host': 'a\\nb', 'pid': '7'}
    """
    line = line.strip()
    if not line.startswith(PREFIX.strip()):
        return None
    fields: Dict[str, str] = {}
    for part in line[len(PREFIX.strip()):].split():
        if "=" in part:
            k, v = part.split("=", 1)
            fields[k] = unquote(v)
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
