"""``logging.getLogger("parallel_lora")``: INFO and above on stderr, rank 0 only (``removeFilter(rank_zero_only)``
to hear every rank; ``handlers.clear()`` and ``propagate = True`` for your own handlers)."""

from __future__ import annotations

import logging
import os
import sys

import torch.distributed as dist

logger = logging.getLogger("parallel_lora")


def rank() -> int:
    """This process's rank: in the default process group, else ``$RANK`` (set by torchrun), else 0."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


class _RankZeroFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return rank() == 0


class _StderrHandler(logging.StreamHandler):
    """Writes to ``sys.stderr`` as it is at each record (redirections and test capture included)."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property
    def stream(self):
        return sys.stderr


rank_zero_only = _RankZeroFilter()
"""The filter on ``logger`` that keeps records on rank 0 only."""

if not logger.handlers:
    _handler = _StderrHandler()
    _handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(_handler)
    logger.propagate = False  # not printed again by a root handler the user configured
if logger.level == logging.NOTSET:
    logger.setLevel(logging.INFO)
logger.addFilter(rank_zero_only)
