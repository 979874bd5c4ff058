"""``SaveOptions``: what one save is written with (kind, layout, shard size, hashes, fsync, store options).

A leaf of the save code: ``save.py``, ``hf_save.py``, ``funnel_save.py`` and ``save_block.py``
take it, and ``CheckpointIO`` builds it from its own options (``WriteSpec`` in ``save.py``
carries it to an async save's writer process).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

from unickpt.errors import ConfigError
from unickpt.spec.index import LayoutInfo

__all__ = ["SaveOptions", "check_size_per_shard"]


@dataclass(frozen=True)
class SaveOptions:
    """The options of one save: its kind, layout (``shard``, ``gather``, the shard size in MB, the
    parallel layout the index records) and what it writes beside the bytes (hashes,
    fingerprints), whether data files are fsynced, and the fsspec options of a URL."""

    kind: str  # "model" or "optimizer"
    shard: bool
    gather: bool
    size_per_shard_mb: float
    layout: LayoutInfo
    hashes: bool = True
    fingerprints: bool = True
    fsync: bool = True
    # fsspec options of a URL ``path`` (credentials, endpoint); None: the environment's.
    storage_options: dict[str, Any] | None = None


# The largest shard size a save plans with (1 EiB): ``size_per_shard=float("inf")`` means no
# limit, as in Colossal-AI (every tensor in one file), and stays an integer byte count.
_MAX_SHARD_MB = float(1 << 40)


def check_size_per_shard(size_mb: object) -> float:
    """``size_per_shard`` (MB) as a float; ``ConfigError`` naming it for anything but a positive number.

    ``inf`` is no limit (one file, as Colossal-AI writes). ``None``, strings, NaN, zero and
    negative sizes are refused before anything is planned.
    """
    if not isinstance(size_mb, numbers.Real) or math.isnan(float(size_mb)) or float(size_mb) <= 0:
        raise ConfigError(
            f"size_per_shard must be a positive number of MB (int or float; inf for no limit), got {size_mb!r}"
        )
    return min(float(size_mb), _MAX_SHARD_MB)
