"""What the save paths share: per-slice write results, the writer of a save, the block."""

from __future__ import annotations

from typing import Any

from unickpt import __version__
from unickpt.ckpt.writer import CheckpointWriter, FileSpec, build_block, tensor_entry
from unickpt.io.planner import PlannedFile, SavePlan
from unickpt.io.save_options import SaveOptions
from unickpt.spec.index import TensorEntry, UnickptBlock
from unickpt.spec.slice_table import SliceColumns
from unickpt.store.storage import Storage

__all__ = ["Results", "VERSION", "build_save_block", "by_slice", "file_specs", "make_writer"]

VERSION = f"unickpt {__version__}"

#: (tensor name, slice number) -> (xxh3-64 or None, fingerprint partial)
Results = dict[tuple[str, int], tuple[str | None, int]]


def make_writer(
    directory: str, opts: SaveOptions, plan: SavePlan, save_id: str, store: Storage
) -> CheckpointWriter:
    """The writer of one save's files."""
    return CheckpointWriter(
        directory, opts.kind, save_id, plan.sliced, opts.hashes, opts.fingerprints, opts.fsync, storage=store
    )


def file_specs(plan: SavePlan, files: list[PlannedFile]) -> list[FileSpec]:
    return [(f.name, [(ps.key, plan.tensors[ps.name][0], ps.shape) for ps in f.slices]) for f in files]


def by_slice(files: list[PlannedFile], written: dict[str, tuple[str | None, int]]) -> Results:
    """What the writer returned per key, per (tensor, slice number) (merged across ranks)."""
    return {(ps.name, ps.k): written[ps.key] for f in files for ps in f.slices}


def build_save_block(
    plan: SavePlan,
    results: Results,
    opts: SaveOptions,
    aliases: dict[str, str],
    entry_extras: dict[str, dict[str, Any]] | None,
    block_extras: dict[str, Any] | None,
    *,
    file_name: str | None = None,
    placeholder: bool = False,
    save_id: str | None = None,
) -> UnickptBlock:
    """The unickpt block of ``plan`` from each slice's (xxh3, partial); file names from the plan
    (or ``file_name`` for a single file)."""
    file_of = {(ps.name, ps.k): f.name for f in plan.files for ps in f.slices}
    entries: dict[str, TensorEntry] = {}
    for name, (dtype, gshape) in plan.tensors.items():
        planned = plan.slices[name]
        slices = SliceColumns(name, gshape)
        for ps in planned:
            slices.add(
                file_name or file_of[(name, ps.k)], ps.key, ps.offsets, ps.shape, results[(name, ps.k)][0]
            )
        partials = [results[(name, ps.k)][1] for ps in planned] if opts.fingerprints else None
        extra = (entry_extras or {}).get(name, {})
        entries[name] = tensor_entry(
            name, dtype, gshape, slices.table(), partials, placeholder=placeholder, **extra
        )
    return build_block(
        kind=opts.kind,
        created_by=VERSION,
        layout=opts.layout.model_copy(update={"gathered": opts.gather}),
        tensors=entries,
        aliases=aliases,
        save_id=save_id,
        **(block_extras or {}),
    )
