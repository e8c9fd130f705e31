"""Every rank's stacks and Flight Recorder entries, fetched from PyTorch's debug server.

A job that called ``torch.distributed.debug.start_debug_server()`` (torch >= 2.10) runs an HTTP
worker server in every rank and a frontend on rank 0 (port 25999 by default) that gathers from
all of them. One HTTP request to the frontend thus gives every rank's stacks (``/stacks``: Python's
faulthandler output) and Flight Recorder entries (``/fr_trace_json``), with no ssh, srun or py-spy.
``hangdoc dump --debug-server HOST[:PORT]`` (:func:`fetch`, :func:`write`) saves them as files
``hangdoc aggregate`` reads: ``stacks.txt`` (each rank's dump after a ``# hangdoc process`` tag
line naming its rank and host) and ``flight-recorder-rank{N}.json``.

The frontend renders each rank as ``<h2>Rank N: ADDRESS</h2>`` followed by ``<pre>TEXT</pre>``
(or ``<p>Failed to fetch: status=S</p><pre>REASON</pre>`` for a worker that did not answer in
the frontend's ``fetch_timeout``); its templates do not escape TEXT. :func:`parse_page` reads
that, linearly (plain ``str.find``, no regular expression over the page).

    >>> page = ('<h2>Rank 0: http://node1:4001/handler/dump_traceback?</h2>\\n<pre>Thread 0x1 (most recent call first):\\n'
    ...         '  File "train.py", line 9 in main\\n</pre>\\n<h2>Rank 1: http://node2:4002/handler/dump_traceback?</h2>\\n'
    ...         '<p>Failed to fetch: status=408</p>\\n<pre>Timeout: read timed out</pre>')
    >>> [(s.rank, s.host, s.error) for s in parse_page(page)]
    [(0, 'node1', None), (1, 'node2', 'status=408: Timeout: read timed out')]

Everything read is bounded: a deadline per request (each receive waits at most ``timeout``, and
no receive starts after the deadline), a size cap per page, rank numbers below :data:`MAX_RANK`; output files are created ``0600`` (they
hold stacks) without following a symbolic link.
"""

from __future__ import annotations

import html
import json
import os
import socket
import stat
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import List, NamedTuple, Optional, Tuple

from hangdoc.atomic import write_atomic
from hangdoc.bounds import bounded_int
from hangdoc.tags import defang, format_tag

#: the frontend's port when ``start_debug_server()`` is called without one
DEFAULT_PORT = 25999
#: the frontend pages read: stacks (faulthandler text) and Flight Recorder (JSON) of every rank
STACKS_PAGE = "/stacks"
RECORDS_PAGE = "/fr_trace_json"
#: default per-request deadline: the frontend waits up to its own fetch_timeout (60 s unless the
#: job set another) for a worker that does not answer, then reports it as failed
DEFAULT_TIMEOUT = 75.0
#: the largest page read (bytes); a larger one is refused, not truncated into a wrong dump
MAX_PAGE_BYTES = 256 * 1024 * 1024
MAX_RANK = 10_000_000
_RANK_HEADER = "<h2>Rank "
_FAILED = "<p>Failed to fetch: status="


class DebugServerError(Exception):
    """The frontend could not be reached or did not answer with a page hangdoc can read."""


class RankSection(NamedTuple):
    """One rank's part of a frontend page: its text, or why the frontend could not fetch it."""

    rank: int
    address: str  # the rank's worker server, as the frontend names it
    host: Optional[str]
    text: str
    error: Optional[str]


