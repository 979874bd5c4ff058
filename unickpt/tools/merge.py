"""``unickpt merge``: rebuild full tensors from stored slices into a plain Hugging Face checkpoint.

Pure file IO plus numpy on raw bytes: no torch.distributed, no launcher, no GPU (torch is
imported only for ``dtype=`` casts). Each tensor is rebuilt from the shard info in the index:

- when every slice of a tensor is one contiguous run of the flattened tensor (row blocks
  of FSDP/TP ``Shard(0)``, ZeRO flat ranges, whole tensors), its bytes are copied straight
  from the source files to their place in the output file, in chunks, hashing each chunk
  on the way (``copy_file_range`` when nothing needs hashing); memory stays constant;
- otherwise (column splits, 2-D meshes) the tensor is assembled in one numpy buffer of its
  size, then written; peak memory is about the largest such tensor.

Output files are written front to back and the kernel is asked to start writing them back
every ``_WRITEBACK`` bytes (``sync_file_range``, a hint), so disk writes overlap the reads of
the following tensors instead of all waiting for the final fsync; every file and directory
is still fsynced before the commit.

Slices are checked against their recorded xxh3-64 while they are read (``verify=False``
skips it), coverage of every tensor is checked before anything is written (in O(slices) for
layouts of contiguous runs, with the reader's general check for the rest), and the output
carries the fingerprints (unchanged unless cast) and hashes of every tensor, in the index
(or the single file's header metadata), so ``unickpt diff`` still matches the source. The
output is written to a hidden temporary directory and renamed to ``out`` at the end.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from unickpt import __version__
from unickpt._logging import get_logger
from unickpt.errors import IndexFileError, IntegrityError, IntegrityFailure, UnsupportedError
from unickpt.format.boxes import contiguous_start, coverage_problem
from unickpt.format.commit import SAVE_ID_KEY, Writeback, atomic_write_bytes, content_save_id
from unickpt.format.consistency import check_keys_referenced
from unickpt.format.dtypes import itemsize, word_dtype
from unickpt.format.hashing import (
    SliceHasher,
    combine_partials,
    finalize_fingerprint,
    fingerprint_partial,
    fingerprint_version,
)
from unickpt.format.index import LayoutInfo, SliceEntry, TensorEntry, UnickptBlock, index_to_json
from unickpt.format.naming import index_name, shard_name, single_name
from unickpt.format.reader import UNICKPT_METADATA_KEY, CheckpointReader, open_checkpoint
from unickpt.format.safetensors_io import encode_header, read_header
from unickpt.format.writer import build_block, build_index, data_file_metadata, group_files, rewrite_header
from unickpt.tools._bands import bands, is_sparse, next_data, pieces
from unickpt.tools._common import check_output, copy_small_file, detect_kind, staged_output, write_all

__all__ = ["merge_checkpoint", "DTYPES"]

logger = get_logger(__name__)

# --dtype names -> safetensors dtype. Only floating-point tensors are cast (as transformers does).
DTYPES = {
    "bf16": "BF16",
    "fp16": "F16",
    "fp32": "F32",
    "bfloat16": "BF16",
    "float16": "F16",
    "float32": "F32",
}
_CASTABLE = {"F16", "BF16", "F32", "F64"}
# Copy in chunks of this size: large enough for disk speed (the kernel reads ahead of it anyway),
# small enough to keep memory flat. 4 MiB measured as fast as 16 MiB for merges of 128 to 512 MiB.
_CHUNK = 4 << 20
# Start writeback of an output file every this many bytes written (the final fsync waits for less).
_WRITEBACK = 8 << 20
# Tensors rebuilt in memory (column splits, 2-D meshes, casts) are rebuilt a band of at most this
# many bytes at a time (``_bands``): peak memory is about two bands, whatever the tensor's size.
_BAND_BYTES = 16 << 20
_EMPTY_HASH = SliceHasher().hexdigest()
_PLACEHOLDER = "0" * 16
_PLACEHOLDER_ID = "0" * 32
_SIDE_FILES = ("config.json", "generation_config.json")


@dataclass(frozen=True)
class _Run:
    """One contiguous run of the flattened tensor stored as one slice."""

    slice: SliceEntry
    flat_start: int  # in elements


def _flat_runs(t: TensorEntry) -> list[_Run] | None:
    """The slices as contiguous runs in flat order, or None when some slice is not contiguous."""
    runs = []
    for s in t.slices:
        if math.prod(s.shape) == 0:
            continue
        start = contiguous_start(t.shape, s.offsets, s.shape)
        if start is None:
            return None
        runs.append(_Run(s, start))
    runs.sort(key=lambda r: r.flat_start)
    return runs


def _tiles(t: TensorEntry, runs: list[_Run] | None) -> bool:
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


def _validate(r: CheckpointReader) -> dict[str, list[_Run] | None]:
    """``r.validate_structure()`` with the same checks, order and errors; returns each tensor's
    flat runs (``_flat_runs``) for the copy.

    Coverage is shown in O(slices) for tensors whose slices are contiguous runs (``_tiles``);
    only the others go through ``coverage_problem``'s general sweep.
    """
    runs_of: dict[str, list[_Run] | None] = {}
    for name, t in r.block.tensors.items():
        nd = len(t.shape)
        same_dims = all(len(s.offsets) == nd and len(s.shape) == nd for s in t.slices)
        runs = _flat_runs(t) if same_dims else None
        runs_of[name] = runs
        if not _tiles(t, runs):
            problem = coverage_problem(t.shape, [(tuple(s.offsets), tuple(s.shape)) for s in t.slices])
            if problem:
                raise IndexFileError(f"{r.index_path or r.directory}: tensor {name!r}: {problem}")
    for name, t in r.block.tensors.items():
        for s in t.slices:
            r._check_slice(name, t, s)
    if r.has_unickpt_block:
        check_keys_referenced(r.block, r.files, r.header)
    return runs_of


class _Out(Writeback):
    """An output file being written front to back, with writeback started every ``_WRITEBACK``
    bytes so the final fsync does not wait for the whole file."""

    def __init__(self, fd: int) -> None:
        super().__init__(fd, _WRITEBACK)

    def write(self, data: memoryview, pos: int) -> None:
        write_all(self.fd, data, pos)
        self.wrote(pos + data.nbytes)


class _Merger:
    def __init__(
        self,
        reader: CheckpointReader,
        *,
        verify: bool,
        out_dtype: str | None,
        progress: Callable[[int], object],
        src: str,
        buf: memoryview,
        runs_of: dict[str, list[_Run] | None],
    ) -> None:
        self.r = reader
        self._runs_of = runs_of
        self.verify = verify
        self.out_dtype = out_dtype
        self.progress = progress
        self.src = src
        self._buf = buf
        self._sparse_files: dict[str, bool] = {}

    def target_dtype(self, t: TensorEntry) -> str:
        if self.out_dtype is not None and t.dtype in _CASTABLE:
            return self.out_dtype
        return t.dtype

    # -------------------------------------------------------------- checking
    def _check(self, name: str, s: SliceEntry, found: str) -> None:
        if self.verify and s.xxh3 is not None and found != s.xxh3:
            raise IntegrityError([IntegrityFailure(name, s.file, s.key, s.xxh3, found)], checkpoint=self.src)

    # -------------------------------------------------------------- planning
    def _route(self, name: str, t: TensorEntry) -> tuple[str, list[_Run]]:
        """How a tensor is written: "kernel" (copy_file_range of one stored slice), "stream"
        (contiguous runs read in pieces, hashed, written) or "assemble" (rebuilt in memory)."""
        runs = self._runs_of[name] if self.target_dtype(t) == t.dtype else None
        if runs is None:
            return "assemble", []
        # copy_file_range would write a sparse source's holes out as zeros: stream those.
        if (
            len(runs) == 1
            and runs[0].slice.xxh3 is not None
            and not self.verify
            and self.r.storage is None  # a source on a URL has no descriptor to copy from: stream
            and not self._sparse(runs[0].slice.file)
        ):
            return "kernel", runs
        return "stream", runs

    # -------------------------------------------------------------- writing
    def write_file(
        self, tensors: list[tuple[str, TensorEntry, int]], fd: int
    ) -> dict[str, tuple[str | None, str | None]]:
        """Write each (name, entry, position) into ``fd``, in order; return name -> (xxh3, fingerprint)."""
        out = _Out(fd)
        results: dict[str, tuple[str | None, str | None]] = {}
        for name, t, pos in tensors:
            how, runs = self._route(name, t)
            if how == "assemble":
                results[name] = self._assemble(name, t, self.target_dtype(t), out, pos)
                continue
            self._check_empty(name, t)
            if how == "kernel":
                results[name] = (self._copy_one(runs[0].slice, out, pos), t.fingerprint)
            else:
                results[name] = (self._stream_runs(name, t, runs, out, pos), t.fingerprint)
        return results

    def _check_empty(self, name: str, t: TensorEntry) -> None:
        # Empty slices hold no bytes but still carry a hash: check it.
        for s in t.slices:
            if math.prod(s.shape) == 0:
                self._check(name, s, _EMPTY_HASH)

    def _copy_one(self, s: SliceEntry, out: _Out, pos: int) -> str | None:
        """The output bytes are exactly the stored slice: copy in the kernel, its hash is the output's."""
        _, off, n = self.r.slice_location(s)
        self._copy_file_range(self.r._fd(s.file), off, out.fd, pos, n)
        out.wrote(pos + n)
        self.progress(n)
        return s.xxh3

    def _stream_runs(self, name: str, t: TensorEntry, runs: list[_Run], out: _Out, pos: int) -> str:
        isz = itemsize(t.dtype)
        out_hash = SliceHasher()
        for run in runs:
            s = run.slice
            n = math.prod(s.shape) * isz
            dst = pos + run.flat_start * isz
            h = None
            if self.verify and s.xxh3 is not None:
                # A tensor stored whole: the slice's bytes are the output's, one hash serves both.
                h = out_hash if len(runs) == 1 else SliceHasher()
            done = 0
            hole_end = self._hole_end(s, 0, n)
            while done < n:
                k = min(_CHUNK, n - done)
                if done + k <= hole_end:
                    # Inside a hole of a sparse source: zeros, neither read nor written.
                    chunk = self._zeros[:k]
                else:
                    chunk = self.r.read_bytes(s, done, k, self._buf[:k])
                    out.write(chunk, dst + done)
                if h is not None and h is not out_hash:
                    h.update(chunk)
                out_hash.update(chunk)
                done += k
                self.progress(k)
                if done >= hole_end:
                    hole_end = self._hole_end(s, done, n)
            if h is not None:
                self._check(name, s, h.hexdigest())
        return out_hash.hexdigest()

    def _hole_end(self, s: SliceEntry, rel: int, n: int, unit: int = _CHUNK) -> int:
        """Where the hole at ``rel`` bytes into slice ``s`` ends (``rel`` itself when ``rel`` holds
        data), as bytes into the slice, rounded down to whole ``unit``s; ``n`` when the hole runs
        to byte ``n``. Only sparse files are asked."""
        if not self._sparse(s.file):
            return rel
        _, off, _n = self.r.slice_location(s)
        data = next_data(self.r._fd(s.file), off + rel, off + n) - off
        return rel + (data - rel) // unit * unit if data < n else n

    @property
    def _zeros(self) -> memoryview:
        z = getattr(self, "_zero_chunk", None)
        if z is None:
            z = self._zero_chunk = memoryview(bytes(_CHUNK))
        return z

    @staticmethod
    def _copy_file_range(src_fd: int, src_off: int, dst_fd: int, dst_off: int, n: int) -> None:
        done = 0
        try:
            while done < n:
                k = os.copy_file_range(src_fd, dst_fd, n - done, src_off + done, dst_off + done)
                if k <= 0:
                    break
                done += k
        except OSError:
            pass  # cross-device or unsupported filesystem: fall back to read/write below
        while done < n:
            data = os.pread(src_fd, min(_CHUNK, n - done), src_off + done)
            if not data:
                raise OSError(f"source file truncated at byte {src_off + done}")
            write_all(dst_fd, memoryview(data), dst_off + done)
            done += len(data)

    def _sparse(self, file: str) -> bool:
        got = self._sparse_files.get(file)
        if got is None:
            got = self._sparse_files[file] = self.r.storage is None and is_sparse(self.r._fd(file))
        return got

    def _assemble(
        self, name: str, t: TensorEntry, out_dtype: str, out: _Out, pos: int
    ) -> tuple[str, str | None]:
        """Rebuild the tensor band by band (``_bands``): memory stays about two bands, whatever its size."""
        isz = itemsize(t.dtype)
        wdt = word_dtype(t.dtype)
        nd = len(t.shape)
        self._check_empty(name, t)
        live = [s for s in t.slices if math.prod(s.shape)]
        hashers = {i: SliceHasher() for i, s in enumerate(live) if self.verify and s.xxh3 is not None}
        done = [0] * len(live)
        sparse = any(self._sparse(s.file) for s in live)
        cast = out_dtype != t.dtype
        # The output keeps the source's format version, so its fingerprints use the same algorithm.
        version = fingerprint_version(self.r.block.format_version)
        partials: list[int] = []
        out_hash = SliceHasher()
        at = pos
        for band in bands(t.shape, isz, _BAND_BYTES):
            buf = np.empty(math.prod(band.shape) * isz, dtype=np.uint8)
            block = buf.view(wdt).reshape(band.shape or (1,))
            for i, s in enumerate(live):
                pc = pieces(band, s.offsets, s.shape)
                if pc is None:
                    continue
                if pc.first != done[i]:  # pragma: no cover - bands visit each slice in its own order
                    raise RuntimeError(f"internal: merge read {name!r} slice {s.key!r} out of order")
                if (
                    self._hole_end(s, pc.first * isz, (pc.first + pc.count) * isz, 1)
                    >= (pc.first + pc.count) * isz
                ):
                    tmp = np.zeros(pc.count * isz, dtype=np.uint8)  # a hole of a sparse source: not read
                else:
                    tmp = np.empty(pc.count * isz, dtype=np.uint8)
                    self.r.read_bytes(s, pc.first * isz, pc.count * isz, tmp.data)
                h = hashers.get(i)
                if h is not None:
                    h.update(tmp.data)
                done[i] += pc.count
                if h is not None and done[i] == math.prod(s.shape):
                    self._check(name, s, h.hexdigest())
                block[(slice(pc.lo, pc.hi), *pc.inner)] = tmp.view(wdt).reshape(
                    (pc.hi - pc.lo, *s.shape[band.dim + 1 :])
                )
                self.progress(pc.count * isz)
                del tmp
            if cast:
                offs, box = (band.offsets(nd), band.box_shape()) if nd else ([], [])
                buf = _cast(buf, t.dtype, out_dtype, box)
                partials.append(
                    fingerprint_partial(buf.view(word_dtype(out_dtype)), t.shape, offs, box, version=version)
                )
            out_hash.update(buf.data)
            if not (sparse and not buf.any()):  # a zero band of a sparse source stays a hole
                out.write(buf.data, at)
            at += buf.nbytes
        fingerprint = t.fingerprint
        if cast:
            fingerprint = finalize_fingerprint(
                name, out_dtype, t.shape, combine_partials(partials, version=version), version=version
            )
        return out_hash.hexdigest(), fingerprint


