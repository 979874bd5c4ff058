"""Hostile files of the checkpoint formats unickpt imports (DCP, DeepSpeed, Colossal-AI, Hugging Face).

Each case starts from a real file written by the peer (``dcp.save``, the DeepSpeed and
Colossal-AI fixtures of tests/data/) and changes one thing: a name that leaves the checkpoint
(``../x``, an absolute path, ``a/../../x``, a symbolic link out of the directory, a key outside
the URL prefix on S3), an unpickled object that contains itself or is nested 10^5 levels deep,
or a count scaled to an extreme (a 2**36-element tensor, 10^5 dims, 2**60-byte lengths and
offsets, 10^9 ranks). Every case must raise its exact ``UnickptError`` subclass with a message
naming the file and the entry, within ``TIME_LIMIT`` seconds of CPU time (``WALL_LIMIT`` of wall
time: the machine running the tests is shared) and ``RSS_LIMIT`` bytes of peak RSS growth (the
kernel's high-water mark, reset before the case through /proc/self/clear_refs).
The untouched files must still convert bit-exact.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import pickle
import re
import shutil
import time
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from unickpt import errors
from unickpt.ckpt.reader import open_checkpoint
from unickpt.tools.convert import convert_checkpoint

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")

DATA = Path(__file__).resolve().parents[2] / "data"
DS = DATA / "deepspeed"
COLO = DATA / "colossalai" / "one_group"
TIME_LIMIT = 2.0
WALL_LIMIT = 10.0
RSS_LIMIT = 200 << 20
MESSAGE_LIMIT = 2000  # characters: a name or number from a file is shown cut, never whole
DEEP = 100_000
HUGE = 2**36


# ---------------------------------------------------------------- bounds


def _kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
    except OSError:
        return None
    return int(m.group(1)) << 10 if m else None


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _bounded(run: Callable[[], Any], exc: type[BaseException], *parts: str) -> BaseException:
    """Run ``run``; it must raise exactly ``exc`` (not a subclass of it standing in for another)
    with every one of ``parts`` in its message, within the time and memory bounds."""
    measured = _reset_peak()
    base = _kb("VmRSS")
    t0, c0 = time.monotonic(), time.process_time()
    with pytest.raises(errors.UnickptError) as info:
        run()
    took, cpu = time.monotonic() - t0, time.process_time() - c0
    peak = _kb("VmHWM")
    assert type(info.value) is exc, f"{type(info.value).__name__}: {info.value}"
    for p in parts:
        assert p in str(info.value), (p, str(info.value))
    assert cpu < TIME_LIMIT and took < WALL_LIMIT, f"took {cpu:.2f}s of CPU, {took:.2f}s in all"
    assert len(str(info.value)) < MESSAGE_LIMIT, f"a {len(str(info.value))}-character message"
    if measured and base is not None and peak is not None:
        assert peak - base < RSS_LIMIT, f"peak RSS grew {(peak - base) >> 20} MiB"
    return info.value


def _tensors(where: str | Path, kind: str = "model") -> dict[str, bytes]:
    with open_checkpoint(where, kind) as r:
        return {
            n: b"".join(bytes(r.read_key(s.file, s.key)) for s in t.slices)
            for n, t in r.block.tensors.items()
        }


# ---------------------------------------------------------------- pickle surgery

_PLACEHOLDER = "@@HOSTILE@@"


def _deep_ops(n: int) -> bytes:
    """Opcodes that leave one list nested ``n`` deep on the pickle stack (no memo used)."""
    return b"]" * n + b"a" * (n - 1)


def _splice(raw: bytes, ops: bytes) -> bytes:
    """``raw`` (a pickle holding the string ``_PLACEHOLDER`` once) with that string's opcode
    replaced by ``ops`` (its memo entry, if any, then names what ``ops`` built)."""
    enc = _PLACEHOLDER.encode()
    for op in (b"\x8c" + bytes([len(enc)]) + enc, b"X" + len(enc).to_bytes(4, "little") + enc):
        if op in raw:
            assert raw.count(op) == 1
            return raw.replace(op, ops)
    raise AssertionError("placeholder not found in the pickle")


def _rezip(path: Path, edit: Callable[[bytes], bytes]) -> None:
    """Rewrite the torch zip file ``path`` with its ``data.pkl`` passed through ``edit``."""
    with zipfile.ZipFile(path) as z:
        records = [(i.filename, z.read(i.filename)) for i in z.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, data in records:
            z.writestr(name, edit(data) if name.endswith("/data.pkl") else data)


def _torch_deep(path: Path, obj: dict[str, Any], key: str) -> None:
    """torch.save ``obj`` with ``obj[key]`` a list nested ``DEEP`` levels."""
    obj[key] = _PLACEHOLDER
    torch.save(obj, path)
    _rezip(path, lambda raw: _splice(raw, _deep_ops(DEEP)))


def _cyclic() -> list[Any]:
    a: list[Any] = [1]
    a.append([a])
    return a


def _storage_claim(path: Path, numel: int) -> None:
    """A torch file whose one tensor's storage claims ``numel`` elements over 16 stored bytes."""
    import collections

    class Stor:
        pass

    class T:
        def __reduce__(self) -> Any:
            return (
                torch._utils._rebuild_tensor_v2,
                (Stor(), 0, (4,), (1,), False, collections.OrderedDict()),
            )

    class P(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            return ("storage", torch.FloatStorage, "0", "cpu", numel) if isinstance(obj, Stor) else None

    buf = io.BytesIO()
    P(buf, protocol=2).dump({"x": T()})
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", buf.getvalue())
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/data/0", b"\0" * 16)
        z.writestr("archive/version", "3\n")


# ---------------------------------------------------------------- DCP


def _dcp(tmp: Path, name: str = "run", extra: dict[str, Any] | None = None) -> Path:
    d = tmp / name
    sd: dict[str, Any] = {"model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.arange(5)}}
    sd.update(extra or {})
    dcp.save(sd, checkpoint_id=str(d), no_dist=True)
    return d


def _edit_md(d: Path, edit: Callable[[Any], Any]) -> None:
    with open(d / ".metadata", "rb") as f:
        md = pickle.load(f)  # our own test file: trusted
    edit(md)
    (d / ".metadata").write_bytes(pickle.dumps(md))


def _entry(md: Any, fqn: str) -> tuple[Any, Any]:
    return next((k, v) for k, v in md.storage_data.items() if k.fqn == fqn)


def _set_path(fqn: str, path: str) -> Callable[[Any], None]:
    def edit(md: Any) -> None:
        _entry(md, fqn)[1].relative_path = path

    return edit


def _set_info(fqn: str, **fields: Any) -> Callable[[Any], None]:
    def edit(md: Any) -> None:
        info = _entry(md, fqn)[1]
        for k, v in fields.items():
            setattr(info, k, v)

    return edit


def _set_tensor(
    fqn: str, size: list[int] | None = None, chunk_sizes: list[int] | None = None
) -> Callable[[Any], None]:
    def edit(md: Any) -> None:
        m = md.state_dict_metadata[fqn]
        if size is not None:
            m.size = torch.Size(size)
        if chunk_sizes is not None:
            m.chunks[0].sizes = torch.Size(chunk_sizes)

    return edit


def _same_bytes(fqn: str, count: int) -> Callable[[Any], None]:
    """``count`` more bytes entries whose storage all claims the bytes of ``fqn``'s entry."""

    def edit(md: Any) -> None:
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

        _, info = _entry(md, fqn)
        for i in range(count):
            md.state_dict_metadata[f"lr_scheduler.k{i}"] = BytesStorageMetadata()
            md.storage_data[MetadataIndex(f"lr_scheduler.k{i}")] = info

    return edit


def _two_chunks_gap(md: Any) -> None:
    """model.w as [6, 4] in two chunks, rows 0-2 and 1-3 (as many elements, rows 4-5 missing); the
    second chunk stored where model.b was (model.b dropped)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    m = md.state_dict_metadata["model.w"]
    m.size = torch.Size([6, 4])
    m.chunks.append(ChunkStorageMetadata(offsets=torch.Size([1, 0]), sizes=torch.Size([3, 4])))
    key, info = _entry(md, "model.b")
    del md.storage_data[key], md.state_dict_metadata["model.b"]
    md.storage_data[MetadataIndex("model.w", torch.Size([1, 0]))] = info


def _planner(value: Any) -> Callable[[Any], None]:
    def edit(md: Any) -> None:
        md.planner_data["model.w"] = value

    return edit


def _deep_metadata(d: Path) -> None:
    _edit_md(d, _planner(_PLACEHOLDER))
    raw = (d / ".metadata").read_bytes()
    (d / ".metadata").write_bytes(_splice(raw, _deep_ops(DEEP)))


MD = ".metadata"
# case -> (edit of the metadata, expected error, message parts)
DCP_CASES: dict[str, tuple[Callable[[Any], None], type[BaseException], tuple[str, ...]]] = {
    "path_dotdot": (
        _set_path("model.w", "../victim/__0_0.distcp"),
        errors.UnsafePathError,
        ("storage_data['model.w'", "../victim"),
    ),
    "path_absolute": (
        _set_path("model.w", "/etc/passwd"),
        errors.UnsafePathError,
        ("storage_data['model.w'", "/etc/passwd"),
    ),
    "path_inner_dotdot": (
        _set_path("model.b", "a/../../x.distcp"),
        errors.UnsafePathError,
        ("storage_data['model.b'", "a/../../x"),
    ),
    "path_hidden": (_set_path("model.b", ".metadata"), errors.UnsafePathError, ("storage_data['model.b'",)),
    "path_not_str": (_set_path("model.b", ["__0_0.distcp"]), errors.UnsafePathError, ("relative_path",)),
    "path_missing_file": (
        _set_path("model.b", "__9_9.distcp"),
        errors.IncompleteCheckpointError,
        ("storage_data['model.b'", "__9_9.distcp", "missing"),
    ),
    "self_referential": (_planner(_cyclic()), errors.CheckpointFormatError, ("contains itself",)),
    "size_2e36_elements": (
        _set_tensor("model.b", [HUGE], [HUGE]),
        errors.CheckpointFormatError,
        ("'model.b'", f"needs {HUGE * 8} bytes", "storage entry holds"),
    ),
    "size_2e36_chunk_small": (
        _set_tensor("model.w", [HUGE, 4]),
        errors.CheckpointFormatError,
        ("'model.w'", str(HUGE * 4)),
    ),
    "size_2e36_times_zero": (
        _set_tensor("model.w", [0, 2**62], [0, 2**62]),
        errors.CheckpointFormatError,
        ("'model.w'",),
    ),
    "size_extent_2e70": (
        _set_tensor("model.w", [2**70], [2**70]),
        errors.CheckpointFormatError,
        ("'model.w'", "size"),
    ),
    "size_1e5_dims": (
        _set_tensor("model.w", [1] * 100_000),
        errors.CheckpointFormatError,
        ("'model.w'", "at most 64"),
    ),
    "size_negative": (_set_tensor("model.w", [-3, 4], [-3, 4]), errors.CheckpointFormatError, ("'model.w'",)),
    "chunk_outside": (
        _set_tensor("model.w", None, [30, 4]),
        errors.CheckpointFormatError,
        ("'model.w'", "chunk 0", "inside"),
    ),
    "chunks_leave_gap": (
        _two_chunks_gap,
        errors.CheckpointFormatError,
        ("'model.w'", "do not tile it", "dim 0"),
    ),
    "length_2e60": (
        _set_info("model.w", length=2**60),
        errors.CheckpointFormatError,
        ("storage_data['model.w'", str(2**60)),
    ),
    "offset_2e60": (
        _set_info("model.w", offset=2**60),
        errors.CheckpointFormatError,
        ("storage_data['model.w'", "claims bytes"),
    ),
    "offset_negative": (
        _set_info("model.w", offset=-1),
        errors.CheckpointFormatError,
        ("storage_data['model.w'", "non-negative"),
    ),
    "length_not_int": (
        _set_info("model.w", length="1577"),
        errors.CheckpointFormatError,
        ("storage_data['model.w'",),
    ),
    "offset_1e5000": (
        _set_info("model.w", offset=10**5000),
        errors.CheckpointFormatError,
        ("storage_data['model.w'", "too large to show", "below 2**63"),
    ),
    "chunk_offset_1e5000": (
        lambda md: setattr(md.state_dict_metadata["model.w"].chunks[0], "offsets", torch.Size([10**5000, 0])),
        errors.CheckpointFormatError,
        ("'model.w' chunk 0", "too large to show"),
    ),
    "planner_path_1e5000": (
        _planner(("model", 10**5000)),
        errors.CheckpointFormatError,
        ("planner_data['model.w']", "too large to show"),
    ),
    "planner_path_object": (
        _planner(("model", {"w": 1})),
        errors.CheckpointFormatError,
        ("planner_data['model.w']", "names and indices"),
    ),
    "transforms": (
        _set_info("model.w", transform_descriptors=["zstd"]),
        errors.UnsupportedError,
        ("storage_data['model.w'", "transforms"),
    ),
    "10k_entries_same_bytes": (
        _same_bytes("model.w", 10_000),
        errors.CheckpointFormatError,
        ("overlapping bytes", "__0_0.distcp"),
    ),
}


@pytest.mark.parametrize("case", sorted(DCP_CASES))
def test_dcp_metadata(case: str, tmp_path: Path) -> None:
    edit, exc, parts = DCP_CASES[case]
    _dcp(tmp_path, "victim")
    d = _dcp(tmp_path)
    _edit_md(d, edit)
    _bounded(lambda: convert_checkpoint(d, tmp_path / "out"), exc, str(d / MD), *parts)
    assert not (tmp_path / "out").exists()


LONG = "n" * 1_000_000  # a name of a megabyte: shown cut to 200 characters, its length said


@pytest.mark.parametrize(
    "edit, parts",
    [
        (
            _set_info(LONG, length=2**60),
            (f"storage_data['{LONG[:199]}... (1000000 characters)", "claims bytes"),
        ),
        (_set_tensor(LONG, [2**70], [2**70]), (f"'{LONG[:199]}... (1000000 characters)", "size")),
    ],
    ids=["length_2e60", "size_2e70"],
)
def test_dcp_metadata_name_of_a_megabyte(edit: Any, parts: tuple[str, ...], tmp_path: Path) -> None:
    d = _dcp(tmp_path, extra={LONG: torch.arange(4.0)})
    _edit_md(d, edit)
    _bounded(
        lambda: convert_checkpoint(d, tmp_path / "out"), errors.CheckpointFormatError, str(d / MD), *parts
    )


def test_dcp_metadata_nested_1e5_deep(tmp_path: Path) -> None:
    d = _dcp(tmp_path)
    _deep_metadata(d)
    _bounded(
        lambda: convert_checkpoint(d, tmp_path / "out"),
        errors.CheckpointFormatError,
        str(d / MD),
        "nested more than 64",
    )


def test_dcp_data_file_symlink_out(tmp_path: Path) -> None:
    victim = _dcp(tmp_path, "victim")
    d = _dcp(tmp_path)
    os.unlink(d / "__0_0.distcp")
    os.symlink(victim / "__0_0.distcp", d / "__0_0.distcp")
    _bounded(
        lambda: convert_checkpoint(d, tmp_path / "out"),
        errors.UnsafePathError,
        str(d / MD),
        "symbolic link",
        "__0_0.distcp",
    )


def test_dcp_data_file_fifo(tmp_path: Path) -> None:
    d = _dcp(tmp_path)
    os.unlink(d / "__0_0.distcp")
    os.mkfifo(d / "__0_0.distcp")
    _bounded(
        lambda: convert_checkpoint(d, tmp_path / "out"),
        errors.CheckpointFormatError,
        "__0_0.distcp",
        "not a regular file",
    )


def test_dcp_torchtitan_step_symlink_out(tmp_path: Path) -> None:
    other = _dcp(tmp_path, "elsewhere")
    run = tmp_path / "titan"
    run.mkdir()
    os.symlink(other, run / "step-5")
    _bounded(
        lambda: convert_checkpoint(run, tmp_path / "out"),
        errors.UnsafePathError,
        str(run),
        "step-5",
        "symbolic link",
    )


def _bytes_entry(d: Path, fqn: str, blob: bytes) -> None:
    """Store ``blob`` as the bytes of entry ``fqn``: appended to the data file, its storage entry
    pointed there."""
    with open(d / "__0_0.distcp", "ab") as f:
        start = f.tell()
        f.write(blob)
    _edit_md(d, _set_info(fqn, offset=start, length=len(blob)))


@pytest.mark.parametrize("kind", ["cyclic", "nested_1e5"])
def test_dcp_bytes_entry_objects(kind: str, tmp_path: Path) -> None:
    """A non-tensor entry (read with torch.load(weights_only=True)) that contains itself or nests 10^5 deep."""
    d = _dcp(tmp_path, extra={"lr_scheduler": {"x": 1}})
    buf = io.BytesIO()
    if kind == "cyclic":
        torch.save(_cyclic(), buf)
    else:
        torch.save([_PLACEHOLDER], buf)
        (tmp_path / "v.pt").write_bytes(buf.getvalue())
        _rezip(tmp_path / "v.pt", lambda raw: _splice(raw, _deep_ops(DEEP)))
        buf = io.BytesIO((tmp_path / "v.pt").read_bytes())
    _bytes_entry(d, "lr_scheduler.x", buf.getvalue())
    what = "contains itself" if kind == "cyclic" else "nested more than 64"
    _bounded(
        lambda: convert_checkpoint(d, tmp_path / "out"),
        errors.CheckpointFormatError,
        "'lr_scheduler.x'",
        what,
    )


def test_dcp_real_checkpoint_converts_bit_exact(tmp_path: Path) -> None:
    d = _dcp(tmp_path)
    convert_checkpoint(d, tmp_path / "out")
    got = _tensors(tmp_path / "out")
    assert got == {
        "model.w": torch.arange(12.0).reshape(3, 4).numpy().tobytes(),
        "model.b": torch.arange(5).numpy().tobytes(),
    }


# ---------------------------------------------------------------- DCP and HF indexes on S3


def _s3fs(s3: Any) -> Any:
    import s3fs

    return s3fs.S3FileSystem(**s3.storage_options("tester"))


def test_s3_dcp_storage_outside_the_prefix(s3: Any, tmp_path: Path) -> None:
    fs = _s3fs(s3)
    _dcp(tmp_path, "victim")
    fs.put(str(tmp_path / "victim"), f"{s3.bucket}/other", recursive=True)
    d = _dcp(tmp_path)
    fs.put(str(d), f"{s3.bucket}/good", recursive=True)
    convert_checkpoint(f"s3://{s3.bucket}/good", tmp_path / "ok")  # the positive case, on the store
    assert _tensors(tmp_path / "ok")["model.w"] == torch.arange(12.0).reshape(3, 4).numpy().tobytes()
    for i, rel in enumerate(
        ("../other/__0_0.distcp", f"/{s3.bucket}/other/__0_0.distcp", f"s3://{s3.bucket}/other/__0_0.distcp")
    ):
        _edit_md(d, _set_path("model.w", rel))
        fs.put(str(d), f"{s3.bucket}/bad{i}", recursive=True)
        url = f"s3://{s3.bucket}/bad{i}"
        _bounded(
            lambda url=url, i=i: convert_checkpoint(url, tmp_path / f"out{i}"),
            errors.UnsafePathError,
            f"{url}/.metadata",
            "storage_data['model.w'",
            rel,
        )


def test_s3_hf_index_outside_the_prefix(s3: Any, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    fs = _s3fs(s3)
    d = tmp_path / "hf"
    d.mkdir()
    save_file({"w": torch.ones(2)}, d / "model-00001-of-00001.safetensors")
    fs.put(str(d / "model-00001-of-00001.safetensors"), f"{s3.bucket}/other/x.safetensors")
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {"w": "../other/x.safetensors"}})
    )
    fs.put(str(d), f"{s3.bucket}/hf", recursive=True)
    url = f"s3://{s3.bucket}/hf"
    _bounded(lambda: open_checkpoint(url), errors.UnsafePathError, "../other/x.safetensors")


# ---------------------------------------------------------------- Hugging Face / our own index, local


def _hf(tmp: Path, target: str) -> Path:
    from safetensors.torch import save_file

    d = tmp / "hf"
    d.mkdir()
    save_file({"w": torch.ones(2)}, tmp / "x.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {"w": target}}))
    return d


@pytest.mark.parametrize(
    "target", ["../x.safetensors", "/etc/x.safetensors", "a/../../x.safetensors", "..\\x.safetensors"]
)
def test_hf_index_weight_map_escapes(target: str, tmp_path: Path) -> None:
    d = _hf(tmp_path, target)
    _bounded(lambda: open_checkpoint(d), errors.UnsafePathError, "weight_map", repr(target)[1:-1])


def test_hf_index_data_file_symlink_out(tmp_path: Path) -> None:
    d = _hf(tmp_path, "model-00001-of-00001.safetensors")
    os.symlink(tmp_path / "x.safetensors", d / "model-00001-of-00001.safetensors")
    _bounded(
        lambda: open_checkpoint(d).validate_structure(),
        errors.UnsafePathError,
        "model-00001-of-00001.safetensors",
        "symbolic link",
    )


def test_unickpt_data_file_symlink_out(make_checkpoint: Callable[..., Path]) -> None:
    d = make_checkpoint()
    other = make_checkpoint("victim")
    victim = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))[0]
    os.unlink(d / victim)
    os.symlink(other / victim, d / victim)
    _bounded(lambda: open_checkpoint(d).validate_structure(), errors.UnsafePathError, victim, "symbolic link")


@pytest.mark.parametrize("target", ["../x.bin", "/tmp/x.bin", "a/../../x.bin"])
def test_bin_index_weight_map_escapes(target: str, tmp_path: Path) -> None:
    d = tmp_path / "bin"
    d.mkdir()
    torch.save({"w": torch.ones(2)}, tmp_path / "x.bin")
    (d / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {"w": target}}))
    _bounded(
        lambda: convert_checkpoint(d, tmp_path / "out", source="bin"),
        errors.UnsafePathError,
        "pytorch_model.bin.index.json",
        target,
    )


def test_side_file_symlink_out_is_not_copied(tmp_path: Path) -> None:
    d = tmp_path / "bin"
    d.mkdir()
    torch.save({"w": torch.ones(2)}, d / "pytorch_model.bin")
    (tmp_path / "secret").write_text('{"token": "do not copy"}')
    os.symlink(tmp_path / "secret", d / "config.json")
    _bounded(
        lambda: convert_checkpoint(d, tmp_path / "out", source="bin"),
        errors.UnsafePathError,
        "side file 'config.json'",
        "symbolic link",
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["cyclic", "nested_1e5"])
def test_bin_shard_objects(kind: str, tmp_path: Path) -> None:
    d = tmp_path / "bin"
    d.mkdir()
    sd: dict[str, Any] = {"w": torch.ones(2)}
    if kind == "cyclic":
        sd["extra"] = _cyclic()
        torch.save(sd, d / "pytorch_model.bin")
    else:
        _torch_deep(d / "pytorch_model.bin", sd, "extra")
    what = "contains itself" if kind == "cyclic" else "nested more than 64"
    _bounded(
        lambda: convert_checkpoint(d, tmp_path / "out", source="bin"),
        errors.CheckpointFormatError,
        str(d / "pytorch_model.bin"),
        what,
    )


def test_bin_shard_symlink_out(tmp_path: Path) -> None:
    d = tmp_path / "bin"
    d.mkdir()
    torch.save({"w": torch.ones(2)}, tmp_path / "x.bin")
    (d / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {"w": "pytorch_model-1.bin"}}))
    os.symlink(tmp_path / "x.bin", d / "pytorch_model-1.bin")
    _bounded(
        lambda: convert_checkpoint(d, tmp_path / "out", source="bin"),
        errors.UnsafePathError,
        "pytorch_model-1.bin",
        "symbolic link",
    )


# ---------------------------------------------------------------- DeepSpeed


def _ds(tmp: Path, case: str = "zero1_ws1") -> Path:
    dst = tmp / "ds"
    shutil.copytree(DS / case / "ckpt", dst)
    return dst


MS = "global_step3/mp_rank_00_model_states.pt"
OS_ = "global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt"


def _edit_pt(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    obj = torch.load(path, weights_only=False)  # our own fixture: trusted
    edit(obj)
    torch.save(obj, path)


def _ds_shape(name: str, shape: Any) -> Callable[[dict[str, Any]], None]:
    def edit(ms: dict[str, Any]) -> None:
        ms["param_shapes"][0][name] = shape

    return edit


def _ds_osd(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(o: dict[str, Any]) -> None:
        o["optimizer_state_dict"][key] = value

    return edit


def _ds_frozen(ms: dict[str, Any]) -> None:
    ms["frozen_param_shapes"] = {"frozen.w": torch.Size([HUGE])}
    ms["frozen_param_fragments"] = {"frozen.w": torch.zeros(4)}


# case -> (file, edit, expected error, message parts)
DS_CASES: dict[str, tuple[str, Callable[[dict[str, Any]], None], type[BaseException], tuple[str, ...]]] = {
    "model_self_referential": (
        MS,
        lambda ms: ms.__setitem__("buffer_names", _cyclic()),
        errors.CheckpointFormatError,
        (MS, "contains itself"),
    ),
    "optim_self_referential": (
        OS_,
        _ds_osd("param_slice_mappings", _cyclic()),
        errors.CheckpointFormatError,
        (OS_, "contains itself"),
    ),
    "param_shape_2e36": (
        MS,
        _ds_shape("0.weight", torch.Size([HUGE])),
        errors.CheckpointFormatError,
        (OS_, "'0.weight'", "ends past"),
    ),
    "param_shape_1e5_dims": (
        MS,
        _ds_shape("0.weight", [1] * 100_000),
        errors.CheckpointFormatError,
        ("'0.weight'", "at most 64"),
    ),
    "param_shape_2e70": (MS, _ds_shape("0.weight", [2**70]), errors.CheckpointFormatError, ("'0.weight'",)),
    "frozen_shape_2e36": (MS, _ds_frozen, errors.CheckpointFormatError, ("DeepSpeed",)),
    "padding_2e62": (
        OS_,
        _ds_osd("param_alignment_paddings", [[2**62, 0, 0], [0, 0, 0]]),
        errors.CheckpointFormatError,
        (OS_, "padding"),
    ),
    "padding_2e1000": (
        OS_,
        _ds_osd("param_alignment_paddings", [[10**1000, 0, 0], [0, 0, 0]]),
        errors.UnsupportedError,  # torch's weights_only unpickler refuses LONG4 already
        (OS_, "refusing to unpickle"),
    ),
    "partition_count_1e9": (
        OS_,
        _ds_osd("partition_count", [10**9]),
        errors.IncompleteCheckpointError,
        ("1000000000 ranks",),
    ),
    "partition_count_digits": (
        OS_,
        _ds_osd("partition_count", "9" * 100_000),
        errors.CheckpointFormatError,
        ("DeepSpeed",),
    ),
}


@pytest.mark.parametrize("case", sorted(DS_CASES))
def test_deepspeed_files(case: str, tmp_path: Path) -> None:
    fname, edit, exc, parts = DS_CASES[case]
    ck = _ds(tmp_path)
    _edit_pt(ck / fname, edit)
    _bounded(lambda: convert_checkpoint(ck, tmp_path / "out", source="deepspeed"), exc, *parts)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fname", [MS, OS_])
def test_deepspeed_nested_1e5_deep(fname: str, tmp_path: Path) -> None:
    ck = _ds(tmp_path)
    obj = torch.load(ck / fname, weights_only=False)
    _torch_deep(ck / fname, obj, "hostile")
    _bounded(
        lambda: convert_checkpoint(ck, tmp_path / "out", source="deepspeed"),
        errors.CheckpointFormatError,
        str(ck / fname),
        "nested more than 64",
    )


@pytest.mark.parametrize("claim", ["storage_2e36", "view_2e36"])
def test_deepspeed_tensor_claims(claim: str, tmp_path: Path) -> None:
    ck = _ds(tmp_path)
    if claim == "storage_2e36":
        _storage_claim(ck / MS, HUGE)
    else:  # a tensor view of 2**36 elements over its 4-element storage
        _storage_claim(ck / MS, 4)
        with zipfile.ZipFile(ck / MS) as z:
            assert b"K\x04\x85" in z.read("archive/data.pkl")  # the size (4,): BININT1 4, TUPLE1
        _rezip(
            ck / MS, lambda r: r.replace(b"K\x04\x85", b"\x8a\x05" + HUGE.to_bytes(5, "little") + b"\x85", 1)
        )
    _bounded(
        lambda: convert_checkpoint(ck, tmp_path / "out", source="deepspeed"),
        errors.CheckpointFormatError,
        str(ck / MS),
        "not a readable DeepSpeed checkpoint file",
    )


def test_deepspeed_legacy_format_refused(tmp_path: Path) -> None:
    ck = _ds(tmp_path)
    obj = torch.load(ck / MS, weights_only=False)
    torch.save(obj, ck / MS, _use_new_zipfile_serialization=False)
    _bounded(
        lambda: convert_checkpoint(ck, tmp_path / "out", source="deepspeed"),
        errors.UnsupportedError,
        str(ck / MS),
        "legacy",
    )


@pytest.mark.parametrize("tag", ["../other", "/etc", "a/../../x", "global_step3/../../x", ".hidden"])
def test_deepspeed_latest_escapes(tag: str, tmp_path: Path) -> None:
    ck = _ds(tmp_path)
    (ck / "latest").write_text(tag)
    _bounded(
        lambda: convert_checkpoint(ck, tmp_path / "out", source="deepspeed"),
        errors.UnsafePathError,
        "latest",
        repr(tag),
    )


def test_deepspeed_tag_directory_symlink_out(tmp_path: Path) -> None:
    ck = _ds(tmp_path)
    shutil.move(ck / "global_step3", tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", ck / "global_step3")
    _bounded(
        lambda: convert_checkpoint(ck, tmp_path / "out", source="deepspeed"),
        errors.UnsafePathError,
        "global_step3",
        "symbolic link",
    )


@pytest.mark.parametrize("fname", [MS, OS_])
def test_deepspeed_rank_file_symlink_out(fname: str, tmp_path: Path) -> None:
    ck = _ds(tmp_path)
    shutil.move(ck / fname, tmp_path / "stolen.pt")
    os.symlink(tmp_path / "stolen.pt", ck / fname)
    _bounded(
        lambda: convert_checkpoint(ck, tmp_path / "out", source="deepspeed"),
        errors.UnsafePathError,
        Path(fname).name,
        "symbolic link",
    )


def test_deepspeed_real_checkpoint_converts_bit_exact(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    out = tmp_path / "out"
    convert_checkpoint(DS / "zero2_ws2" / "ckpt", out, source="deepspeed")
    want = {
        k[len("model.") :]: v
        for k, v in load_file(DS / "zero2_ws2" / "expected.safetensors").items()
        if k.startswith("model.")
    }
    assert _tensors(out) == {n: t.numpy().tobytes() for n, t in want.items()}


# ---------------------------------------------------------------- Colossal-AI


def _colo(tmp: Path) -> Path:
    shutil.copytree(COLO, tmp / "colo")
    return tmp / "colo" / "optimizer"


OIDX = "pytorch_optim.bin.index.json"
GROUPS = "pytorch_optim_group.bin"
SHARD = "pytorch_optim-00001.bin"


def _colo_index(
    edit: Callable[[dict[str, Any]], None], name: str = OIDX, where: str = "optimizer"
) -> Callable[[Path], None]:
    def run(opt: Path) -> None:
        p = opt.parent / where / name
        idx = json.loads(p.read_text())
        edit(idx)
        p.write_text(json.dumps(idx))

    return run


def _wm(target: str) -> Callable[[dict[str, Any]], None]:
    return lambda idx: idx["weight_map"].__setitem__("0", target)


def _colo_pickle(name: str, edit: Callable[[Any], Any]) -> Callable[[Path], None]:
    def run(opt: Path) -> None:
        obj = torch.load(opt / name, weights_only=False)
        torch.save(edit(obj), opt / name)

    return run


def _colo_deep(name: str) -> Callable[[Path], None]:
    def run(opt: Path) -> None:
        obj = torch.load(opt / name, weights_only=False)
        if isinstance(obj, list):
            obj[0]["hostile"] = _PLACEHOLDER
            torch.save(obj, opt / name)
            _rezip(opt / name, lambda raw: _splice(raw, _deep_ops(DEEP)))
        else:
            _torch_deep(opt / name, obj, "hostile")

    return run


def _colo_symlink(name: str) -> Callable[[Path], None]:
    def run(opt: Path) -> None:
        shutil.move(opt / name, opt.parent.parent / "stolen.bin")
        os.symlink(opt.parent.parent / "stolen.bin", opt / name)

    return run


def _colo_big_index(opt: Path) -> None:
    with open(opt / OIDX, "wb") as f:
        f.truncate((64 << 20) + 1)  # sparse


def _colo_deep_json(opt: Path) -> None:
    (opt / OIDX).write_text("[" * DEEP + "]" * DEEP)


def _colo_legacy(opt: Path) -> None:
    obj = torch.load(opt / GROUPS, weights_only=False)
    torch.save(obj, opt / GROUPS, _use_new_zipfile_serialization=False)


def _cyc_groups(groups: Any) -> Any:
    groups[0]["hostile"] = _cyclic()
    return groups


def _big_ids(groups: Any) -> Any:
    groups[0]["params"] = [10**18, *groups[0]["params"][1:]]
    return groups


def _state_id(part: Any) -> Any:
    part[10**18] = part.pop(0)
    return part


COLO_CASES: dict[str, tuple[Callable[[Path], None], type[BaseException], tuple[str, ...]]] = {
    "weight_map_dotdot": (_colo_index(_wm("../x.bin")), errors.UnsafePathError, (OIDX, "'../x.bin'")),
    "weight_map_absolute": (_colo_index(_wm("/tmp/x.bin")), errors.UnsafePathError, (OIDX, "'/tmp/x.bin'")),
    "weight_map_inner_dotdot": (
        _colo_index(_wm("a/../../x.bin")),
        errors.UnsafePathError,
        (OIDX, "'a/../../x.bin'"),
    ),
    "weight_map_not_str": (_colo_index(_wm(["x.bin"])), errors.CheckpointFormatError, (OIDX, "weight_map")),
    "param_groups_dotdot": (
        _colo_index(lambda i: i["metadata"].__setitem__("param_groups", "../../g.bin")),
        errors.UnsafePathError,
        (OIDX, "metadata.param_groups", "'../../g.bin'"),
    ),
    "model_index_dotdot": (
        _colo_index(
            lambda i: i["weight_map"].__setitem__("0.weight", "../evil.bin"),
            "pytorch_model.bin.index.json",
            "model",
        ),
        errors.UnsafePathError,
        ("pytorch_model.bin.index.json", "weight_map['0.weight']", "'../evil.bin'"),
    ),
    "shard_symlink_out": (_colo_symlink(SHARD), errors.UnsafePathError, (SHARD, "symbolic link")),
    "groups_symlink_out": (_colo_symlink(GROUPS), errors.UnsafePathError, (GROUPS, "symbolic link")),
    "groups_self_referential": (
        _colo_pickle(GROUPS, _cyc_groups),
        errors.CheckpointFormatError,
        (GROUPS, "contains itself"),
    ),
    "shard_self_referential": (
        _colo_pickle(SHARD, lambda p: {**p, 0: {**p[0], "hostile": _cyclic()}}),
        errors.CheckpointFormatError,
        (SHARD, "contains itself"),
    ),
    "groups_nested_1e5": (_colo_deep(GROUPS), errors.CheckpointFormatError, (GROUPS, "nested more than 64")),
    "shard_nested_1e5": (_colo_deep(SHARD), errors.CheckpointFormatError, (SHARD, "nested more than 64")),
    "shard_storage_2e36": (
        lambda opt: _storage_claim(opt / SHARD, HUGE),
        errors.CheckpointFormatError,
        (SHARD, "not a readable Colossal-AI checkpoint file"),
    ),
    "group_id_1e18": (
        _colo_pickle(GROUPS, _big_ids),
        errors.CheckpointFormatError,
        ("param group 0", "outside"),
    ),
    "state_id_1e18": (
        _colo_pickle(SHARD, _state_id),
        errors.CheckpointFormatError,
        ("parameter id 1000000000000000000",),
    ),
    "index_over_64MiB": (_colo_big_index, errors.CheckpointFormatError, (OIDX, "limit")),
    "index_json_nested_1e5": (_colo_deep_json, errors.CheckpointFormatError, (OIDX, "nested too deeply")),
    "legacy_format": (_colo_legacy, errors.UnsupportedError, (GROUPS, "legacy")),
}


@pytest.mark.parametrize("case", sorted(COLO_CASES))
def test_colossalai_files(case: str, tmp_path: Path) -> None:
    edit, exc, parts = COLO_CASES[case]
    opt = _colo(tmp_path)
    edit(opt)
    _bounded(lambda: convert_checkpoint(opt, tmp_path / "out", source="colossalai"), exc, *parts)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- the object-graph bound itself


def test_check_graph_counts_shared_objects_on_every_path() -> None:
    """20 chains of 50 lists, each chain's end holding the next chain, all listed at the top: each
    object is visited once, yet the longest nesting (1000) is what a recursive walk would meet."""
    from unickpt.spec.untrusted import check_graph

    chains = []
    for _ in range(20):
        top: list[Any] = []
        end = top
        for _ in range(49):
            end.append([])
            end = end[0]
        chains.append((top, end))
    for (_, end), (nxt, _) in itertools.pairwise(chains):
        end.append(nxt)
    check_graph([chains[-1][0]], "f")  # one chain: 51 deep, accepted
    with pytest.raises(
        errors.CheckpointFormatError, match="f: the object is nested more than 64 levels deep"
    ):
        check_graph([top for top, _ in chains], "f")


def test_check_graph_walks_shared_objects_once() -> None:
    """10^9 paths through shared lists cost their 10^6 references, not 10^9 visits."""
    from unickpt.spec.untrusted import check_graph

    leaf: list[Any] = [torch.ones(1), "x", 1.5, None]
    level: Any = leaf
    for _ in range(9):
        level = [level] * 10
    wide = [level] * 1000
    c0 = time.process_time()
    check_graph({"a": wide, "b": (wide, {1: leaf})}, "f")
    assert time.process_time() - c0 < TIME_LIMIT
    a: dict[str, Any] = {}
    a["self"] = {"inner": [a]}
    with pytest.raises(errors.CheckpointFormatError, match="f: the object contains itself"):
        check_graph(a, "f")