def parse_address(address: str) -> str:
    """``HOST``, ``HOST:PORT``, ``[V6]:PORT`` or ``http://HOST:PORT`` -> the frontend's base URL.

    >>> parse_address("node0"), parse_address("node0:8000"), parse_address("[::1]:8000")
    ('http://node0:25999', 'http://node0:8000', 'http://[::1]:8000')
    >>> parse_address("https://x:1")
    Traceback (most recent call last):
      ...
    ValueError: --debug-server: only http:// is served by torch's debug server, not 'https://x:1'
    """
    text = address.strip()
    if "://" in text and not text.startswith("http://"):
        raise ValueError(f"--debug-server: only http:// is served by torch's debug server, not {address!r}")
    parts = urllib.parse.urlsplit(text if text.startswith("http://") else "http://" + text)
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        host = port = None
        port_bad = True
    else:
        port_bad = False
    if not host or port_bad or (parts.path not in ("", "/")) or parts.query or parts.username:
        raise ValueError(f"--debug-server: expected HOST[:PORT] of the debug server's frontend, not {address!r}")
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port or DEFAULT_PORT}"


def _host_of(worker_address: str) -> Optional[str]:
    """The host part of a worker address, reduced to characters a tag value can hold."""
    try:
        host = urllib.parse.urlsplit(worker_address).hostname
    except ValueError:
        return None
    if not host:
        return None
    kept = "".join(c for c in host[:200] if c.isalnum() or c in ".-_:")
    return kept or None


def _section_text(body: str) -> Tuple[str, Optional[str]]:
    """(text, error) of one rank's section body (what follows its ``<h2>`` line)."""
    start = body.find("<pre>")
    end = body.rfind("</pre>")
    text = body[start + len("<pre>"):end] if 0 <= start < end else ""
    if "<" not in text and ("&lt;" in text or "&gt;" in text or "&quot;" in text or "&#" in text):
        # an escaping template (torch's do not escape today): '<module>' would show as '&lt;module&gt;'
        text = html.unescape(text)
    failed = body.find(_FAILED)
    if 0 <= failed < (start if start >= 0 else len(body)):
        status_end = body.find("</p>", failed)
        status = body[failed + len(_FAILED):status_end if status_end >= 0 else failed + 40][:20].strip()
        reason = " ".join(text.split())[:300]
        return "", f"status={status}" + (f": {reason}" if reason else "")
    return text, None


def parse_page(page: str) -> List[RankSection]:
    """The rank sections of a frontend page, in page order; a section whose header is not
    ``Rank N: ADDRESS`` is skipped (not guessed)."""
    sections: List[RankSection] = []
    end_of_content = page.rfind("</section>")
    limit = end_of_content if end_of_content >= 0 else len(page)
    pos = page.find(_RANK_HEADER, 0, limit)
    while pos >= 0:
        header_end = page.find("</h2>", pos, limit)
        if header_end < 0:
            break
        following = page.find(_RANK_HEADER, header_end, limit)
        body = page[header_end + len("</h2>"):following if following >= 0 else limit]
        number, _, address = page[pos + len(_RANK_HEADER):header_end].partition(":")
        # isdigit() says yes to "²" and int() then raises: a page (what a worker's address or a
        # proxy put there) costs its bad section, never the rest
        rank = bounded_int(number, 0, MAX_RANK - 1)
        if rank is not None and number.strip().isdigit():
            address = address.strip()
            text, error = _section_text(body)
            sections.append(RankSection(rank, address, _host_of(address), text, error))
        pos = following
    return sections


