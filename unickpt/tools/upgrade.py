"""``unickpt upgrade``: convert a checkpoint of a draft format version (1 to 4) to version 5.

unickpt reads and writes format version 5 only (docs/format.md section 7); this module is the
one place that still knows the drafts. The data files of every version are the same safetensors
files (keys, format tags, save ids), so an upgrade keeps them and writes a new index:

- the compact slice encoding (section 3.1) and the ``files`` table, built from the listed
  ``slices`` of versions 1 and 2 (a tensor with byte-range hashes stays listed, as every writer
  writes it);
- the short sentinel in a sliced ``weight_map`` (versions 1 to 3 named a longer one);
- the digests in base64url and the default dtype (section 3.2): the hex digits of versions 1 to
  4 are the same values;
- fingerprint v2 for version 1, whose indexes carry the linear fingerprint v1 (section 5.2.2):
  every slice of a version 1 checkpoint is read once, checked against its recorded ``xxh3`` and
  the tensor against its recorded v1 fingerprint (numpy, below: the only code left that computes
  v1), and the v2 fingerprint computed from the same bytes. A checkpoint whose data does not
  match its index is refused (``IntegrityError``), never given fingerprints of damaged data.

Versions 2 to 4 carry v2 fingerprints already; their upgrade reads only the data files' headers
(which must match the index, as for any reader). Every candidate index is validated by the
version 5 reader itself (``parse_index``, ``check_block``) before anything is written.

Atomicity: in place, under the directory's save lock, the new index is written under a staging
name, fsynced and renamed over the old one (``store.publish.atomic_write_bytes``), so an upgrade
killed at any instant leaves the old index (which ``upgrade`` reads again) or the new one. A
single-file checkpoint carries its block in its header: the file is copied under a staging name
with the new header and committed by ``commit_single_file``. With ``DST`` the checkpoint is
copied into a staging directory, the new indexes written last, and the directory renamed to
``DST`` (``publish_directory``, as ``merge`` and ``convert`` do): ``DST`` appears whole or not
at all, and the source is never written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import shutil
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from unickpt.ckpt.reader import (
    UNICKPT_METADATA_KEY,
    CheckpointReader,
    block_from_header,
    check_block,
    single_file_name,
)
from unickpt.ckpt.safetensors_io import read_header
from unickpt.ckpt.writer import build_block
from unickpt.errors import (
    ConfigError,
    IncompleteCheckpointError,
    IndexFileError,
    IntegrityError,
    IntegrityFailure,
    OutputExistsError,
)
from unickpt.spec.boxes import flat_range_to_boxes
from unickpt.spec.dtypes import itemsize
from unickpt.spec.hashing import combine_partials, finalize_fingerprint, fingerprint_partial
from unickpt.spec.index import (
    FORMAT_VERSION,
    MAX_INDEX_BYTES,
    IndexFile,
    hex_to_b64,
    index_to_json,
    parse_index,
)
from unickpt.spec.naming import SLICED_SENTINEL, index_name, shown, single_name
from unickpt.spec.untrusted import read_bounded, strict_loads
from unickpt.store.lock import directory_lock
from unickpt.store.publish import (
    atomic_write_bytes,
    commit_single_file,
    fsync_dir,
    makedirs_durable,
    publish_directory,
    temp_name,
)
from unickpt.store.storage import open_storage
from unickpt.tools.verify import FingerprintFailure

__all__ = ["UpgradeReport", "upgrade_checkpoint", "LONG_SLICED_SENTINEL", "v1_partial", "v1_finalize"]

#: The sentinel a sliced ``weight_map`` of versions 1 to 3 names (version 4 shortened it).
LONG_SLICED_SENTINEL = "unickpt-sliced-checkpoint--run-unickpt-merge-to-load-with-huggingface.safetensors"
_DRAFTS = (1, 2, 3, 4)
_KINDS = ("model", "optimizer")
_HEX16 = re.compile("[0-9a-f]{16}")
_HEXES = re.compile("(?:[0-9a-f]{16}|-{16})*")
_CHUNK = 16 << 20
_COPY = 8 << 20


@dataclass
class UpgradeReport:
    """What :func:`upgrade_checkpoint` did: ``upgraded`` (path, version found) per checkpoint
    converted, ``current`` the checkpoints already at version 5, ``output`` where they now are."""

    source: str
    output: str
    upgraded: list[tuple[str, int]] = field(default_factory=list)
    current: list[str] = field(default_factory=list)

    def format(self) -> str:
        lines = [f"{p}: format_version {v} -> {FORMAT_VERSION}" for p, v in self.upgraded]
        lines += [f"{p}: already format_version {FORMAT_VERSION}" for p in self.current]
        if self.output != self.source:
            lines.append(f"written to {self.output}")
        return "\n".join(lines)


def upgrade_checkpoint(
    src: str | os.PathLike[str], dst: str | os.PathLike[str] | None = None, *, fsync: bool = True
) -> UpgradeReport:
    """Convert the checkpoint(s) at ``src`` to format version 5, in place or into ``dst``.

    ``src`` is a checkpoint directory (its model and optimizer checkpoints, index or single
    file, are upgraded), an index file, or a single ``.safetensors`` file. ``dst`` (optional) is
    a new directory for a directory source (absent, or empty but for leftovers) or a new file
    for a file source; it gets the whole source, data files copied, source untouched.
    """
    source = os.fspath(src)
    given = [source] if dst is None else [source, os.fspath(dst)]
    if any(open_storage(p)[0].local_path(p) is None for p in given):  # no OS path: an object store
        raise ConfigError(
            f"{source}: unickpt upgrade works on local paths; copy the checkpoint to a local "
            "directory (or mount the store), upgrade it there and copy it back"
        )
    if os.path.isdir(source):
        return _upgrade_directory(source, None if dst is None else os.fspath(dst), fsync)
    if not os.path.exists(source):
        raise IncompleteCheckpointError(f"{source}: no such file or directory")
    if source.endswith(".index.json"):
        if dst is not None:
            raise ConfigError(f"{source}: to write a copy, give the checkpoint's directory as SRC")
        return _upgrade_directory(os.path.dirname(source) or ".", None, fsync, only=[source])
    return _upgrade_single_path(source, None if dst is None else os.fspath(dst), fsync)


# ------------------------------------------------------------------ directories
def _checkpoints(directory: str) -> list[tuple[str, str, bool]]:
    """(kind, path, is an index) of each committed checkpoint in ``directory``."""
    found = []
    for kind in _KINDS:
        idx = os.path.join(directory, index_name(kind))
        single = os.path.join(directory, single_name(kind))
        if os.path.isfile(idx):
            found.append((kind, idx, True))
        elif os.path.isfile(single):
            found.append((kind, single, False))
    if not found:
        raise IncompleteCheckpointError(
            f"{directory}: no checkpoint to upgrade (no {index_name('model')}, "
            f"{index_name('optimizer')}, {single_name('model')} or {single_name('optimizer')})"
        )
    return found


def _upgrade_directory(
    directory: str, dst: str | None, fsync: bool, only: Sequence[str] | None = None
) -> UpgradeReport:
    if dst is None:
        report = UpgradeReport(directory, directory)
        with directory_lock(directory):
            for kind, path, is_index in _checkpoints(directory):
                if only is not None and path not in only:
                    continue
                if is_index:
                    new = _new_index(path, kind)
                    if new is not None:
                        atomic_write_bytes(path, new[0])
                else:
                    new = _new_single(path, kind, path, fsync)
                _record(report, path, new)
        return report
    if os.path.exists(dst) and not os.path.isdir(dst):
        raise OutputExistsError(f"{dst}: exists and is not a directory; give a new directory")
    report = UpgradeReport(directory, dst)
    parent = os.path.dirname(os.path.abspath(dst))
    makedirs_durable(parent, fsync=fsync)
    staged = temp_name(os.path.abspath(dst))
    try:
        with directory_lock(directory):  # no save replaces the source while it is copied
            found = _checkpoints(directory)
            indexes = {os.path.basename(p) for _, p, is_index in found if is_index}
            os.mkdir(staged)
            _copy_tree(directory, staged, skip=indexes, fsync=fsync)
            for kind, path, is_index in found:
                name = os.path.basename(path)
                target = os.path.join(staged, name)
                if is_index:
                    new = _new_index(path, kind)
                    data = new[0] if new is not None else read_bounded(path, MAX_INDEX_BYTES)
                    with open(target, "wb") as f:  # the indexes last: the data files are in place
                        f.write(data)
                        if fsync:
                            os.fsync(f.fileno())
                else:
                    os.unlink(target)  # copied above; written again with its new header
                    new = _new_single(path, kind, target, fsync, commit=False)
                    if new is None:
                        _copy_file(path, target, fsync)
                _record(report, os.path.join(dst, name), new)
        try:
            publish_directory(staged, dst, fsync=fsync)
        except FileExistsError:
            raise OutputExistsError(
                f"{dst}: output directory is not empty; unickpt upgrade never replaces anything"
            ) from None
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return report


def _record(report: UpgradeReport, path: str, new: tuple[Any, int] | None) -> None:
    if new is None:
        report.current.append(path)
    else:
        report.upgraded.append((path, new[1]))


def _copy_tree(src: str, dst: str, *, skip: set[str], fsync: bool) -> None:
    """Every entry of ``src`` but hidden ones (locks, staging files) and ``skip``, into ``dst``."""
    for entry in sorted(os.listdir(src)):
        if entry.startswith(".") or entry in skip:
            continue
        p = os.path.join(src, entry)
        if os.path.isdir(p):
            os.mkdir(os.path.join(dst, entry))
            _copy_tree(p, os.path.join(dst, entry), skip=set(), fsync=fsync)
        elif os.path.isfile(p):
            _copy_file(p, os.path.join(dst, entry), fsync)
    if fsync:
        fsync_dir(dst)


def _copy_file(src: str, dst: str, fsync: bool) -> None:
    with open(src, "rb") as fi, open(dst, "xb") as fo:
        shutil.copyfileobj(fi, fo, _COPY)
        if fsync:
            fo.flush()
            os.fsync(fo.fileno())


# ------------------------------------------------------------------ the index
def _load_json(path: str) -> dict[str, Any]:
    try:
        raw = read_bounded(path, MAX_INDEX_BYTES)
    except OSError as e:
        raise IndexFileError(f"{path}: cannot read the index ({e})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise IndexFileError(f"{path}: index is not valid UTF-8 ({e})") from None
    obj = strict_loads(text, IndexFileError, f"{path}: index")
    if type(obj) is not dict:
        raise IndexFileError(f"{path}: index must be a JSON object with a 'weight_map'")
    return obj


def _version_of(where: str, block: Any) -> int:
    if type(block) is not dict:
        raise IndexFileError(
            f"{where}: holds no unickpt block (a plain Hugging Face checkpoint): unickpt reads it "
            "as it is, there is nothing to upgrade"
        )
    # Readers of the drafts read a block without a version in the hex text form of 1 to 4.
    v = block.get("format_version", 4)
    if type(v) is not int or v not in (*_DRAFTS, FORMAT_VERSION):
        raise IndexFileError(
            f"{where}: format_version {shown(v)}: unickpt upgrade converts versions "
            f"{', '.join(map(str, _DRAFTS))} to {FORMAT_VERSION}"
        )
    return v


def _block_as_v5(where: str, block: dict[str, Any], version: int) -> dict[str, Any]:
    """A draft block (JSON) in version 5's text form; version 1's fingerprints dropped (the
    caller recomputes them). Everything else is validated by the version 5 reader after."""
    if "dtype" in block:
        raise IndexFileError(f"{where}: 'dtype' in a format_version {version} block (a version 5 field)")
    out = dict(block)
    out["format_version"] = FORMAT_VERSION
    tensors = block.get("tensors")
    if type(tensors) is not dict:
        return out  # the reader names what is wrong
    new: dict[str, Any] = {}
    for name, t in tensors.items():
        if type(t) is not dict:
            new[name] = t
            continue
        t = dict(t)
        fp = t.get("fingerprint")
        if version == 1:
            t.pop("fingerprint", None)
        elif fp is not None:
            if type(fp) is not str or not _HEX16.fullmatch(fp):
                raise IndexFileError(
                    f"{where}: tensor {shown(name)}: fingerprint {shown(fp)} is not 16 hex digits (version {version})"
                )
            t["fingerprint"] = hex_to_b64(fp)
        xxh = t.get("xxh3")
        if "slices" not in t and xxh is not None:  # compact (versions 3, 4): hex per slice
            if type(xxh) is not str or not _HEXES.fullmatch(xxh):
                raise IndexFileError(
                    f"{where}: tensor {shown(name)}: 'xxh3' is not 16 hex digits (or 16 '-') per slice"
                )
            t["xxh3"] = hex_to_b64(xxh)
        new[name] = t
    out["tensors"] = new
    return out


def _new_index(path: str, kind: str) -> tuple[Any, int] | None:
    """(the version 5 index, the version found) of the index at ``path``; None when current."""
    obj = _load_json(path)
    version = _version_of(path, obj.get("unickpt"))
    if version == FORMAT_VERSION:
        return None
    block = obj["unickpt"]
    recorded = _v1_fingerprints(block) if version == 1 else {}
    obj = dict(obj)
    obj["unickpt"] = _block_as_v5(path, block, version)
    wm = obj.get("weight_map")
    if type(wm) is dict:
        obj["weight_map"] = {k: SLICED_SENTINEL if f == LONG_SLICED_SENTINEL else f for k, f in wm.items()}
    raw = json.dumps(obj, ensure_ascii=False).encode("utf-8")
    idx = parse_index(raw, path)
    if idx.unickpt is None or idx.unickpt.kind != kind:
        found = None if idx.unickpt is None else idx.unickpt.kind
        raise IndexFileError(f"{path}: holds a checkpoint of kind {shown(found)}, expected {shown(kind)}")
    check_block(path, idx.unickpt, idx.weight_map)
    directory = os.path.dirname(path) or "."
    with CheckpointReader(directory, kind, idx.unickpt, path, True, idx) as r:
        fps = _refingerprint(r, recorded, path) if version == 1 else {}
        r.validate_structure()  # every data file's header against the index
    block5 = _compacted(idx.unickpt, fps)
    out = IndexFile.model_validate({**idx.model_dump(exclude={"unickpt"}), "unickpt": block5})
    data = index_to_json(out)
    parse_index(data, path)  # what is written reads back
    return data, version


def _compacted(block: Any, fps: dict[str, str]) -> Any:
    """``block`` with every tensor's slices compact (as a save writes them) and ``fps`` set."""
    tensors = dict(block.tensors)
    for name, fp in fps.items():
        tensors[name] = tensors[name].model_copy(update={"fingerprint": fp})
    extras = {"param_groups": block.param_groups, "param_state": dict(block.param_state)}
    return build_block(
        kind=block.kind,
        created_by=block.created_by,
        layout=block.layout,
        tensors=tensors,
        aliases=block.aliases,
        save_id=block.save_id,
        **extras,
    )


