"""``unickpt merge``: rebuild full tensors from stored slices into a plain Hugging Face checkpoint.

Pure file IO plus numpy on raw bytes: no torch.distributed, no launcher, no GPU (torch is
imported only for ``dtype=`` casts). Each tensor is rebuilt from the shard info in the index:

- when every slice of a tensor is one contiguous run of the flattened tensor (row slices
  of FSDP/TP ``Shard(0)``, ZeRO flat ranges, whole tensors), its bytes are copied straight
  from the source files to their place in the output file, in chunks, hashing each chunk
  on the way (``copy_file_range`` when nothing needs hashing); memory stays constant;
- otherwise (column splits, 2-D meshes) the tensor is assembled in one numpy buffer of its
  size, then written; peak memory is about the largest such tensor.

Output files are written front to back and the kernel is asked to start writing them back
every ``_WRITEBACK`` bytes (``_merge_tensors``) (``sync_file_range``, a hint), so disk writes overlap the reads of
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
import functools
import json
import math
import os
import tempfile
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from unickpt import __version__
from unickpt._logging import get_logger
from unickpt.ckpt.reader import UNICKPT_METADATA_KEY, CheckpointReader, open_checkpoint
from unickpt.ckpt.safetensors_io import encode_header, header_from_bytes, read_header
from unickpt.ckpt.writer import build_block, build_index, data_file_metadata, group_files, rewrite_header
from unickpt.errors import ConfigError, UnsupportedError
from unickpt.spec.dtypes import itemsize
from unickpt.spec.index import LayoutInfo, TensorEntry, UnickptBlock, hex_to_b64, index_to_json
from unickpt.spec.naming import HF_SIDE_FILES, index_name, shard_name, single_name
from unickpt.spec.slice_table import SliceTable
from unickpt.store.publish import (
    SAVE_ID_KEY,
    Sink,
    content_save_id,
    holds_committed,
    output_location,
    output_sink,
)
from unickpt.store.storage import LocalStorage, Storage, open_storage, url_options
from unickpt.tools._common import detect_kind, read_side_files
from unickpt.tools._merge_mapped import hub_plan, write_mapped
from unickpt.tools._merge_tensors import CHUNK, RangeOutput, Run, TensorMerger, validate_runs
from unickpt.tools._progress import progress_bar

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
_PLACEHOLDER = "0" * 16
_PLACEHOLDER_ID = "0" * 32


def _merge_one(
    reader: CheckpointReader,
    out: Sink,
    *,
    max_shard_size: int | str,
    out_dtype: str | None,
    verify: bool,
    progress: Callable[[int], object],
    src: str,
    buf: memoryview,
    runs_of: dict[str, list[Run] | None],
    stage: str,
) -> None:
    """Merge one kind into the output ``out``, as its storage writes. Where it writes at offsets
    (``range_write``), each file is created at its size and its header rewritten in place once
    hashed, and the save id is derived from the merged block. Where it streams, data files of a
    sharded output stream out with their final headers (their save id fixed up front,
    :func:`_upfront_id`) and the index is a commit point; a single file (its header holds hashes
    known only at the end) streams with its first part uploaded last, or where the store has no
    addressable parts is written in the local directory ``stage`` and uploaded as a commit point."""
    kind = reader.kind
    block = reader.block
    in_place = out.storage.range_write
    m = TensorMerger(
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
    if not in_place and len(groups) > 1:
        save_id = _upfront_id(block, kind, out_dtype, groups)

    def make_block(
        results: dict[str, tuple[str | None, str | None]], file_of: dict[str, str], save_id: str
    ) -> UnickptBlock:
        entries = {}
        for n, t in block.tensors.items():
            xxh, fp = results[n]
            entries[n] = TensorEntry.of_table(
                target[n],
                t.shape,
                SliceTable.whole(n, t.shape, file_of[n], xxh3=xxh),
                fingerprint=fp,
                param=t.param,
                state=t.state,
            )
        return build_block(
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
        todo = [
            (n, block.tensors[n], len(header) + begin)
            for (n, _, _), (begin, _end) in zip(specs, spans, strict=True)
        ]
        size = len(header) + (spans[-1][1] if spans else 0)
        head_last = out.open_head_last(fname, size) if not in_place and single else None
        if head_last is not None:  # streamed, its first part uploaded last
            head_last.write(memoryview(header), 0)
            results.update(m.write_file(todo, head_last))
            head_last.finish(size)
            real, _ = encode_header(specs, _final_metadata(meta, dumped, results))
            if len(real) != len(header):
                raise RuntimeError("internal: a header changed length after hashing")  # pragma: no cover
            header_from_bytes(real, size, f"{out.url}/{fname}")  # must pass the strict reader
            out.commit_later(fname, functools.partial(head_last.complete, real))
            continue
        if not in_place and not single:  # streamed to the store, its header final from the start
            sf = out.open(fname)
            sf.write(memoryview(header), 0)
            results.update(m.write_file(todo, sf))
            sf.finish(size)
            out.close(sf)
            continue
        if not in_place and not stage:
            raise UnsupportedError(
                f"merge into {out.url}: a single-file {kind} checkpoint, written into a part of another "
                "output on a store without addressable parts; give a smaller --max-shard-size"
            )
        # Written at offsets (in the output, or in ``stage`` to be uploaded): the file is created
        # at its size (a sparse source's holes stay holes), its header rewritten in place once hashed.
        local = out.storage if in_place else LocalStorage(stage)
        path = out.path(fname) if in_place else local.join(stage, fname)
        f = local.open_range(path, size=size, header=header)
        try:
            results.update(m.write_file(todo, RangeOutput(f, local)))
            if single:
                rewrite_header(f, specs, meta, _final_metadata(meta, dumped, results), fsync=False)
            f.sync()
        finally:
            f.close()
        read_header(path)  # the file we wrote must pass the strict reader
        written.append((path, specs))
        if not in_place:
            out.commit_later(fname, path)
    if not in_place and not single:
        index = build_index(make_block(results, file_of, save_id), sliced=False)
        out.commit_later(index_name(kind), index_to_json(index))
    elif not single:
        final = make_block(results, file_of, _PLACEHOLDER_ID)
        final_id = content_save_id(_block_bytes(final))
        final = final.model_copy(update={"save_id": final_id})
        for path, specs in written:
            f = out.storage.open_range(path)
            try:  # same length: only the id's digits change
                rewrite_header(
                    f, specs, data_file_metadata(False, save_id), data_file_metadata(False, final_id)
                )
            finally:
                f.close()
        index = build_index(final, sliced=False)
        out.commit_later(index_name(kind), index_to_json(index))


def _upfront_id(block: UnickptBlock, kind: str, out_dtype: str | None, groups: list[list[str]]) -> str:
    """The save id of a sharded merge to a URL, fixed before anything is written (its data files
    stream out with their final headers): derived from the source block and what the merge
    does with it, so merging the same checkpoint the same way twice gives the same bytes."""
    what = json.dumps({"kind": kind, "dtype": out_dtype, "files": groups}).encode()
    return content_save_id(_block_bytes(block) + what)


def _block_bytes(block: UnickptBlock) -> bytes:
    return json.dumps(block.model_dump(mode="json", exclude_none=True), sort_keys=True).encode()


@contextlib.contextmanager
def _single_file_stage(storage: Storage, part: bool = False) -> Iterator[str]:
    """The local directory a single file for an output on ``storage`` is written into first,
    when one is needed: on a store that neither writes at offsets nor has addressable parts.
    Not for a ``part`` of another tool's output (the file would be uploaded when that output
    commits, after this directory is gone): refused there."""
    from unickpt.store.storage_parts import supports_shared_parts

    if storage.range_write or supports_shared_parts(storage):
        yield ""  # never used: the file is written in place, or streamed (StoreOutput.open_head_last)
        return
    if part:
        yield ""  # a single file is refused when planned (_merge_one: no stage)
        return
    with tempfile.TemporaryDirectory(prefix="unickpt-merge-") as tmp:
        yield tmp


def _final_metadata(
    meta: dict[str, str], dumped: dict[str, Any], results: dict[str, tuple[str | None, str | None]]
) -> dict[str, str]:
    """A single file's header metadata: the validated placeholder block ``dumped`` with the real
    values in its place (the same JSON as dumping ``make_block(results, ...)``, without building
    it again) and the save id derived from it."""
    for n, (xxh, fp) in results.items():
        entry = dumped["tensors"][n]
        # compact: the one slice's hash is the tensor's xxh3, in base64url (docs/format.md 3.1, 3.2)
        if "slices" in entry:
            _set_or_drop(entry["slices"][0], "xxh3", xxh)
        else:
            _set_or_drop(entry, "xxh3", None if xxh is None else hex_to_b64(xxh))
        _set_or_drop(entry, "fingerprint", None if fp is None else hex_to_b64(fp))
    dumped["save_id"] = final_id = content_save_id(json.dumps(dumped).encode())
    return {**meta, SAVE_ID_KEY: final_id, UNICKPT_METADATA_KEY: json.dumps(dumped)}


def _set_or_drop(d: dict[str, Any], key: str, value: str | None) -> None:
    """``d[key] = value``, or no ``key`` at all for None (as ``model_dump(exclude_none=True)``)."""
    if value is None:
        d.pop(key, None)
    else:
        d[key] = value


def merge_checkpoint(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str] | Sink,
    *,
    max_shard_size: int | str = "5GB",
    dtype: str | None = None,
    verify: bool = True,
    optimizer: bool = False,
    progress: bool = False,
    storage_options: dict[str, Any] | None = None,
    merge_adapters: bool = False,
    adapter_config: Any = None,
    hub_names: bool | None = None,
    mapping: Any = None,
) -> str:
    """Merge the checkpoint at ``src`` (any layout) into a plain Hugging Face checkpoint at ``out``.

    Writes ``model.safetensors`` or ``model-0000k-of-0000n.safetensors`` plus
    ``model.safetensors.index.json`` (``max_shard_size`` as in Hugging Face, default "5GB"),
    copies the side files a Hugging Face loader needs (``config.json``,
    ``generation_config.json``, the tokenizer's files). ``dtype`` ("bf16", "fp16", "fp32")
    casts floating-point tensors. ``verify`` checks every slice hash while reading
    (``IntegrityError`` naming the tensor and file on a mismatch). ``optimizer=True`` also
    merges the optimizer checkpoint in ``src`` (FQN-keyed, ``optimizer*.safetensors``), and
    copies ``lr_scheduler.json``. ``progress`` shows a tqdm bar on stderr. Returns ``out``.

    ``src`` and ``out`` are local paths or URLs (``storage_options`` for both, as fsspec takes
    them); ``out`` may also be a part of another tool's output (a ``store.publish.Sink``, e.g.
    ``convert --to colossalai``'s ``model/``), written and committed with it. A local ``out`` must not exist (or be an empty directory): everything is written into
    a hidden temporary directory beside it, renamed to ``out`` only when complete. A URL ``out``
    must hold no object: the files are uploaded under their final names and the index (or the
    single file) last, as every save on a store commits (``store/publish.py``). Either way a
    failed merge leaves no ``out``. Called by one process; needs no process group.

    ``merge_adapters=True`` (``--merge-adapters``): ``src`` is a ``PeftModel``'s LoRA run; the
    adapters are merged into the base weights as peft's ``merge_and_unload`` merges them, and
    the output has the base architecture's names (``tools/merge_adapters.py``).
    ``adapter_config`` gives the adapter's config when ``src`` has no ``adapter_config.json``.

    Names as the Hub has them: when ``src``'s ``config.json`` names a transformers architecture
    whose weights transformers maps on load (transformers 5 fuses the experts of an MoE layer,
    ``mlp.experts.gate_up_proj``, where the Hub keeps ``block_sparse_moe.experts.3.w1.weight``),
    the model's tensors are written through that mapping reversed, so ``from_pretrained`` reads
    the output as it reads the Hub's checkpoint (each expert read from the stored slices alone,
    bit for bit). ``hub_names=False`` writes the names as stored; ``hub_names=True`` requires a
    mapping. ``mapping``: a list of transformers ``WeightRenaming``/``WeightConverter`` (as
    ``load_model(mapping=...)`` takes it, from stored to live names) to reverse instead.
    """
    src_s = os.fspath(src)
    into: Sink | None = None
    if isinstance(out, (str, os.PathLike)):
        out_s = output_location(out, storage_options)
    else:
        into, out_s = out, out.url
    out_dtype = None
    if dtype is not None:
        if dtype not in DTYPES:
            raise UnsupportedError(f"--dtype {dtype!r}: choose one of bf16, fp16, fp32")
        out_dtype = DTYPES[dtype]
    if adapter_config is not None and not merge_adapters:
        raise ConfigError(
            "merge: adapter_config (--adapter-config) is the config of --merge-adapters; pass both"
        )
    if merge_adapters:
        if into is not None:
            raise UnsupportedError(
                "merge: --merge-adapters writes an output of its own, not a part of another"
            )
        if optimizer:
            raise UnsupportedError("merge: --merge-adapters merges the model only; drop --optimizer")
        from unickpt.tools.merge_adapters import merge_adapters as merge_lora

        return merge_lora(
            src_s,
            out_s,
            adapter_config=adapter_config,
            max_shard_size=max_shard_size,
            out_dtype=out_dtype,
            verify=verify,
            progress=progress,
            storage_options=storage_options,
        )
    opts = url_options(src_s, storage_options)  # the options are the URL's (src or out)
    src_store, src_root = open_storage(src_s, opts)
    readers: list[CheckpointReader] = []
    try:
        # A file (a single-file checkpoint under any name, or an index) holds one kind; say which.
        kinds = (
            [detect_kind(src_s, opts)]
            if src_store.is_file(src_root)
            else ["model", "optimizer"]
            if optimizer
            else ["model"]
        )
        for kind in kinds:
            if optimizer and not _has_kind(src_s, kind, opts):
                continue
            readers.append(open_checkpoint(src_s, kind, storage_options=opts))
        if not readers:
            readers.append(open_checkpoint(src_s, "optimizer", storage_options=opts))
        # Coverage + headers: fail before writing anything.
        runs_of = [validate_runs(r) for r in readers]
        total = sum(t.nbytes for r in readers for t in r.block.tensors.values())
        # The copy buffer of every streamed tensor, not zero-filled (each read fills what it uses).
        buf = np.empty(CHUNK, dtype=np.uint8).data
        side = list(HF_SIDE_FILES) + (["lr_scheduler.json"] if optimizer else [])
        with contextlib.ExitStack() as stack:
            update = stack.enter_context(progress_bar(total, "merge", progress))
            # A single-file output on a store without addressable parts (S3 has them: the
            # header's part goes last) is written in ``stage`` and uploaded when the output
            # commits (so this directory outlives the commit: entered first, left last).
            out_storage = (
                open_storage(out_s, url_options(out_s, storage_options))[0] if into is None else into.storage
            )
            stage = stack.enter_context(_single_file_stage(out_storage, into is not None))
            if into is None:
                sink = stack.enter_context(output_sink(out_s, storage_options))
            else:  # a part of another output: its directory made and locked while written
                sink = into
                stack.enter_context(sink.writing())
            config_json: bytes | None = None
            for fname, data in read_side_files(readers[0].directory, side, opts):
                if fname == "config.json" and readers[0].kind == "model":
                    _check_names(data, readers[0], src_s)
                    config_json = data
                sink.put(fname, data)
            for r, runs in zip(readers, runs_of, strict=True):
                hub = None
                if r.kind == "model":
                    hub = hub_plan(
                        config_json,
                        {n: (t.dtype, tuple(t.shape)) for n, t in r.block.tensors.items()},
                        mapping=mapping,
                        hub_names=hub_names,
                        aliases=dict(r.block.aliases),
                    )
                if hub is not None:
                    write_mapped(
                        r,
                        hub[0],
                        sink,
                        aliases=hub[1],
                        max_shard_bytes=_size_bytes(max_shard_size),
                        out_dtype=out_dtype,
                        verify=verify,
                        created_by=f"unickpt {__version__} merge (from {r.block.layout.plugin} x{r.block.layout.world_size}, Hub names)",
                        progress=update,
                    )
                    continue
                _merge_one(
                    r,
                    sink,
                    max_shard_size=max_shard_size,
                    out_dtype=out_dtype,
                    verify=verify,
                    progress=update,
                    src=src_s,
                    buf=buf,
                    runs_of=runs,
                    stage=stage,
                )
        logger.info("merged %s into %s", src_s, out_s)
        return out_s
    finally:
        for r in readers:
            r.close()


def _check_names(config_json: bytes, reader: CheckpointReader, src: str) -> None:
    """Warn when the merged names are not what ``config.json``'s architecture loads (a PEFT
    run's names, say): ``from_pretrained`` would ignore some tensors and initialise others at
    random, silently."""
    from unickpt.tools.hf_names import architecture_names_check

    names = list(reader.block.tensors) + list(reader.block.aliases)
    mismatch = architecture_names_check(config_json, names)
    if mismatch is not None:
        warnings.warn(
            f"merge {src}: the output's names do not match its config.json: {mismatch}",
            ArchitectureMismatchWarning,
            stacklevel=3,
        )


class ArchitectureMismatchWarning(UserWarning):
    """A merged checkpoint's names are not what its ``config.json``'s architecture loads."""


def _size_bytes(size: int | str) -> int:
    from huggingface_hub.serialization._base import parse_size_to_int

    return size if isinstance(size, int) else int(parse_size_to_int(size))


def _has_kind(src: str, kind: str, storage_options: dict[str, Any] | None) -> bool:
    """False when ``src`` is a directory (or a prefix) holding no committed ``kind`` checkpoint;
    True for a file, which ``open_checkpoint`` judges (one listing of the directory)."""
    store, root = open_storage(src, storage_options)
    if root.endswith((".json", ".safetensors")) or store.is_file(root):
        return True
    return holds_committed(store, root, kind)
