"""The library's logger, ``logging.getLogger("parallel_lora")``: INFO and above on stderr, on rank 0 only.

Under ``torchrun`` every rank runs the same code, so a message would otherwise appear once per rank. The
logger drops records on ranks other than 0 (``rank()``: of the default process group, else ``$RANK``). To
configure it otherwise:

- silence it: ``logging.getLogger("parallel_lora").setLevel(logging.WARNING)``;
- hear every rank: ``logging.getLogger("parallel_lora").removeFilter(parallel_lora._log.rank_zero_only)``;
- route it through your own handlers: ``logger.handlers.clear(); logger.propagate = True``.
"""

from __future__ import annotations

import logging
import os
import sys

import torch.distributed as dist

logger = logging.getLogger("parallel_lora")


def rank() -> int:
    """This process's rank: in the default process group, else ``$RANK`` (torchrun sets it before the group exists),
    else 0 (a process of its own)."""
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
    def stream(self):  # noqa: D102 - logging.StreamHandler's attribute
        return sys.stderr


rank_zero_only = _RankZeroFilter()
"""The filter on ``logger`` that keeps records on rank 0 only."""

if not logger.handlers:
    _handler = _StderrHandler()
    _handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(_handler)
    logger.propagate = False  # printed once, by our handler, not again by a root handler the user configured
if logger.level == logging.NOTSET:
    logger.setLevel(logging.INFO)
logger.addFilter(rank_zero_only)
