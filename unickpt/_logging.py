"""Rank-aware logging: unickpt's loggers speak on rank 0 by default.

Every module logs through ``get_logger(__name__)`` (plain ``logging`` loggers, so handlers and
levels are the user's to configure). In a multi-process job, records below WARNING from ranks
other than 0 are dropped, and every record is prefixed with ``[rank N]``. Set
``UNICKPT_LOG_ALL_RANKS=1`` to hear every rank. Warnings and errors always pass.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["get_logger"]


def _rank_and_world() -> tuple[int, int]:
    # Never import torch here: the CLI logs too, and must start fast.
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return int(dist.get_rank()), int(dist.get_world_size())
    except (RuntimeError, ValueError):
        pass
    try:
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 0, 1


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        rank, world = _rank_and_world()
        if world <= 1:
            return True
        if rank != 0 and record.levelno < logging.WARNING and os.environ.get("UNICKPT_LOG_ALL_RANKS") != "1":
            return False
        if not getattr(record, "_unickpt_rank", False):
            record.msg = f"[rank {rank}] {record.msg}"
            record._unickpt_rank = True
        return True


_FILTER = _RankFilter()


def get_logger(name: str) -> logging.Logger:
    logger = logging.getLogger(name)
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
    return logger