def _cast(buf: np.ndarray, src: str, dst: str, shape: list[int]) -> np.ndarray:
    from unickpt.tools._torch import from_bytes, tensor_bytes, torch_of

    return tensor_bytes(from_bytes(buf, src, shape).to(torch_of(dst)))


def _merge_one(
    reader: CheckpointReader,
    out_dir: str,
    *,
    max_shard_size: int | str,
    out_dtype: str | None,
    verify: bool,
    progress: Callable[[int], object],
    src: str,
    buf: memoryview,
    runs_of: dict[str, list[_Run] | None],
) -> None:
    kind = reader.kind
    block = reader.block
    m = _Merger(
        reader, verify=verify, out_dtype=out_dtype, progress=progress, src=src, buf=buf, runs_of=runs_of
    )
    target = {n: m.target_dtype(t) for n, t in block.tensors.items()}
    sizes = {n: math.prod(t.shape) * itemsize(target[n]) for n, t in block.tensors.items()}
    groups = group_files(sizes, max_shard_size)
    single = len(groups) == 1
    files = [(shard_name(kind, j + 1, len(groups)), names) for j, names in enumerate(groups)]
    src_layout = block.layout
    layout = LayoutInfo(plugin=src_layout.plugin, world_size=src_layout.world_size, mesh=src_layout.mesh)
    created_by = f"unickpt {__version__} merge (from {src_layout.plugin} x{src_layout.world_size})"
    # The save id is derived from the merged block (every slice's hash) once the data is written:
    # headers are written with a same-length placeholder and rewritten, so that merging the same
    # checkpoint twice gives the same bytes.
    save_id = _PLACEHOLDER_ID

    def make_block(
        results: dict[str, tuple[str | None, str | None]], file_of: dict[str, str], save_id: str
    ) -> UnickptBlock:
        entries = {}
        for n, t in block.tensors.items():
            xxh, fp = results[n]
            entries[n] = TensorEntry(
                dtype=target[n],
                shape=list(t.shape),
                fingerprint=fp,
                slices=[
                    SliceEntry(
                        file=file_of[n], key=n, offsets=[0] * len(t.shape), shape=list(t.shape), xxh3=xxh
                    )
                ],
                param=t.param,
                state=t.state,
            )
        return build_block(
            format_version=block.format_version,  # fingerprints are copied, so is their algorithm
            kind=block.kind,
            created_by=created_by,
            layout=layout,
            tensors=entries,
            aliases=block.aliases,
            param_groups=block.param_groups,
            param_state=dict(block.param_state),
            save_id=save_id,
        )

    file_of = {n: f for f, names in files for n in names}
    results: dict[str, tuple[str | None, str | None]] = {}
    written: list[tuple[str, list[tuple[str, str, tuple[int, ...]]]]] = []
    for fname, names in files:
        specs = [(n, target[n], tuple(block.tensors[n].shape)) for n in names]
        meta = data_file_metadata(False, save_id)
        dumped: dict[str, Any] = {}
        if single:
            fname = single_name(kind)
            file_of = {n: fname for n in block.tensors}
            # Same-length placeholders: the real hashes are known only after the data is written.
            ph: dict[str, tuple[str | None, str | None]] = {
                n: (_PLACEHOLDER, _PLACEHOLDER if (t.fingerprint or target[n] != t.dtype) else None)
                for n, t in block.tensors.items()
            }
            dumped = make_block(ph, file_of, save_id).model_dump(mode="json", exclude_none=True)
            meta[UNICKPT_METADATA_KEY] = json.dumps(dumped)
        header, spans = encode_header(specs, meta)
        path = os.path.join(out_dir, fname)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            write_all(fd, memoryview(header), 0)
            todo = [
                (n, block.tensors[n], len(header) + begin)
                for (n, _, _), (begin, _end) in zip(specs, spans, strict=True)
            ]
            results.update(m.write_file(todo, fd))
            size = len(header) + (spans[-1][1] if spans else 0)
            if os.fstat(fd).st_size < size:  # the file ends in a hole left by a sparse source
                os.ftruncate(fd, size)
            if single:
                # The validated placeholder block, dumped, with the real values in its place: the
                # same JSON as dumping make_block(results, file_of), without building it again.
                for n, (xxh, fp) in results.items():
                    entry = dumped["tensors"][n]
                    _set_or_drop(entry["slices"][0], "xxh3", xxh)
                    _set_or_drop(entry, "fingerprint", fp)
                dumped["save_id"] = final_id = content_save_id(json.dumps(dumped).encode())
                new = {**meta, SAVE_ID_KEY: final_id, UNICKPT_METADATA_KEY: json.dumps(dumped)}
                rewrite_header(fd, specs, meta, new, fsync=False)
            os.fsync(fd)
        finally:
            os.close(fd)
        read_header(path)  # the file we wrote must pass the strict reader
        written.append((path, specs))
    if not single:
        final = make_block(results, file_of, _PLACEHOLDER_ID)
        final_id = content_save_id(_block_bytes(final))
        final = final.model_copy(update={"save_id": final_id})
        for path, specs in written:
            fd = os.open(path, os.O_WRONLY)
            try:  # same length: only the id's digits change
                rewrite_header(
                    fd, specs, data_file_metadata(False, save_id), data_file_metadata(False, final_id)
                )
            finally:
                os.close(fd)
        index = build_index(final, sliced=False)
        atomic_write_bytes(os.path.join(out_dir, index_name(kind)), index_to_json(index))


