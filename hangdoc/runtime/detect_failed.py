"""A rank whose script raised: the detector's ``rank-failed`` verdict, reported as the exception leaves.

The other ranks go on to their next collective and wait there for this one, for as long as the
process lives (a non-daemon thread keeps it alive after its main thread died) or until the launcher
ends the job; either way the exception is the cause, and the detector says so at once, naming the
exception, where it was raised and the last call this rank issued.

A ``RuntimeError`` raised from inside a torch.distributed call is left alone: that is how a rank
learns that another one failed (gloo's ``Connection closed by peer`` when the culprit aborted), a
consequence and not the cause; torch's own argument checks there (``ValueError``) are the rank's. So is one raised after a SIGTERM came: the launcher is ending the
job, and what fails then (a DataLoader whose workers it killed) fails because of that.

    >>> from hangdoc.runtime.detect_digest import Digests
    >>> def fail():
    ...     raise ValueError("bad batch")
    >>> try:
    ...     fail()
    ... except ValueError as e:
    ...     v = verdict(e, 1, Digests(), lambda rec: ("", ""))
    >>> v.kind, v.deviants, v.text.split(" at ")[0]
    ('rank-failed', [1], 'rank 1 raised ValueError: bad batch')
"""

from __future__ import annotations

import os
import traceback
from typing import Any, Callable, Optional, Tuple

from hangdoc.runtime.detect_digest import Verdict

#: characters of the exception's message kept
MESSAGE_LIMIT = 200
_DIST = os.sep + os.path.join("torch", "distributed") + os.sep


def from_a_collective(e: BaseException) -> bool:
    """Whether the exception came out of a torch.distributed call's communication: a
    ``RuntimeError`` (gloo's, NCCL's, torch's ``DistError`` family) raised inside one. A
    ``ValueError`` or ``TypeError`` from torch.distributed's own checks of its arguments (a
    ``scatter_list`` on a non-source rank, a send to itself) is this rank's own error, raised
    before anything was sent."""
    if not isinstance(e, RuntimeError):
        return False
    tb = e.__traceback__
    while tb is not None:
        if _DIST in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


def _message(e: BaseException) -> str:
    """The message on one line, control characters shown as escapes (:func:`hangdoc.textsafe.visible`), bounded."""
    from hangdoc.textsafe import visible

    text = visible(" ".join(str(e).split()))
    return text if len(text) <= MESSAGE_LIMIT else text[: MESSAGE_LIMIT - 3] + "..."


def last_call(digests: Any, describe: Callable[[tuple], Tuple[str, str]]) -> Tuple[str, int, Optional[list], str]:
    """(group, calls issued in it, [None, call, site], "; its last collective was #n of g, call at
    site") of the latest collective this rank issued (the entry and the phrase empty when unknown)."""
    group = digests.last[0] or "default_pg"
    g = digests.groups.get(group)
    n = g.n if g is not None else 0
    if g is not None and n:
        e_ring = g.ring[(n - 1) & (len(g.ring) - 1)]
        if e_ring is not None and e_ring[0] == n - 1:
            call, site = describe(e_ring[3])
            return group, n, [None, call, site], f"; its last collective was #{n - 1} of {group}, {call} at {site}"
    return group, n, None, ""


def verdict(e: BaseException, rank: int, digests: Any, describe: Callable[[tuple], Tuple[str, str]]) -> Optional[Verdict]:
    """The ``rank-failed`` verdict for ``e``, raised on ``rank``; None for an exception that came
    out of a collective, or after a SIGTERM."""
    from hangdoc.ranges import describe_ranks

    from hangdoc.runtime import on_term

    if from_a_collective(e) or on_term.terminating():
        return None
    frames = traceback.extract_tb(e.__traceback__) if e.__traceback__ is not None else []
    where = f" at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
    msg = _message(e)
    group, n, entry, last = last_call(digests, describe)
    v = Verdict(group, max(0, n - 1), True, [rank], [], entry, None, "raised")
    v.kind = "rank-failed"
    v.text = (f"{describe_ranks([rank])} raised {type(e).__name__}{': ' + msg if msg else ''}{where}{last}: the other "
              f"ranks wait for it at their next collective")
    return v
