"""What a watchdog dump is made of, apart from the watchdog: every thread's stack from
faulthandler (through a file in memory: a full disk must not cost the stacks), the tracebacks of
threads that died of an exception, and the atomic write of the files (stacks 0600).

    >>> import threading
    >>> saved = threading.excepthook; threading.excepthook = lambda args: None  # quiet here
    >>> errors = []
    >>> hooks = keep_thread_errors(errors)
    >>> t = threading.Thread(target=lambda: 1 / 0, name="prefetch"); t.start(); t.join()
    >>> release_thread_errors(hooks); threading.excepthook = saved
    >>> errors[0].splitlines()[0], errors[0].splitlines()[-1]
    ('Exception in thread prefetch:', 'ZeroDivisionError: division by zero')
"""

from __future__ import annotations

import faulthandler
import os
import tempfile
import threading
from typing import Any, List, Optional, Tuple

#: tracebacks of dead threads kept at most
MAX_THREAD_ERRORS = 4


def write_file(out_dir: str, path: str, text: str) -> None:
    from hangdoc.atomic import write_atomic

    os.makedirs(out_dir, exist_ok=True)
    # stacks may name anything a frame shows: the job's user's alone
    write_atomic(path, text, mode=0o600 if os.path.basename(path).startswith("stacks-") else None)


def faulthandler_text() -> str:
    """Every thread's stack from faulthandler (it writes to a file descriptor, not a Python stream),
    through a file in memory where there is one: a full disk must not cost the stacks."""
    memfd = getattr(os, "memfd_create", None)
    fd = -1
    if memfd is not None:
        try:
            fd = memfd("hangdoc-stacks", getattr(os, "MFD_CLOEXEC", 0))
        except OSError:
            fd = -1
    if fd < 0:
        with tempfile.TemporaryFile() as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
            f.seek(0)
            return f.read().decode("utf-8", "replace")
    try:
        faulthandler.dump_traceback(file=fd, all_threads=True)
        size = os.fstat(fd).st_size
        return os.pread(fd, size, 0).decode("utf-8", "replace")
    finally:
        os.close(fd)


def keep_thread_errors(into: List[str]) -> Tuple[Any, Any]:
    """Keep the traceback of each thread that dies of an exception in ``into`` (a prefetch thread
    whose queue the main thread then waits on for ever: the stall's dump starts with it; Python
    prints it to stderr only, which the output directory would not have). The job's own hook still
    runs. Returns (the hook before, this one) for :func:`release_thread_errors`."""
    before = threading.excepthook

    def hook(args: Any) -> None:
        try:
            if args.exc_type is not SystemExit and len(into) < MAX_THREAD_ERRORS:
                import traceback

                name = getattr(args.thread, "name", "?")
                into.append(f"Exception in thread {name}:\n" + "".join(
                    traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback)))
        except Exception:
            pass
        before(args)

    threading.excepthook = hook
    return before, hook


def release_thread_errors(hooks: Optional[Tuple[Any, Any]]) -> None:
    """Put the hook before back, unless someone replaced ours since."""
    if hooks is not None and threading.excepthook is hooks[1]:
        threading.excepthook = hooks[0]