# ------------------------------------------------------------------ single files
def _upgrade_single_path(path: str, dst: str | None, fsync: bool) -> UpgradeReport:
    h = read_header(path)
    kind = _single_kind(path, h.metadata)
    directory = os.path.dirname(os.path.abspath(path))
    if dst is None:
        report = UpgradeReport(path, path)
        with directory_lock(directory):
            _record(report, path, _new_single(path, kind, path, fsync))
        return report
    if os.path.lexists(dst):
        raise OutputExistsError(f"{dst}: exists; unickpt upgrade never replaces anything")
    report = UpgradeReport(path, dst)
    makedirs_durable(os.path.dirname(os.path.abspath(dst)), fsync=fsync)
    staged = temp_name(os.path.abspath(dst))
    try:
        with directory_lock(directory):
            new = _new_single(path, kind, staged, fsync, commit=False)
            if new is None:
                _copy_file(path, staged, fsync)
        try:
            os.link(staged, dst)  # never over a file that appeared meanwhile
        except FileExistsError:
            raise OutputExistsError(f"{dst}: exists; unickpt upgrade never replaces anything") from None
        if fsync:
            fsync_dir(os.path.dirname(os.path.abspath(dst)))
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staged)
    _record(report, dst, new)
    return report


def _single_kind(path: str, metadata: dict[str, str]) -> str:
    raw = metadata.get(UNICKPT_METADATA_KEY)
    if raw is None:
        raise IndexFileError(
            f"{path}: holds no unickpt block (a plain safetensors file): unickpt reads it as it is, "
            "there is nothing to upgrade"
        )
    obj = strict_loads(raw, IndexFileError, f"{path}: the unickpt metadata block")
    kind = obj.get("kind") if type(obj) is dict else None
    if kind not in _KINDS:
        raise IndexFileError(
            f"{path}: the unickpt metadata block has kind {shown(kind)}, not one of {_KINDS}"
        )
    return str(kind)