def fetch_page(base_url: str, path: str, timeout: float = DEFAULT_TIMEOUT, max_bytes: int = MAX_PAGE_BYTES) -> str:
    """GET ``base_url + path``: at most ``max_bytes``, no receive started after ``timeout`` seconds.
    No proxy: the frontend is on the job's network, where a cluster's ``http_proxy`` cannot reach."""
    url = base_url + path
    deadline = time.monotonic() + timeout
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(urllib.request.Request(url, method="GET"), timeout=timeout) as response:
            chunks: List[bytes] = []
            size = 0
            while True:
                if time.monotonic() > deadline:
                    raise DebugServerError(f"{url}: no complete answer within {timeout:g} s")
                # read1: one receive, bounded by the socket timeout, so a server that trickles
                # cannot hold the deadline off for longer than one more timeout
                chunk = response.read1(65536)
                if not chunk:
                    break
                size += len(chunk)
                if size > max_bytes:
                    raise DebugServerError(f"{url}: page larger than {max_bytes} bytes, not read")
                chunks.append(chunk)
    except urllib.error.HTTPError as e:
        raise DebugServerError(f"{url}: HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, socket.timeout, OSError) as e:
        reason = getattr(e, "reason", None) or e
        raise DebugServerError(f"{url}: {reason}") from None
    return b"".join(chunks).decode("utf-8", "replace")


class Fetched(NamedTuple):
    """What one visit to the frontend gave: each rank's stacks and Flight Recorder dump."""

    url: str
    stacks: List[RankSection]
    records: List[RankSection]
    #: a page that could not be read as a whole (records are optional: the stacks alone diagnose)
    problems: List[str]


def fetch(address: str, timeout: float = DEFAULT_TIMEOUT, max_bytes: int = MAX_PAGE_BYTES) -> Fetched:
    """Read the stacks and Flight Recorder pages of the frontend at ``address``; raises
    :class:`DebugServerError` when the stacks page cannot be had (ValueError for a bad address)."""
    url = parse_address(address)
    stacks = parse_page(fetch_page(url, STACKS_PAGE, timeout, max_bytes))
    if not stacks:
        raise DebugServerError(f"{url}{STACKS_PAGE}: no 'Rank N:' section: is this torch's debug server frontend?")
    problems: List[str] = []
    try:
        records = parse_page(fetch_page(url, RECORDS_PAGE, timeout, max_bytes))
    except DebugServerError as e:
        records = []
        problems.append(f"Flight Recorder entries not fetched: {e}")
    return Fetched(url, stacks, records, problems)


def _write_private(directory: str, name: str, text: str) -> str:
    """Write ``directory/name`` atomically as a 0600 file (a symbolic link there is replaced, not
    followed: the data goes to a new file renamed over the name)."""
    path = os.path.join(directory, name)
    write_atomic(path, text, mode=0o600)
    return path


def _output_directory(directory: str) -> None:
    """Make ``directory`` (0700) or accept an existing one that is a real directory of ours."""
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        st = os.lstat(directory)
    except OSError as e:
        raise DebugServerError(f"cannot create {directory}: {e.strerror or e}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise DebugServerError(f"{directory} is not a directory (a symbolic link is not followed)")
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise DebugServerError(f"{directory} belongs to another user (uid {st.st_uid})")


def write(fetched: Fetched, directory: str) -> Tuple[List[str], List[str]]:
    """Write the fetched dumps into ``directory``; returns (paths written, one line per rank
    whose stacks or records the frontend could not get)."""
    _output_directory(directory)
    world_size = len(fetched.stacks)
    missing: List[str] = []
    blocks: List[str] = []
    for s in fetched.stacks:
        if s.error is not None:
            missing.append(f"rank {s.rank} ({s.address}): stacks not fetched: {s.error}")
            continue
        tag = format_tag(host=s.host, rank=s.rank, world_size=world_size)
        # a rank's dump holds what its process printed (file names, thread names): none of it
        # may read as a tag of hangdoc's own
        blocks.append(tag + "\n" + defang(s.text.rstrip("\n")) + "\n")
    paths = [_write_private(directory, "stacks.txt", "\n".join(blocks))] if blocks else []
    for s in fetched.records:
        if s.error is not None:
            missing.append(f"rank {s.rank} ({s.address}): Flight Recorder entries not fetched: {s.error}")
            continue
        try:
            json.loads(s.text)
        except ValueError as e:
            missing.append(f"rank {s.rank} ({s.address}): Flight Recorder entries are not JSON ({e}); not written")
            continue
        # the Flight Recorder reader takes the rank from the file name (a dump does not hold it)
        paths.append(_write_private(directory, f"flight-recorder-rank{s.rank}.json", s.text))
    return paths, missing