def _block_bytes(block: UnickptBlock) -> bytes:
    return json.dumps(block.model_dump(mode="json", exclude_none=True), sort_keys=True).encode()


def _set_or_drop(d: dict[str, Any], key: str, value: str | None) -> None:
    """``d[key] = value``, or no ``key`` at all for None (as ``model_dump(exclude_none=True)``)."""
    if value is None:
        d.pop(key, None)
    else:
        d[key] = value


def merge_checkpoint(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "5GB",
    dtype: str | None = None,
    verify: bool = True,
    optimizer: bool = False,
    progress: bool = False,
) -> str:
    """Merge the checkpoint at ``src`` (any layout) into a plain Hugging Face checkpoint at ``out``.

    Writes ``model.safetensors`` or ``model-0000k-of-0000n.safetensors`` plus
    ``model.safetensors.index.json`` (``max_shard_size`` as in Hugging Face, default "5GB"),
    copies ``config.json``/``generation_config.json``. ``dtype`` ("bf16", "fp16", "fp32")
    casts floating-point tensors. ``verify`` checks every slice hash while reading
    (``IntegrityError`` naming the tensor and file on a mismatch). ``optimizer=True`` also
    merges the optimizer checkpoint in ``src`` (FQN-keyed, ``optimizer*.safetensors``), and
    copies ``lr_scheduler.json``. ``progress`` shows a tqdm bar on stderr. Returns ``out``.

    ``out`` must not exist (or be an empty directory). Everything is written into a hidden
    temporary directory beside it, renamed to ``out`` only when complete: a failed merge
    leaves no ``out``. Called by one process; needs no process group.
    """
    src_s = os.fspath(src)
    out_s = check_output(os.fspath(out))
    out_dtype = None
    if dtype is not None:
        if dtype not in DTYPES:
            raise UnsupportedError(f"--dtype {dtype!r}: choose one of bf16, fp16, fp32")
        out_dtype = DTYPES[dtype]
    readers: list[CheckpointReader] = []
    try:
        # A file (a single-file checkpoint under any name, or an index) holds one kind; say which.
        kinds = (
            [detect_kind(src_s)]
            if os.path.isfile(src_s)
            else ["model", "optimizer"]
            if optimizer
            else ["model"]
        )
        for kind in kinds:
            if optimizer and os.path.isdir(src_s) and not _has_kind(src_s, kind):
                continue
            readers.append(open_checkpoint(src_s, kind))
        if not readers:
            readers.append(open_checkpoint(src_s, "optimizer"))
        # Coverage + headers: fail before writing anything.
        runs_of = [_validate(r) for r in readers]
        total = sum(t.nbytes for r in readers for t in r.block.tensors.values())
        # The copy buffer of every streamed tensor, not zero-filled (each read fills what it uses).
        buf = np.empty(_CHUNK, dtype=np.uint8).data
        with _progress_bar(total, progress) as update, staged_output(out_s) as tmp:
            for r, runs in zip(readers, runs_of, strict=True):
                _merge_one(
                    r,
                    tmp,
                    max_shard_size=max_shard_size,
                    out_dtype=out_dtype,
                    verify=verify,
                    progress=update,
                    src=src_s,
                    buf=buf,
                    runs_of=runs,
                )
            side = list(_SIDE_FILES) + (["lr_scheduler.json"] if optimizer else [])
            src_dir = readers[0].directory
            for fname in side:
                p = os.path.join(src_dir, fname)
                if os.path.isfile(p):
                    copy_small_file(p, os.path.join(tmp, fname))
        logger.info("merged %s into %s", src_s, out_s)
        return out_s
    finally:
        for r in readers:
            r.close()


@contextlib.contextmanager
def _progress_bar(total: int, show: bool) -> Iterator[Callable[[int], object]]:
    """A tqdm bar's ``update`` when ``show``; otherwise a no-op (tqdm is not even imported)."""
    if not show:
        yield lambda _n: None
        return
    from tqdm.auto import tqdm

    with tqdm(
        total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="merge", disable=None, leave=False
    ) as bar:
        yield bar.update


def _has_kind(directory: str, kind: str) -> bool:
    return os.path.isfile(os.path.join(directory, index_name(kind))) or os.path.isfile(
        os.path.join(directory, single_name(kind))
    )