def _new_single(
    path: str, kind: str, target: str, fsync: bool, *, commit: bool = True
) -> tuple[Any, int] | None:
    """Write the single file ``path`` with a version 5 block to ``target`` (staged and committed
    over ``path`` when ``target`` is ``path``); None, writing nothing, when already current."""
    h = read_header(path)
    block = strict_loads(
        h.metadata[UNICKPT_METADATA_KEY], IndexFileError, f"{path}: the unickpt metadata block"
    )
    version = _version_of(path, block)
    if version == FORMAT_VERSION:
        return None
    recorded = _v1_fingerprints(block) if version == 1 else {}
    meta5 = {**h.metadata, UNICKPT_METADATA_KEY: json.dumps(_block_as_v5(path, block, version))}
    block5, _ = block_from_header(dataclasses.replace(h, metadata=meta5), kind)
    check_block(path, block5, None)
    with CheckpointReader(
        os.path.dirname(os.path.abspath(path)),
        kind,
        block5,
        None,
        True,
        single_file=os.path.abspath(path),
        single_slice_file=single_file_name(path, kind),
    ) as r:
        fps = _refingerprint(r, recorded, path) if version == 1 else {}
        r.validate_structure()
    final = _compacted(block5, fps).model_dump(mode="json", exclude_none=True)
    meta = {**h.metadata, UNICKPT_METADATA_KEY: json.dumps(final)}
    staged = temp_name(os.path.abspath(target)) if commit else target
    try:
        _write_with_metadata(path, h.data_start, meta, staged, fsync)
        # what is written reads back as a version 5 single file of the same kind
        block_from_header(read_header(staged), kind)
        if commit:
            commit_single_file(target, staged, kind, fsync=fsync)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staged)
        raise
    return None, version


