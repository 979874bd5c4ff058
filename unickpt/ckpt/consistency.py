"""Checks that the parts of a checkpoint agree with each other, not only with the schema.

The schema says each field is well formed; these say the index tells one story:

- no two slices name the same stored key (``check_unique_slices``): a duplicated row would be
  loaded twice, and merge and diff would call it fine;
- in a gathered checkpoint, ``weight_map`` (what Hugging Face loaders read) names exactly the
  tensors of the unickpt block (what unickpt verifies), each in the file that stores it whole
  under its own name; in a sliced one, every entry points at the sentinel
  (``check_weight_map``, ``check_gathered``);
- every key in a data file is referenced by a slice (``check_keys_referenced``): a key nothing
  references is a tensor Hugging Face loaders would read and unickpt never verified;
- optimizer tensors are named ``state.<param>.<state>`` after their ``param`` and ``state``.

Each failure is an ``IndexFileError`` naming the file, the tensor and what disagrees. These
run on every open (index-only checks) or with the headers (``check_keys_referenced``), so
``load_model`` refuses such an index before it copies anything, and ``verify`` reports it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from unickpt.ckpt.safetensors_io import SafetensorsHeader
from unickpt.errors import IndexFileError
from unickpt.spec.index import TensorEntry, UnickptBlock
from unickpt.spec.naming import SLICED_SENTINEL

__all__ = [
    "check_unique_slices",
    "check_weight_map",
    "check_gathered",
    "check_optimizer_names",
    "check_param_groups",
    "check_keys_referenced",
    "check_block",
]


def _q(v: object) -> str:
    """A name or value as it appears in a message: repr, cut to 80 characters (names can be any length)."""
    r = repr(v)
    return r if len(r) <= 80 else f"{r[:77]}..."


def _names(names: Iterable[str], limit: int = 5) -> str:
    items = sorted(names)
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(repr(n) for n in items[:limit]) + more


def check_unique_slices(where: str, block: UnickptBlock) -> None:
    """No two slices (of one tensor or of two) name the same key of the same file.

    Keys by the ``NAME@K`` rule (compact tensors without ``keys``) are distinct by
    construction (the name and K follow from the key: K is the digits after the last ``@``), so
    only written-out keys are collected, per file, in bulk from the slice tables; a written key
    that has the rule's form is then looked up among the rule's keys of its file.
    """
    tables = [t.table for t in block.tensors.values()]
    if not any(table.ruled_keys for table in tables):  # keys distinct across files: pairs distinct too
        everywhere: set[str] = set()
        for table in tables:
            everywhere.update(table.keys())
        if len(everywhere) == sum(map(len, tables)):
            return
    per_file: dict[str, set[str]] = {}
    ruled: dict[str, TensorEntry] = {}
    dup = False
    for name, t in block.tensors.items():
        table = t.table
        if table.ruled_keys:
            ruled[name] = t
            continue
        files = table.distinct_files()
        keys_of = table.keys()
        if len(files) == 1:
            keys = per_file.setdefault(files[0], set())
            before = len(keys)
            keys.update(keys_of)
            dup = dup or len(keys) - before != len(keys_of)
        else:
            for file, key in zip(table.file_list(), keys_of, strict=True):
                keys = per_file.setdefault(file, set())
                dup = dup or key in keys
                keys.add(key)
    if ruled and not dup:
        dup = any(_ruled_key_in(ruled, file, key) for file, keys in per_file.items() for key in keys)
    if not dup:
        return
    seen: dict[tuple[str, str], tuple[str, int]] = {}
    for name, t in block.tensors.items():
        table = t.table
        for i, (file, key) in enumerate(zip(table.file_list(), table.keys(), strict=True)):
            first = seen.setdefault((file, key), (name, i))
            if first != (name, i):
                raise IndexFileError(
                    f"{where}: key {_q(key)} of file {_q(file)} is named by two slices: tensor {_q(first[0])} "
                    f"slice {first[1]} and tensor {_q(name)} slice {i} (one stored block would be read twice)"
                )


def _ruled_key_in(ruled: dict[str, TensorEntry], file: str, key: str) -> bool:
    """Whether ``key`` is the ``NAME@K`` key of slice K of a tensor in ``ruled``, stored in ``file``."""
    base, at, k = key.rpartition("@")
    t = ruled.get(base)
    if t is None or not (at and k.isascii() and k.isdigit()):
        return False
    i = int(k)
    table = t.table
    return k == str(i) and i < len(table) and table.file(i) == file


def check_gathered(where: str, block: UnickptBlock) -> None:
    """In a gathered checkpoint every tensor is stored whole, under its own name, in one slice."""
    for name, t in block.tensors.items():
        table = t.table  # its one slice read from the table's columns: no per-slice object
        if len(table) != 1:
            raise IndexFileError(
                f"{where}: tensor {_q(name)} has {len(table)} slices in a gathered checkpoint, which stores "
                "each tensor whole under its own name"
            )
        key = table.key(0)
        offsets, shape = table.box(0)
        if key != name or any(offsets) or shape != list(t.shape):
            raise IndexFileError(
                f"{where}: tensor {_q(name)} is stored as key {_q(key)} at offsets {offsets} with shape "
                f"{shape} in a gathered checkpoint, which stores each tensor whole under its own name "
                f"(shape {list(t.shape)}): Hugging Face loaders would read something else"
            )


def check_weight_map(where: str, weight_map: dict[str, str], block: UnickptBlock) -> bool:
    """``weight_map`` and the unickpt block describe the same checkpoint. Returns True if gathered.

    A gathered index maps every stored tensor to the file holding it (so Hugging Face loaders
    read exactly what unickpt verifies); a sliced one maps every stored tensor to the sentinel.
    """
    sentinel = [n for n, f in weight_map.items() if f == SLICED_SENTINEL]
    real = [n for n, f in weight_map.items() if f != SLICED_SENTINEL]
    if sentinel and real:
        raise IndexFileError(
            f"{where}: weight_map mixes the sliced-checkpoint sentinel (e.g. tensor {_q(sentinel[0])}) with "
            f"real files (e.g. tensor {_q(real[0])} -> {_q(weight_map[real[0]])}); an index is either gathered "
            "or sliced"
        )
    gathered = not sentinel if weight_map else block.layout.gathered
    missing = [n for n in block.tensors if n not in weight_map]
    if missing:
        raise IndexFileError(
            f"{where}: tensor(s) {_names(missing)} are in the unickpt block but not in weight_map "
            "(Hugging Face loaders would not see them)"
        )
    extra = [n for n in weight_map if n not in block.tensors]
    if extra:
        raise IndexFileError(
            f"{where}: weight_map names {_names(extra)}, which the unickpt block does not hold "
            "(Hugging Face loaders would read tensors unickpt never verified)"
        )
    if gathered != block.layout.gathered:
        state = "gathered" if gathered else "sliced"
        raise IndexFileError(
            f"{where}: weight_map describes a {state} checkpoint but unickpt.layout.gathered is "
            f"{str(block.layout.gathered).lower()}"
        )
    if not gathered:
        return False
    check_gathered(where, block)
    for name, t in block.tensors.items():
        if weight_map[name] != t.table.file(0):
            raise IndexFileError(
                f"{where}: weight_map puts tensor {_q(name)} in {_q(weight_map[name])} but the unickpt block "
                f"stores it in {_q(t.table.file(0))} (Hugging Face loaders would read a tensor unickpt "
                "never verified)"
            )
    return True


def check_optimizer_names(where: str, block: UnickptBlock) -> None:
    """Optimizer tensors are named ``state.<param>.<state>``; model tensors carry neither field."""
    for name, t in block.tensors.items():
        if block.kind == "model":
            if t.param is not None or t.state is not None:
                raise IndexFileError(f"{where}: model tensor {_q(name)} carries optimizer fields param/state")
            continue
        if t.param is None or t.state is None:
            continue  # an optimizer tensor outside the per-parameter state (none today)
        if name != f"state.{t.param}.{t.state}":
            raise IndexFileError(
                f"{where}: optimizer tensor {_q(name)} says it is state {_q(t.state)} of parameter {_q(t.param)}, "
                f"which is named 'state.{t.param}.{t.state}'"
            )
    if block.kind == "optimizer" and block.param_groups is not None:
        check_param_groups(where, block)


def check_param_groups(where: str, block: UnickptBlock) -> None:
    """Every parameter is listed once in ``param_groups``, and all state belongs to a listed one."""
    listed: dict[str, int] = {}
    for i, g in enumerate(block.param_groups or []):
        params = g.get("params")
        if not isinstance(params, list) or not all(isinstance(p, str) for p in params):
            raise IndexFileError(
                f"{where}: param_groups[{i}].params must be a list of parameter names (FQNs), "
                f"found {type(params).__name__}"
            )
        for p in params:
            if p in listed:
                raise IndexFileError(
                    f"{where}: parameter {_q(p)} is listed in param_groups[{listed[p]}] and param_groups[{i}]"
                )
            listed[p] = i
    for name, t in block.tensors.items():
        if t.param is not None and t.param not in listed:
            raise IndexFileError(
                f"{where}: optimizer tensor {_q(name)} is state of parameter {_q(t.param)}, which no param_group lists"
            )
    for p in block.param_state:
        if p not in listed:
            raise IndexFileError(
                f"{where}: param_state holds state of parameter {_q(p)}, which no param_group lists"
            )


def check_block(where: str, block: UnickptBlock, weight_map: dict[str, str] | None) -> None:
    """The index-only checks: unique slices, weight_map vs block (or whole tensors in a single
    file, ``weight_map=None``), optimizer names."""
    check_unique_slices(where, block)
    if weight_map is None:
        check_gathered(where, block)
    else:
        check_weight_map(where, weight_map, block)
    check_optimizer_names(where, block)


def check_keys_referenced(
    block: UnickptBlock, files: Iterable[str], header: Callable[[str], SafetensorsHeader]
) -> None:
    """Every key of each data file in ``files`` is a slice of the index (``header`` reads one).

    Only the slices stored in ``files`` are collected (a tensor's table says which by file id),
    so a rank that reads a few files costs O(their keys) plus O(tensors).
    """
    files = list(files)
    wanted = set(files)
    refs: dict[str, set[str]] = {f: set() for f in files}
    for name, t in block.tensors.items():
        table = t.table
        ids = [i for i, f in enumerate(table.files) if f in wanted]
        if not ids:
            continue
        fids = table.file_ids
        ks = np.arange(len(table)) if len(ids) == len(table.files) else np.flatnonzero(np.isin(fids, ids))
        names = list(map(table.files.__getitem__, fids[ks].tolist()))
        keys = (
            [f"{name}@{k}" for k in ks.tolist()] if table.ruled_keys else [table.key(k) for k in ks.tolist()]
        )
        for file, key in zip(names, keys, strict=True):
            refs[file].add(key)

    for file in files:
        h = header(file)
        known = refs[file]
        extra = [] if known.issuperset(h.entries) else [k for k in h.entries if k not in known]
        if extra:
            raise IndexFileError(
                f"{h.path}: holds {len(extra)} key(s) that no slice of the index references: {_names(extra)} "
                "(data the checkpoint does not account for: Hugging Face loaders may read it, unickpt never "
                "verifies it)"
            )
