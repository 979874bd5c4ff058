"""Step 1 of a load (``io/load.py``): the checkpoint's names, shapes and dtypes matched against
a rank's targets, and the report of what was loaded, missing and unexpected."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from unickpt.ckpt.reader import CheckpointReader
from unickpt.errors import StateMismatchError
from unickpt.io.mapping import Node, plan_load
from unickpt.io.tensors import LocalSlice, global_shape, is_dtensor, st_dtype

__all__ = ["LoadReport", "Mapped", "match_targets", "raise_mismatch"]

#: A live tensor built through a mapping: (its name, the tree of stored tensors, this rank's boxes)
Mapped = tuple[str, Node, list[LocalSlice]]


@dataclass
class LoadReport:
    """What a load did: ``missing`` targets the checkpoint lacks, ``unexpected`` names it has extra."""

    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)

    # Mirrors torch's _IncompatibleKeys so code that reads these names keeps working.
    @property
    def missing_keys(self) -> list[str]:
        return self.missing

    @property
    def unexpected_keys(self) -> list[str]:
        return self.unexpected


def match_targets(
    reader: CheckpointReader,
    targets: dict[str, torch.Tensor],
    boxes_fn: Callable[[str, torch.Tensor], list[LocalSlice]],
    report: LoadReport,
    *,
    allow_dtype_cast: bool,
    prefix: str,
    what: str,
    ignore_unexpected: Callable[[str], bool] | None,
    transforms: list[Any] | None = None,
    mapped: list[Mapped] | None = None,
) -> tuple[list[tuple[str, str, list[LocalSlice]]], list[str]]:
    """The (target, stored tensor, boxes) each target loads from, and the mismatches found.

    With ``transforms`` (``io/mapping.py``), the targets the checkpoint does not hold by name are
    looked for through them: a renamed stored tensor joins the plan like any other, a tensor
    built from several stored ones (stacked experts, concatenated projections) is appended to
    ``mapped``, and what does not fit the mapping is a mismatch naming the tensor."""
    block = reader.block
    available: dict[str, str] = {}  # name without prefix -> stored name
    for stored in list(block.tensors) + list(block.aliases):
        if prefix:
            if not stored.startswith(prefix):
                continue
            available[stored[len(prefix) :]] = stored
        else:
            available[stored] = stored
    used: set[str] = set()
    mismatched: list[str] = []
    plan: list[tuple[str, str, list[LocalSlice]]] = []
    done_ids: dict[int, str] = {}
    built: dict[str, Node] = {}
    boxes_of: dict[str, list[LocalSlice]] = {}
    lacking = {n: t for n, t in targets.items() if n not in available} if transforms else {}
    if lacking:
        shapes = {}
        for n, t in lacking.items():
            boxes_of[n] = bx = boxes_fn(n, t)
            shapes[n] = tuple(bx[0].global_shape) if bx else tuple(global_shape(t))
        src_of = {k: block.aliases.get(full, full) for k, full in available.items()}
        stored_of = {k: (block.tensors[s].dtype, tuple(block.tensors[s].shape)) for k, s in src_of.items()}
        lp = plan_load(transforms or [], stored_of, shapes, skip=set(targets), src_of=src_of)
        mismatched.extend(lp.problems)
        for live, s in lp.renames.items():
            available[live] = available[s]
        built = lp.built
    for name, t in targets.items():
        found = available.get(name)
        if found is None:
            if id(t) in done_ids:  # tied to a target that is loaded already
                continue
            node = built.get(name)
            if node is None:
                report.missing.append(name)
                continue
            if node.dtype != st_dtype(t.dtype, name) and not allow_dtype_cast:
                mismatched.append(
                    f"{name}: checkpoint has dtype {node.dtype}, {what} has {st_dtype(t.dtype, name)} "
                    "(pass allow_dtype_cast=True to cast on load)"
                )
                continue
            used.update(node.sources())
            done_ids[id(t)] = name
            report.loaded.append(name)
            if mapped is not None:
                mapped.append((name, node, boxes_of[name]))
            continue
        stored = found
        used.add(stored)
        src = block.aliases.get(stored, stored)
        used.add(src)
        entry = block.tensors[src]
        boxes = boxes_of[name] if name in boxes_of else boxes_fn(name, t)
        # The boxes know the global tensor (a ZeRO target is a flat view of part of it).
        want_shape = list(boxes[0].global_shape) if boxes else list(global_shape(t))
        want_dtype = st_dtype(t.dtype, name)
        # A plain tensor with no boxes is a view of a rank's empty share (ZeRO): nothing to check.
        if entry.shape != want_shape and (boxes or is_dtensor(t)):
            mismatched.append(f"{name}: checkpoint has shape {entry.shape}, {what} has {want_shape}")
            continue
        if entry.dtype != want_dtype and not allow_dtype_cast:
            mismatched.append(
                f"{name}: checkpoint has dtype {entry.dtype}, {what} has {want_dtype} "
                "(pass allow_dtype_cast=True to cast on load)"
            )
            continue
        if id(t) in done_ids:
            continue
        done_ids[id(t)] = name
        report.loaded.append(name)
        plan.append((name, src, boxes))
    for stored, full in available.items():
        if full not in used and (ignore_unexpected is None or not ignore_unexpected(stored)):
            report.unexpected.append(stored)
    return plan, mismatched


def raise_mismatch(
    reader: CheckpointReader, report: LoadReport, mismatched: list[str], *, strict: bool, what: str
) -> None:
    problems = []
    if mismatched:
        problems.append("size or dtype mismatch:\n    " + "\n    ".join(mismatched))
    if strict and report.missing:
        problems.append(f"missing from the checkpoint ({len(report.missing)}): {report.missing[:20]}")
    if strict and report.unexpected:
        problems.append(
            f"in the checkpoint but not in the {what} ({len(report.unexpected)}): {report.unexpected[:20]}"
        )
    hint = _prefix_hint(report) if strict else ""
    if hint:
        problems.append(hint)
    if problems:
        where = reader.index_path or reader.directory
        raise StateMismatchError(
            f"{where} does not match the {what}; nothing was loaded:\n  " + "\n  ".join(problems),
            missing=report.missing if strict else [],
            unexpected=report.unexpected if strict else [],
            mismatched=mismatched,
        )


def _prefix_hint(report: LoadReport) -> str:
    """What to pass when the mismatch is a name prefix: the checkpoint was saved with ``prefix``
    (Colossal-AI's ``prefix`` names files; unickpt's prefixes every tensor name) or the load gave one."""
    missing, unexpected = set(report.missing), set(report.unexpected)
    if not missing or not unexpected:
        return ""
    for extra, fewer, say in (
        (unexpected, missing, "the checkpoint's"),
        (missing, unexpected, "the model's"),
    ):
        heads = {n.split(".", 1)[0] for n in extra}
        if len(heads) == 1 and all("." in n for n in extra):
            head = heads.pop()
            if fewer <= {n[len(head) + 1 :] for n in extra}:
                if say == "the checkpoint's":
                    return (
                        f"{say} names carry the prefix '{head}.' (saved with prefix={head!r}): "
                        f"load with prefix={head!r}"
                    )
                return f"{say} names carry the prefix '{head}.' that the checkpoint's lack"
    return ""
