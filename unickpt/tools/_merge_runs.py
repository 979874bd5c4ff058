"""The slices of each tensor as contiguous runs of its flat range, and merge's structure check.

Most layouts store every slice of a tensor as one contiguous run of the flattened tensor (row
slices of FSDP/TP ``Shard(0)``, ZeRO flat ranges, whole tensors): merge then copies bytes
straight from source to output, and coverage is shown in O(slices) instead of the general sweep.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from unickpt.ckpt.reader import CheckpointReader, check_keys_referenced
from unickpt.ckpt.stored_slices import all_referenced, locate_all
from unickpt.errors import IndexFileError
from unickpt.spec.boxes import contiguous_start, coverage_problem
from unickpt.spec.index import SliceEntry, TensorEntry
from unickpt.tools._merge_bulk import row_order

__all__ = ["Run", "RunsOf", "flat_runs", "validate_runs"]


@dataclass(frozen=True)
class Run:
    """One contiguous run of the flattened tensor stored as one slice."""

    slice: SliceEntry
    flat_start: int  # in elements


def flat_runs(t: TensorEntry) -> list[Run] | None:
    """The slices as contiguous runs in flat order, or None when some slice is not contiguous."""
    runs = []
    for s in t.slices:
        if math.prod(s.shape) == 0:
            continue
        start = contiguous_start(t.shape, s.offsets, s.shape)
        if start is None:
            return None
        runs.append(Run(s, start))
    runs.sort(key=lambda r: r.flat_start)
    return runs


def _tiles(t: TensorEntry, runs: list[Run] | None) -> bool:
    """True when ``runs`` lie inside the tensor and tile its flat range exactly once.

    O(slices) with no numpy: the common layouts (row splits, ZeRO flat ranges, whole tensors)
    need nothing more, and ``coverage_problem`` would find nothing to report for them. False
    means "not shown here", not "broken": the general check then decides.
    """
    if runs is None:
        return False
    end = 0
    for r in runs:
        s = r.slice
        inside = all(o >= 0 and o + n <= g for o, n, g in zip(s.offsets, s.shape, t.shape, strict=True))
        if r.flat_start != end or not inside:
            return False
        end += math.prod(s.shape)
    return end == math.prod(t.shape)


class RunsOf(dict[str, "list[Run] | None"]):
    """Tensor name -> its flat runs (``flat_runs``); for a tensor whose slices are row blocks the
    runs are built only when asked (``rows`` holds their order, which the bulk merge uses)."""

    def __init__(self, tensors: dict[str, TensorEntry]) -> None:
        super().__init__()
        self.tensors = tensors
        self.rows: dict[str, np.ndarray] = {}

    def __missing__(self, name: str) -> list[Run] | None:
        runs = self[name] = flat_runs(self.tensors[name])
        return runs


def validate_runs(r: CheckpointReader) -> RunsOf:
    """``r.validate_structure()`` with the same checks, order and errors; returns each tensor's
    flat runs (``flat_runs``) for the copy.

    Coverage is shown from the slice table for tensors of row blocks (``row_order``), in O(slices)
    for other tensors whose slices are contiguous runs (``_tiles``); only the others go through
    ``coverage_problem``'s general sweep.
    """
    r.open_files(r.files)  # each header bounds the slices in its file before they are built
    runs_of = RunsOf(r.block.tensors)
    for name, t in r.block.tensors.items():
        rows = row_order(t)
        if rows is not None:
            runs_of.rows[name] = rows
            continue
        nd = len(t.shape)
        same_dims = all(len(s.offsets) == nd and len(s.shape) == nd for s in t.slices)
        runs = flat_runs(t) if same_dims else None
        runs_of[name] = runs
        if not _tiles(t, runs):
            problem = coverage_problem(t.shape, [(tuple(s.offsets), tuple(s.shape)) for s in t.slices])
            if problem:
                raise IndexFileError(f"{r.index_path or r.directory}: tensor {name!r}: {problem}")
    matched = locate_all(r)  # every slice at once (spans kept for the copy); raises naming the first bad one
    if r.has_unickpt_block and not all_referenced(r.header, r.files, matched):
        check_keys_referenced(r.block, r.files, r.header)
    return runs_of
