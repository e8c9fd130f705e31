"""``get_logger(name)``: a stdlib logger whose records carry ``host``, ``rank`` and ``local_rank``.

    >>> import hangdoc
    >>> log = hangdoc.get_logger("train")
    >>> log.warning("step %d is slow", 7)      # doctest: +SKIP
    [node7:3] 2026-11-22 00:10:00,123 WARNING train: step 7 is slow

The fields are read from the launcher's environment (and torch.distributed once it is initialised)
for each record, so a logger made before ``init_process_group`` still logs the right rank. Nothing
here issues a collective or a barrier. While :func:`hangdoc.prefix_output` is active, the handler
leaves the ``[host:rank]`` part out, since every line is prefixed already.
"""

from __future__ import annotations

import logging
import sys

from hangdoc.runtime.identity import identity

__all__ = ["get_logger", "RankFilter", "RankFormatter"]

_HANDLER_FLAG = "_hangdoc_handler"


class RankFilter(logging.Filter):
    """Adds ``host``, ``rank``, ``local_rank`` and ``world_size`` to every record it sees."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            ident = identity()
            record.host, record.rank = ident.host, ident.rank
            record.local_rank, record.world_size = ident.local_rank, ident.world_size
        except Exception:  # logging must never break the job
            record.host, record.rank, record.local_rank, record.world_size = "?", -1, -1, -1
        return True


class RankFormatter(logging.Formatter):
    """``[host:rank] time LEVEL name: message``, without the tag while output is prefixed anyway
    (by hangdoc, or by torchrun's ``--tee`` where that names the rank)."""

    TAGGED = "[%(host)s:%(rank)s] %(asctime)s %(levelname)s %(name)s: %(message)s"
    PLAIN = "%(asctime)s %(levelname)s %(name)s: %(message)s"

    def __init__(self) -> None:
        super().__init__(self.TAGGED)
        self._plain = logging.Formatter(self.PLAIN)

    def format(self, record: logging.LogRecord) -> str:
        from hangdoc.runtime import launcher_prefix, prefix

        if prefix.active() or not hasattr(record, "rank") or launcher_prefix.rank_shown(2):
            return self._plain.format(record)
        return super().format(record)


def get_logger(name: str = "hangdoc", level: int = logging.INFO) -> logging.Logger:
    """A logger whose records carry host and rank; adds one stderr handler the first time.

    Records still propagate to the root logger only when the caller configured handlers there
    themselves and this logger has none of its own; otherwise each message would print twice.
    """
    logger = logging.getLogger(name)
    if not any(isinstance(f, RankFilter) for f in logger.filters):
        logger.addFilter(RankFilter())
    if not any(getattr(h, _HANDLER_FLAG, False) for h in logger.handlers) and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(RankFormatter())
        setattr(handler, _HANDLER_FLAG, True)
        logger.addHandler(handler)
        logger.propagate = False
    if logger.level == logging.NOTSET:
        logger.setLevel(level)
    return logger
