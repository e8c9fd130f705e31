"""gloo's errors: a timed-out operation, and a connection a peer closed or reset.

    [rank1]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms for recv operation to complete
    RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:33406
    RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:589] Read error [172.17.0.3]:51244: Connection reset by peer

Events: ``timeout`` (backend ``gloo``, op ``recv``/``send``, timeout_ms) and ``peer-closed``
(``peer``: the address, ``how``: closed or reset). gloo names no sequence number; a closed
connection is usually fallout: the peer at that address died or gave up first.

    >>> from hangdoc.readers import read_text
    >>> job = read_text("[rank2]: RuntimeError: [pair.cc:534] Connection closed by peer [10.0.0.2]:33406\\n")
    >>> e = next(e for e in job.events if e.kind == "peer-closed")
    >>> (e.kind, e.rank, e.fields["peer"])
    ('peer-closed', 2, '10.0.0.2:33406')
"""

from __future__ import annotations

import re

from hangdoc.readers._logbase import Identity, LineReader, number

FORMAT = "gloo"
KEYWORDS = ("Timed out waiting", "by peer")

_TIMEOUT_RE = re.compile(r"Timed out waiting (\d{1,20})ms for (\w{1,32}) operation to complete")
_PEER_RE = re.compile(r"Connection (closed|reset) by peer \[([0-9A-Za-z.:%\-]{1,128})\]:(\d{1,5})"
                      r"|\[([0-9A-Za-z.:%\-]{1,128})\]:(\d{1,5}): Connection (closed|reset) by peer")


class Reader(LineReader):
    def __init__(self, ctx) -> None:
        super().__init__(ctx, FORMAT)

    def feed(self, lineno: int, text: str, ident: Identity) -> None:
        m = _TIMEOUT_RE.search(text)
        if m is not None and ("gloo" in text or "unbound_buffer" in text or "pair.cc" in text or "Timed out waiting" in text):
            self.emit("timeout", lineno, ident, text, backend="gloo", op=m.group(2).upper(),
                      timeout_ms=number(m.group(1)))
            return
        m = _PEER_RE.search(text)
        if m is not None:
            if m.group(1) is not None:
                how, addr, port = m.group(1), m.group(2), m.group(3)
            else:
                addr, port, how = m.group(4), m.group(5), m.group(6)
            self.emit("peer-closed", lineno, ident, text, peer=f"{addr}:{port}", how=how)