def _write_with_metadata(path: str, data_start: int, meta: dict[str, str], out: str, fsync: bool) -> None:
    """``path`` copied to ``out`` with its header metadata replaced: the tensor entries and the
    data section stay byte for byte (entries' offsets are relative to the data section)."""
    with open(path, "rb") as fi:
        first = fi.read(data_start)
        (n,) = struct.unpack("<Q", first[:8])
        header = json.loads(first[8 : 8 + n])
        header["__metadata__"] = meta
        raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        raw += b" " * (-(8 + len(raw)) % 8)
        with open(out, "xb") as fo:
            fo.write(struct.pack("<Q", len(raw)) + raw)
            shutil.copyfileobj(fi, fo, _COPY)
            if fsync:
                fo.flush()
                os.fsync(fo.fileno())


# ------------------------------------------------------------------ version 1 fingerprints
def _v1_fingerprints(block: Any) -> dict[str, str]:
    tensors = block.get("tensors") if type(block) is dict else None
    out = {}
    for name, t in (tensors if type(tensors) is dict else {}).items():
        fp = t.get("fingerprint") if type(t) is dict else None
        if fp is not None:
            if type(fp) is not str or not _HEX16.fullmatch(fp):
                raise IndexFileError(
                    f"tensor {shown(name)}: fingerprint {shown(fp)} is not 16 hex digits (version 1)"
                )
            out[name] = fp
    return out


