"""Plans of a gathered save, kept for the next save of the same layout (issue 19).

A training run saves the same tensors, with the same global shapes and the same slices on the
same ranks, every time. The plan of a gathered save in a directory (the replica check of the
ranks' metas, ``planner.plan_save`` with its tiling check, then the files' order and every
tensor's writer ranges, ``hf_save.order_files``) is a pure function of the all-gathered slice
metas, the kind and the ranks' order of names, which every rank holds after the listing; so
each rank keeps the last few plans keyed on those inputs and reuses one when they repeat. The
key is the xxh3-128 digest of the pickled metas (not the metas: at thousands of ranks they
would hold hundreds of MB between saves), and layouts of more than ``_MAX_SLICES`` slices are
not kept. A plan that failed is never kept (the next save raises the same error again).

Cached plans are shared between saves: nothing may modify them (the object-store branch, which
renames planned files, never uses this cache).
"""

from __future__ import annotations

import collections
import pickle
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

import xxhash

from unickpt.io.planner import SavePlan, SliceMeta, plan_save
from unickpt.io.replicas import check_gathered_metas

__all__ = ["gathered_plan", "cached", "holds"]

T = TypeVar("T")

# A manager saves a model and an optimizer alternately (its Hugging Face copy is the model's save).
_KEEP = 4
_MAX_SLICES = 1 << 16  # about 15 MB of plan per kept layout
_cache: collections.OrderedDict[Hashable, object] = collections.OrderedDict()


def cached(key: Hashable, compute: Callable[[], T]) -> T:
    """``compute()``, or its value for an equal ``key`` computed before (the last ``_KEEP`` kept)."""
    try:
        value = _cache[key]
    except KeyError:
        value = compute()  # raises before anything is kept
        _cache[key] = value
        if len(_cache) > _KEEP:
            _cache.popitem(last=False)
    else:
        _cache.move_to_end(key)
    return value  # type: ignore[return-value]


def holds(value: object) -> bool:
    """Whether ``value`` is one of the kept values (the very object)."""
    return any(v is value for v in _cache.values())


def metas_key(per_rank: Sequence[Sequence[SliceMeta]]) -> str:
    """Every rank's slice metas (names, dtypes, global shapes, boxes) as one xxh3-128 digest of
    their pickle: equal bytes mean equal metas; equal metas pickled with other containers or
    other object sharing only miss the cache (each save builds its metas the same way)."""
    return xxhash.xxh3_128_hexdigest(pickle.dumps(per_rank, protocol=pickle.HIGHEST_PROTOCOL))


def gathered_plan(per_rank: Sequence[Sequence[SliceMeta]], *, kind: str, path: str) -> SavePlan:
    """The writers of a gathered save in a directory (``check_gathered_metas``, then ``plan_save``
    with one file per rank: ``hf_save`` plans the files), the same plan object for equal metas."""

    def compute() -> SavePlan:
        check_gathered_metas(per_rank, path)
        return plan_save(per_rank, kind=kind, size_per_shard_bytes=None, sliced=True)

    if sum(len(m) for m in per_rank) > _MAX_SLICES:
        return compute()
    return cached(("gathered_plan", kind, metas_key(per_rank)), compute)
