"""Who writes which slice into which file: pure functions over every rank's slice list.

Inputs and outputs are plain data (names, shapes, integers), so the whole plan is tested
without a process group. Every rank computes the same plan from the same all-gathered
inputs; no further coordination is needed to agree on file names.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from unickpt.ckpt.writer import group_files
from unickpt.errors import StateMismatchError
from unickpt.spec.boxes import coverage_problem
from unickpt.spec.dtypes import itemsize
from unickpt.spec.naming import shard_name, single_name, slice_key

__all__ = ["SliceMeta", "PlannedSlice", "PlannedFile", "SavePlan", "plan_save"]

# (name, dtype, global_shape, offsets, shape)
SliceMeta = tuple[str, str, tuple[int, ...], tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True)
class PlannedSlice:
    name: str
    k: int  # position in the tensor's slice list
    key: str  # key inside the file
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    rank: int  # writer
    local_index: int  # index into the writer's own slice list


@dataclass
class PlannedFile:
    name: str
    rank: int
    slices: list[PlannedSlice] = field(default_factory=list)


@dataclass
class SavePlan:
    tensors: dict[str, tuple[str, tuple[int, ...]]]  # name -> (dtype, global shape), in save order
    files: list[PlannedFile]
    slices: dict[str, list[PlannedSlice]]  # name -> slices in k order
    sliced: bool  # True: keys are slice keys and weight_map points at the sentinel

    def files_of(self, rank: int) -> list[PlannedFile]:
        return [f for f in self.files if f.rank == rank]


def plan_save(
    per_rank: Sequence[Sequence[SliceMeta]],
    *,
    kind: str,
    size_per_shard_bytes: int | None,
    sliced: bool,
) -> SavePlan:
    """Deduplicate replicas, pick one writer per block, and group each writer's blocks into files.

    - Blocks with the same (name, offsets, shape) on several ranks are replicas: the one
      with the least bytes assigned so far writes it (biggest blocks first), so replicated
      tensors (DDP) spread over all ranks instead of all landing on rank 0.
    - Different ranks must agree on a tensor's dtype and global shape, and the kept blocks
      must tile each tensor exactly once: otherwise ``StateMismatchError`` names the tensor.
    - ``size_per_shard_bytes=None`` puts each rank's blocks into one file; otherwise blocks
      are grouped with huggingface_hub's splitter. Files are numbered globally
      (``model-00001-of-0000N``), rank 0's first.
    """
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    holders: dict[tuple[str, tuple[int, ...], tuple[int, ...]], list[tuple[int, int]]] = {}
    problems: list[str] = []
    for r, metas in enumerate(per_rank):
        for i, (name, dtype, gshape, off, shp) in enumerate(metas):
            declared = (dtype, tuple(gshape))
            seen = tensors.setdefault(name, declared)
            if seen != declared:
                problems.append(
                    f"tensor {name!r}: rank {r} has {dtype}{list(gshape)}, another rank {seen[0]}{list(seen[1])}"
                )
                continue
            holders.setdefault((name, tuple(off), tuple(shp)), []).append((r, i))
    if problems:
        raise StateMismatchError("ranks disagree about tensors:\n  " + "\n  ".join(problems[:20]))

    by_name: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {n: [] for n in tensors}
    for name, off, shp in holders:
        by_name[name].append((off, shp))
    for name, (_, gshape) in tensors.items():
        problem = coverage_problem(gshape, by_name[name])
        if problem:
            problems.append(f"tensor {name!r}: {problem}")
    if problems:
        raise StateMismatchError(
            "the ranks' slices do not tile their tensors exactly once:\n  " + "\n  ".join(problems[:20])
        )

    load = [0] * max(1, len(per_rank))
    assignment: dict[tuple[str, tuple[int, ...], tuple[int, ...]], tuple[int, int]] = {}
    isz = {name: itemsize(dtype) for name, (dtype, _) in tensors.items()}
    nbytes_of = {box: math.prod(box[2]) * isz[box[0]] for box in holders}
    order = sorted(holders, key=lambda b: (-nbytes_of[b], b[0], b[1]))
    for box in order:
        held = holders[box]
        # One holder (a sharded block): it writes it; replicas go to the least loaded rank.
        r, i = held[0] if len(held) == 1 else min(held, key=lambda ri: (load[ri[0]], ri[0]))
        load[r] += nbytes_of[box]
        assignment[box] = (r, i)

    slices: dict[str, list[PlannedSlice]] = {}
    per_writer: dict[int, list[PlannedSlice]] = {}
    for name in tensors:
        boxes = sorted(by_name[name])
        lst = []
        for k, (off, shp) in enumerate(boxes):
            r, i = assignment[(name, off, shp)]
            key = slice_key(name, k) if sliced else name
            ps = PlannedSlice(name, k, key, off, shp, r, i)
            lst.append(ps)
        slices[name] = lst
    # Writers keep their blocks in save order, so files follow the model's order.
    for name in tensors:
        for ps in slices[name]:
            per_writer.setdefault(ps.rank, []).append(ps)

    groups: list[tuple[int, list[PlannedSlice]]] = []
    for r in sorted(per_writer):
        mine = per_writer[r]
        if size_per_shard_bytes is None:
            groups.append((r, mine))
            continue
        sizes = {ps.key: nbytes_of[(ps.name, ps.offsets, ps.shape)] for ps in mine}
        by_key = {ps.key: ps for ps in mine}
        # The splitter's names are replaced by global ones.
        for keys in group_files(sizes, max(1, size_per_shard_bytes)):
            groups.append((r, [by_key[k] for k in keys]))
    n = len(groups)
    files = []
    for j, (r, members) in enumerate(groups):
        fname = (
            single_name(kind)
            if (n == 1 and not sliced and size_per_shard_bytes is None)
            else shard_name(kind, j + 1, n)
        )
        files.append(PlannedFile(fname, r, list(members)))
    return SavePlan(tensors, files, slices, sliced)