def _refingerprint(r: CheckpointReader, recorded: dict[str, str], where: str) -> dict[str, str]:
    """Fingerprint v2 of every tensor that records a v1 one, from its data, each slice read once:
    its ``xxh3`` checked, and the tensor's v1 fingerprint. Raises ``IntegrityError`` on a mismatch."""
    out: dict[str, str] = {}
    failures: list[IntegrityFailure] = []
    for name, v1 in recorded.items():
        t = r.tensors[name]
        isz = itemsize(t.dtype)
        p1 = 0
        p2: list[int] = []
        files = set()
        for s in t.slices:
            files.add(s.file)
            h = xxhash.xxh3_64()
            start = 0
            for chunk in r.iter_key(s.file, s.key, _CHUNK - _CHUNK % isz):
                h.update(chunk)
                words = np.frombuffer(chunk, dtype=f"<u{isz}")
                for (off, shp), flat in _boxes(s.shape, start, start + len(words)):
                    glob = [a + b for a, b in zip(s.offsets, off, strict=True)]
                    w = words[flat - start : flat - start + math.prod(shp)]
                    p1 = (p1 + v1_partial(w, t.shape, glob, shp)) & _MASK
                    p2.append(fingerprint_partial(w, t.shape, glob, shp))
                start += len(words)
            if s.xxh3 is not None and h.hexdigest() != s.xxh3:
                failures.append(IntegrityFailure(name, s.file, s.key, s.xxh3, h.hexdigest()))
        got = v1_finalize(name, t.dtype, t.shape, p1)
        if got != v1:
            failures.append(FingerprintFailure(name, ", ".join(sorted(files)), "", v1, got))
        out[name] = finalize_fingerprint(name, t.dtype, t.shape, combine_partials(p2))
    if failures:
        raise IntegrityError(failures, where)
    return out


