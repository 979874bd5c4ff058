"""Cross-rank agreement on what is saved: replicas that must be identical, shapes that must match.

* ``check_replicas``: the ranks holding the same slice of a tensor (DDP replicas, a TP bias,
  the data-parallel copies of HSDP/hybrid shards, ZeRO's replicated parameters) must hold the
  same bytes, since only one of them is written. Each rank digests the local slices another rank
  holds too (xxh3-64 of the bytes, about 10 GiB/s; a slice one rank holds is only listed); the
  digests (16 hex digits per slice, not the data) are all-gathered and compared: a synchronous
  save carries them in its planning agreement (``ReplicaCheck``, ``judge``), an async save's copy
  in an exchange of the background thread (``check_replicas`` with the ``Staged`` record, whose
  non-written replicas were digested when staged). With ``everywhere=True`` (DDP: every rank holds every tensor) a slice some
  ranks lack counts as divergent too (a parameter frozen on one rank has no optimizer state
  there). Divergent replicas are reported naming each tensor and which ranks hold which
  digest: a ``ReplicaMismatchWarning`` (``mode="warn"``, the default), a ``DistributedError``
  on every rank (``"raise"``), or not checked at all (``"off"``).
* ``check_gathered_metas``: a gathered save writes each tensor from one rank's view; ranks
  that disagree on a tensor's dtype or global shape get a ``DistributedError`` on every rank
  instead of a file holding rank 0's idea of it.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import xxhash

from unickpt import _dist
from unickpt._faults import maybe_fail
from unickpt._logging import get_logger
from unickpt.errors import ConfigError, DistributedError
from unickpt.io.pinned import POOL
from unickpt.io.tensors import LocalSlice, Staged, as_bytes

__all__ = [
    "REPLICA_MODES",
    "ReplicaCheck",
    "ReplicaMismatchWarning",
    "check_gathered_metas",
    "check_replicas",
    "digest_live",
    "judge",
    "replicated_boxes",
]

logger = get_logger(__name__)
REPLICA_MODES = ("warn", "raise", "off")
_SHOWN = 20

SliceKey = tuple[str, tuple[int, ...], tuple[int, ...]]


class ReplicaMismatchWarning(UserWarning):
    """Ranks that should hold identical copies of a tensor slice hold different bytes."""


# What a rank reports for a box it holds alone (a staged save knows nobody else holds it): no
# digest is needed to compare one copy, but the box's presence counts (``everywhere``).
_HELD = "held"
# Bytes of a device tensor moved to CPU at a time to digest it (bounded memory).
_CHUNK = 64 << 20


def digest_live(t: torch.Tensor) -> str | None:
    """xxh3-64 of a tensor's bytes in C order (None when empty), a device tensor read through a
    bounded CPU buffer: the digest of a replica that is not copied for the save."""
    t = t.detach()
    if t.numel() == 0:
        return None
    if t.device.type == "cpu":
        return xxhash.xxh3_64_hexdigest(memoryview(as_bytes(t)))  # type: ignore[arg-type]
    flat = t.contiguous().reshape(-1).view(torch.uint8)
    h = xxhash.xxh3_64()
    # One exact-size pinned buffer of the process's pool (io/pinned.py), reused by the next digest.
    staging = POOL.lease("digest", shared=False)
    try:
        buf = staging.at_least("chunk", min(_CHUNK, flat.numel()))
        for start in range(0, flat.numel(), _CHUNK):
            part = flat[start : start + _CHUNK]
            chunk = buf[: part.numel()]
            chunk.copy_(part)
            h.update(memoryview(chunk.numpy()))  # type: ignore[arg-type]
    finally:
        POOL.give_back(staging)
    return h.hexdigest()


def replica_digests(slices: dict[str, list[LocalSlice]], staged: Staged | None = None) -> dict[SliceKey, str]:
    """This rank's report: a digest per box it holds (a staged save's: of the replicated boxes
    only, the others ``_HELD``; the replicas it does not write were digested when staged)."""
    replicated = None if staged is None else staged.replicated
    known = {} if staged is None else staged.digests
    out: dict[SliceKey, str] = {}
    for name, sls in slices.items():
        for sl in sls:
            key = (name, tuple(sl.offsets), tuple(sl.shape))
            if key in known:
                out[key] = known[key]
                continue
            if sl.tensor.device.type == "meta" or sl.tensor.numel() == 0:
                continue
            if replicated is not None and key not in replicated:
                out[key] = _HELD
                continue
            data = as_bytes(sl.tensor)
            if data.size == 0:
                continue
            out[key] = xxhash.xxh3_64_hexdigest(memoryview(data))  # type: ignore[arg-type]
    return out


def _describe(key: SliceKey, by_digest: dict[str, list[int]]) -> str:
    name, offsets, shape = key
    where = "" if not any(offsets) else f" (slice at offsets {list(offsets)}, shape {list(shape)})"
    groups = "; ".join(
        f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {d if d in ('missing', _HELD) else 'xxh3 ' + d}"
        for d, rs in sorted(by_digest.items(), key=lambda kv: kv[1][0])
    )
    return f"tensor {name!r}{where}: {groups}"


def check_replicas(
    slices: dict[str, list[LocalSlice]],
    mode: str,
    what: str,
    group: Any = None,
    *,
    everywhere: bool = False,
    staged: Staged | None = None,
) -> None:
    """Collective: compare the digests of the slices several ranks hold; act on divergence per ``mode``.

    ``staged``: the slices are an async save's copy (``io/stage.py``): only the boxes it names as
    replicated are digested (from the copy, or the digest taken when the live tensor was staged).
    """
    if mode not in REPLICA_MODES:
        raise ConfigError(f"check_replicas must be one of {REPLICA_MODES}, got {mode!r}")
    if mode == "off" or _dist.world_size(group) == 1:
        return

    err: BaseException | None = None
    mine: dict[SliceKey, str] = {}
    try:
        maybe_fail("replicas.digest")
        mine = replica_digests(slices, staged)
    except BaseException as e:
        err = e
    # One exchange: the agreement on the digesting carries the digests.
    everyone = _dist.agree_gather(err, mine, f"digesting the replicated tensors of {what}", group)
    judge(everyone, mode, what, everywhere=everywhere)


@dataclasses.dataclass(frozen=True)
class ReplicaCheck:
    """The replica check a save makes (``io.save.save_tensors`` carries its digests in its own
    exchanges): ``mode`` (``REPLICA_MODES``), ``what`` (the save, for the message), ``everywhere``
    (DDP: a box some ranks lack is a divergence too)."""

    mode: str
    what: str
    everywhere: bool = False


def replicated_boxes(all_metas: Sequence[Sequence[tuple[Any, ...]]]) -> frozenset[SliceKey]:
    """Every rank, same input: the boxes (name, offsets, shape) two ranks or more list."""
    count: dict[SliceKey, int] = {}
    for metas in all_metas:
        for key in {(m[0], tuple(m[3]), tuple(m[4])) for m in metas}:
            count[key] = count.get(key, 0) + 1
    return frozenset(k for k, n in count.items() if n > 1)


def judge(everyone: Sequence[dict[SliceKey, str]], mode: str, what: str, *, everywhere: bool = False) -> None:
    """Every rank, same input (every rank's report): warn or raise per ``mode`` when replicas differ."""
    holders: dict[SliceKey, dict[str, list[int]]] = {}
    for r, ds in enumerate(everyone):
        for key, d in ds.items():
            holders.setdefault(key, {}).setdefault(d, []).append(r)
    if everywhere:
        for key, by_digest in holders.items():
            lacking = [r for r, ds in enumerate(everyone) if key not in ds]
            if lacking:
                by_digest["missing"] = lacking
    diverged = sorted((k, v) for k, v in holders.items() if len(v) > 1)
    if not diverged:
        return
    lines = "\n  ".join(_describe(k, v) for k, v in diverged[:_SHOWN])
    more = f"\n  ... and {len(diverged) - _SHOWN} more" if len(diverged) > _SHOWN else ""
    message = (
        f"{what}: {len(diverged)} replicated tensor slice(s) differ across ranks, and only one copy is "
        f"saved:\n  {lines}{more}\nThe replicas diverged (a rank skipped a gradient all-reduce or an "
        "update, or was initialised differently)."
    )
    if mode == "raise":
        raise DistributedError(message)
    logger.warning("%s", message)
    warnings.warn(message, ReplicaMismatchWarning, stacklevel=3)


def check_gathered_metas(all_metas: Sequence[Sequence[tuple[Any, ...]]], path: str) -> None:
    """Every rank, same input: refuse a gathered save whose ranks disagree on a tensor's dtype or shape."""
    seen: dict[str, dict[tuple[str, tuple[int, ...]], list[int]]] = {}
    for r, metas in enumerate(all_metas):
        for m in metas:
            name, dtype, gshape = m[0], m[1], tuple(m[2])
            seen.setdefault(name, {}).setdefault((dtype, gshape), []).append(r)
    bad = {n: v for n, v in seen.items() if len(v) > 1}
    if not bad:
        return
    lines = "\n  ".join(
        f"tensor {n!r}: "
        + "; ".join(
            f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {dt}{list(shp)}"
            for (dt, shp), rs in v.items()
        )
        for n, v in sorted(bad.items())[:_SHOWN]
    )
    more = f"\n  ... and {len(bad) - _SHOWN} more" if len(bad) > _SHOWN else ""
    raise DistributedError(
        f"{path}: the ranks disagree on the dtype or global shape of {len(bad)} tensor(s) of a gathered "
        f"save, so no rank's view can be written:\n  {lines}{more}"
    )
