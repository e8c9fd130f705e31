"""What a launcher already puts in front of this process's output lines, so that hangdoc's output
prefix adds only the parts that are missing.

torchrun (torch 2.13) with ``--tee``/``--redirects`` points a rank's fd 1/2 at files
``<log dir>/<run id>_<suffix>/attempt_<n>/<local rank>/stdout.log`` / ``stderr.log`` (beside the
rank's ``TORCHELASTIC_ERROR_FILE``), and its agent copies each line to the console after the
prefix ``[${role_name}${local_rank}]:`` (``[default1]:``), or after
``$TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` (``torch/distributed/elastic/multiprocessing/tail_log.py``,
``agent/server/local_elastic_agent.py``). A stream that goes to such a file thus carries the local
rank (or whatever that template names) already; hangdoc's ``[host:rank] `` on top of it gave
``[default1]:[vm:1] ...``. On one node (``WORLD_SIZE == LOCAL_WORLD_SIZE``) the local rank is the
rank and the host is the same on every line, so nothing is missing; across nodes the host is, and
the rank unless the launcher's template has ``${rank}``.

    >>> env = {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}
    >>> missing_template("[${role_name}${local_rank}]:", env), missing_template("[${rank}]:", env)
    ('[{host}:{rank}] ', '[{host}] ')
    >>> missing_template("[${role_name}${local_rank}]:", {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"})
    ''

(torch's own ``[rankN]:`` is put only on an uncaught exception's traceback, by the
``sys.excepthook`` that ``init_process_group`` installs; ``hangdoc run`` prints the script's
traceback without it when the lines carry the rank already: :func:`rank_shown`.)
"""

from __future__ import annotations

import os
from typing import Dict, Mapping, Optional, Sequence, Tuple

#: hangdoc's default prefix (hangdoc.runtime.prefix.DEFAULT_TEMPLATE; not imported: that module is
#: also the drainer's program)
DEFAULT_TEMPLATE = "[{host}:{rank}] "
#: torchrun's prefix for a teed line when TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE is not set
TORCHRUN_TEMPLATE = "[${role_name}${local_rank}]:"
_STREAM_FILES = {1: "stdout.log", 2: "stderr.log"}


def torchelastic_template(fd: int, env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The prefix template torchrun's agent puts on the lines of ``fd`` (it goes to the rank's log
    file, which the agent tees to the console), or None when torchrun does not handle that stream."""
    env = os.environ if env is None else env
    error_file = env.get("TORCHELASTIC_ERROR_FILE")
    name = _STREAM_FILES.get(fd)
    if not error_file or not name:
        return None
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    if target != os.path.join(os.path.dirname(error_file), name):
        return None
    return env.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE") or TORCHRUN_TEMPLATE


def _one_node(env: Mapping[str, str]) -> bool:
    world, local = env.get("WORLD_SIZE", ""), env.get("LOCAL_WORLD_SIZE", "")
    return world.isdigit() and world == local


def missing_template(launcher_template: str, env: Optional[Mapping[str, str]] = None) -> str:
    """hangdoc's prefix template for lines that already carry ``launcher_template``: only what it
    lacks of host and rank ('' when nothing)."""
    env = os.environ if env is None else env
    has_rank = "${rank}" in launcher_template or "{rank}" in launcher_template
    has_local_rank = "${local_rank}" in launcher_template or "{local_rank}" in launcher_template
    if _one_node(env) and (has_rank or has_local_rank):
        return ""
    return "[{host}] " if has_rank else DEFAULT_TEMPLATE


def choose(fds: Sequence[int] = (1, 2), env: Optional[Mapping[str, str]] = None) -> Tuple[str, Tuple[int, ...]]:
    """(template, fds to prefix) for hangdoc's default prefix: the streams a launcher prefixes get
    only what is missing; where that is nothing they are left alone. Streams the launcher does not
    prefix get the full default; so do all of them where the two kinds would need two templates.

        >>> choose((1, 2), env={})
        ('[{host}:{rank}] ', (1, 2))
    """
    env = os.environ if env is None else env
    covered = {fd: torchelastic_template(fd, env) for fd in fds}
    launched = [fd for fd in fds if covered[fd] is not None]
    if not launched:
        return DEFAULT_TEMPLATE, tuple(fds)
    missing = {missing_template(covered[fd], env) for fd in launched}  # type: ignore[arg-type]
    others = tuple(fd for fd in fds if covered[fd] is None)
    if missing == {""}:
        return DEFAULT_TEMPLATE, others
    if len(missing) == 1 and not others:
        return missing.pop(), tuple(fds)
    return DEFAULT_TEMPLATE, tuple(fds)


#: fd -> the template hangdoc's prefix uses on it now (set by hangdoc.runtime.wrap)
_prefixed: Dict[int, str] = {}


def note_prefix(template: str, fds: Sequence[int]) -> None:
    """Remember which streams hangdoc prefixes, and with what, for :func:`rank_shown`."""
    _prefixed.clear()
    _prefixed.update((fd, template) for fd in fds)


def rank_shown(fd: int = 2, env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether the lines written to ``fd`` carry this process's rank already: hangdoc's prefix on
    it names the rank, or the launcher's does."""
    from hangdoc.runtime.prefix import active

    env = os.environ if env is None else env
    template = _prefixed.get(fd)
    if template is not None and active() and ("{rank}" in template):
        return True
    launcher = torchelastic_template(fd, env)
    if launcher is None:
        return False
    return "${rank}" in launcher or ("${local_rank}" in launcher and _one_node(env))
