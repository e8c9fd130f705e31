"""Where a member that died in native code was: its Python stack, which faulthandler wrote as it died.

gloo aborts a rank whose collective does not match its peers' (``gloo::EnforceNotMet``, SIGABRT: an
``all_to_all_single`` whose receive splits are smaller than what a peer sends,
``examples/bugs/moe_capacity_alltoall_splits.py``); no Python runs after that, and the others see
only a process that is gone. With ``--detect`` every rank arms :mod:`hangdoc.runtime.fatal`
(``fatal-HOST-rN-PID.txt`` in the output directory, the same file the watchdog arms), and a rank on
the dead member's host reads that member's file, named by the ``host`` and ``pid`` of its last
publication (:mod:`hangdoc.runtime.detect_gone`): died inside a torch.distributed call, it is a
``collective-mismatch`` of that call (the backend's own check ended it), else ``rank-failed`` at its
line. The file is read as input: a regular file of this user, not followed through a link, at most
MAX_BYTES.

    >>> text = '''Fatal Python error: Aborted
    ...
    ... Thread 0x00007f01 (most recent call first):
    ...   File "/usr/lib/python3.11/threading.py", line 331 in wait
    ...
    ... Thread 0x00007f02 (most recent call first):
    ...   File "/venv/torch/distributed/distributed_c10d.py", line 5140 in all_to_all_single
    ...   File "/venv/torch/distributed/c10d_logger.py", line 83 in wrapper
    ...   File "<string>", line 73 in wrapper
    ...   File "/job/moe.py", line 80 in forward
    ...   File "/job/moe.py", line 97 in main
    ... '''
    >>> where(text)
    {'signal': 'Aborted', 'op': 'all_to_all_single', 'site': 'moe.py:80'}
"""

from __future__ import annotations

import os
import re
from typing import Dict, Optional

#: the most of a fatal file read (a process with many threads writes tens of KB)
MAX_BYTES = 256 << 10
_FIRST = re.compile(r"Fatal Python error: ([\w ]{1,60})")
_FRAME = re.compile(r'^\s{1,8}File "([^"\n]{1,1000})", line (\d{1,9}) in ([\w<>.]{1,200})\s*$')
_DIST = os.sep + os.path.join("torch", "distributed") + os.sep

def _user(file: str) -> bool:
    from hangdoc.runtime.detect_stall import is_lib

    return not is_lib(file)


def _at(file: str, line: str) -> str:
    from hangdoc.textsafe import visible

    return visible(f"{os.path.basename(file)}:{line}")[:200]  # (read from a file: control characters shown)


def where(text: str) -> Optional[Dict[str, Optional[str]]]:
    """{"signal", "op", "site"}: the fatal signal, the innermost torch.distributed function a thread
    died in (None when none was in one) and the user's line that made it (else the innermost user line of the
    last thread, the main one); None when the text is no fatal-signal dump."""
    first = _FIRST.match(text)
    if first is None:
        return None
    blocks = [[m.groups() for m in map(_FRAME.match, block.splitlines()) if m]
              for block in text.split("\n\n")[1:]]
    blocks = [b for b in blocks if b]
    for frames in blocks:
        for k, (file, _line, func) in enumerate(frames):
            if _DIST in file:  # c10d's calls, and torch's own over them (FSDP, DTensor, checkpoint)
                site = next((_at(f, n) for f, n, _fn in frames[k + 1:] if _user(f)), None)
                return {"signal": first.group(1).strip(), "op": func, "site": site}
    main = blocks[-1] if blocks else []
    site = next((_at(f, n) for f, n, _fn in main if _user(f)), None)
    return {"signal": first.group(1).strip(), "op": None, "site": site}


def read_where(out_dir: str, host: str, rank: int, pid: int) -> Optional[Dict[str, Optional[str]]]:
    """:func:`where` of the member's fatal file; None when there is none, or it is empty, not a
    regular file of this user, or no fatal-signal dump."""
    from hangdoc.runtime.fatal import path_for
    from hangdoc.safeio import open_input

    try:
        with open_input(path_for(out_dir, host, int(rank), int(pid)), follow=False) as f:
            if os.fstat(f.fileno()).st_uid != os.getuid():
                return None
            data = f.read(MAX_BYTES)  # (its head: the threads' stacks come first, the modules list last)
    except (OSError, ValueError):
        return None
    return where(data.decode("utf-8", "replace")) if data else None