def _boxes(shape: Sequence[int], start: int, stop: int) -> Iterator[tuple[tuple[list[int], list[int]], int]]:
    if not shape:  # a 0-dim tensor is one element
        if stop > start:
            yield ([], []), 0
        return
    for (off, shp), flat in flat_range_to_boxes(shape, start, stop):
        yield (list(off), list(shp)), flat


# Fingerprint v1 (docs/format.md 5.2.3, until version 5): the linear form mod 2^64
#   S = sum of a_r * b_c * w[r, c],  a_r = mix64(r) | 1,  b_c = mix64(c ^ 0xD1B54A32D192ED03) | 1
# over the raw element bits, checked here once before it is replaced by v2.
_MASK = (1 << 64) - 1
_COL_KEY = np.uint64(0xD1B54A32D192ED03)
_BLOCK_ELEMS = 1 << 18


def _mix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer, elementwise on uint64 (wrapping)."""
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def v1_partial(
    words: np.ndarray, global_shape: Sequence[int], offsets: Sequence[int], shape: Sequence[int]
) -> int:
    """The v1 partial value (mod 2^64) of one box of the global tensor, ``words`` its elements as
    unsigned integers of the dtype's item size, in C order."""
    if math.prod(shape) == 0:
        return 0
    if len(global_shape) == 0:
        global_shape, offsets, shape = (1,), (0,), (1,)
    rows = np.zeros(1, dtype=np.uint64)
    strides, stride = [], 1
    for d in reversed(global_shape[:-1]):
        strides.append(stride)
        stride *= d
    strides.reverse()
    for o, s, st in zip(offsets[:-1], shape[:-1], strides, strict=True):
        rows = np.add.outer(rows, np.arange(o, o + s, dtype=np.uint64) * np.uint64(st)).reshape(-1)
    cols = shape[-1]
    w2 = np.ascontiguousarray(words).reshape(-1, cols)
    a = _mix64(rows) | np.uint64(1)
    b = _mix64(np.arange(offsets[-1], offsets[-1] + cols, dtype=np.uint64) ^ _COL_KEY) | np.uint64(1)
    total = 0
    step = max(1, _BLOCK_ELEMS // max(cols, 1))
    with np.errstate(over="ignore"):
        for r0 in range(0, w2.shape[0], step):
            inner = np.einsum("ij,j->i", w2[r0 : r0 + step], b, dtype=np.uint64, casting="unsafe")
            inner *= a[r0 : r0 + step]
            total = (total + int(inner.sum(dtype=np.uint64))) & _MASK
    return total


def v1_finalize(name: str, dtype: str, shape: Sequence[int], total: int) -> str:
    """A version 1 fingerprint from the sum of a whole tensor's partials (docs/format.md 5.2.3)."""
    h = xxhash.xxh3_64()
    h.update(name.encode("utf-8") + b"\0" + dtype.encode("ascii") + b"\0")
    h.update(",".join(str(int(d)) for d in shape).encode("ascii") + b"\0")
    h.update(int(total & _MASK).to_bytes(8, "little"))
    return h.hexdigest()
