"""format.writer: one writer for the save engine, tools._write and merge.

The outputs must stay what they were: files named and grouped as Hugging Face groups them,
headers whose placeholders are replaced in place, indexes that the strict reader, safetensors
and transformers' loaders accept, and a merge whose tensors equal a gathered save's bytes.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
from huggingface_hub import split_state_dict_into_shards_factory
from safetensors import safe_open
from safetensors.torch import load_file

from unickpt import GeneralCheckpointIO
from unickpt.ckpt.reader import UNICKPT_METADATA_KEY, open_checkpoint
from unickpt.ckpt.safetensors_io import encode_header
from unickpt.ckpt.writer import (
    PLACEHOLDER,
    CheckpointWriter,
    build_block,
    build_index,
    group_files,
    rewrite_header,
    single_file_metadata,
    tensor_entry,
)
from unickpt.io.planner import plan_save
from unickpt.spec.index import LayoutInfo, SliceEntry, index_to_json
from unickpt.spec.naming import SLICED_SENTINEL, shard_name, slice_key
from unickpt.spec.slice_table import SliceTable
from unickpt.store.lock import directory_lock
from unickpt.store.publish import SAVE_ID_KEY, new_save_id
from unickpt.store.storage import LocalStorage
from unickpt.tools.merge import merge_checkpoint


def _header(path: Path) -> tuple[int, dict]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return n, json.loads(f.read(n))


@pytest.mark.parametrize("limit", [1, 100, 250, 1000, "5GB"])
def test_group_files_is_huggingface_split(limit: int | str) -> None:
    sizes = {f"t{i}": s for i, s in enumerate([40, 300, 10, 10, 120, 0, 90, 500, 5])}
    split = split_state_dict_into_shards_factory(
        sizes,
        get_storage_size=lambda n: n,
        filename_pattern="model{suffix}.safetensors",
        max_shard_size=limit,
    )
    groups = group_files(sizes, limit)
    n = len(groups)
    names = [shard_name("model", j + 1, n) if n > 1 else "model.safetensors" for j in range(n)]
    assert dict(zip(names, groups, strict=True)) == {f: list(t) for f, t in split.filename_to_tensors.items()}
    assert sorted(k for g in groups for k in g) == sorted(sizes)


def test_planner_files_follow_group_files() -> None:
    metas = [[(f"w{i}", "F32", (i + 1, 8), (0, 0), (i + 1, 8)) for i in range(6)]]
    plan = plan_save(metas, kind="model", size_per_shard_bytes=100, sliced=False)
    sizes = {f"w{i}": (i + 1) * 8 * 4 for i in range(6)}
    assert [[ps.key for ps in f.slices] for f in plan.files] == group_files(sizes, 100)


def test_checkpoint_writer_writes_a_sliced_checkpoint_the_reader_verifies(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((4, 6)).astype(np.float32)
    d = str(tmp_path / "ck")
    os.makedirs(d)
    sid = new_save_id()
    w = CheckpointWriter(d, "model", sid, sliced=True, storage=LocalStorage(d))
    parts = [((0, 0), a[:, :2]), ((0, 2), a[:, 2:])]
    files = [
        (shard_name("model", j + 1, 2), [(slice_key("a", j), "F32", p.shape)])
        for j, (_, p) in enumerate(parts)
    ]
    blocks = iter(
        (slice_key("a", j), np.ascontiguousarray(p).view(np.uint8).reshape(-1), ((4, 6), off, p.shape))
        for j, (off, p) in enumerate(parts)
    )
    with directory_lock(d):
        written = w.write(files, blocks)
        assert set(os.path.basename(p) for p in w.staged.values()) <= set(os.listdir(d))
        slices = [
            SliceEntry(file=f, key=k, offsets=list(off), shape=list(p.shape), xxh3=written[k][0])
            for (f, [(k, _, _)]), (off, p) in zip(files, parts, strict=True)
        ]
        entry = tensor_entry(
            "a",
            "F32",
            (4, 6),
            SliceTable.from_entries("a", (4, 6), slices),
            [written[s.key][1] for s in slices],
        )
        block = build_block(
            kind="model",
            created_by="test",
            layout=LayoutInfo(gathered=False),
            tensors={"a": entry},
            aliases={},
            save_id=sid,
        )
        index = build_index(block, sliced=True)
        assert index.weight_map == {"a": SLICED_SENTINEL} and index.metadata.total_size == a.nbytes
        w.commit(index_to_json(index))
    r = open_checkpoint(d)
    try:
        assert r.verify() == [] and r.block.save_id == sid
        for f, _ in files:
            with safe_open(os.path.join(d, f), "np") as g:
                assert g.metadata()["format"] == "unickpt-sliced" and g.metadata()[SAVE_ID_KEY] == sid
    finally:
        r.close()
    # The fingerprint does not depend on the layout: a gathered save of the same tensor agrees.
    m = nn.Module()
    m.register_buffer("a", torch.from_numpy(a.copy()))
    GeneralCheckpointIO().save_model(m, str(tmp_path / "whole"))
    whole = open_checkpoint(str(tmp_path / "whole"))
    try:
        assert whole.block.tensors["a"].fingerprint == entry.fingerprint
    finally:
        whole.close()


def test_rewrite_header_keeps_the_data_in_place(tmp_path: Path) -> None:
    p = tmp_path / "x.safetensors"
    specs = [("t", "F32", (2, 2))]
    block = {"tensors": {"t": {"fingerprint": PLACEHOLDER}}}
    old = single_file_metadata(block, "0" * 32)
    header, _ = encode_header(specs, old)
    data = np.arange(4, dtype=np.float32).tobytes()
    p.write_bytes(header + data)
    new = single_file_metadata({"tensors": {"t": {"fingerprint": "0123456789abcdef"}}}, "f" * 32)
    fd = os.open(p, os.O_WRONLY)
    try:
        rewrite_header(fd, specs, old, new)
    finally:
        os.close(fd)
    assert p.read_bytes()[len(header) :] == data
    _, h = _header(p)
    assert json.loads(h["__metadata__"][UNICKPT_METADATA_KEY]) == {
        "tensors": {"t": {"fingerprint": "0123456789abcdef"}}
    }
    with pytest.raises(RuntimeError, match="changed length"):
        fd = os.open(p, os.O_WRONLY)
        try:
            rewrite_header(fd, specs, new, single_file_metadata({"tensors": {}}, "f" * 32))
        finally:
            os.close(fd)


def test_single_file_save_and_merge_agree_with_huggingface_readers(tmp_path: Path) -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 12), nn.LayerNorm(12), nn.Linear(12, 3, bias=False))
    io = GeneralCheckpointIO()
    single = io.save_model(m, str(tmp_path / "single"))  # gathered, one file, block in its header
    io.save_model(m, str(tmp_path / "sliced"), shard=True, gather_dtensor=False)
    merge_checkpoint(tmp_path / "sliced", tmp_path / "merged")
    ref = {k: v.contiguous() for k, v in m.state_dict().items()}
    for path in (single, str(tmp_path / "merged" / "model.safetensors")):
        got = load_file(path)
        assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
        _, h = _header(Path(path))
        meta = h["__metadata__"]
        block = json.loads(meta[UNICKPT_METADATA_KEY])
        assert PLACEHOLDER not in meta[UNICKPT_METADATA_KEY] and block["save_id"] == meta[SAVE_ID_KEY]
        r = open_checkpoint(path)
        try:
            assert r.verify() == []
        finally:
            r.close()
    # The merged file and the gathered save hold the same tensors at the same places, byte for byte.
    a, b = Path(single).read_bytes(), (tmp_path / "merged" / "model.safetensors").read_bytes()
    na, ha = _header(Path(single))
    nb, hb = _header(tmp_path / "merged" / "model.safetensors")
    assert {k: v for k, v in ha.items() if k != "__metadata__"} == {
        k: v for k, v in hb.items() if k != "__metadata__"
    }
    assert a[8 + na :] == b[8 + nb :]
    ba, bb = (
        json.loads(ha["__metadata__"][UNICKPT_METADATA_KEY]),
        json.loads(hb["__metadata__"][UNICKPT_METADATA_KEY]),
    )
    for name, t in ba["tensors"].items():
        assert bb["tensors"][name]["fingerprint"] == t["fingerprint"]
        assert bb["tensors"][name]["xxh3"] == t["xxh3"]  # version 3: one slice, one hash
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_utils import load_state_dict

    assert transformers is not None
    got = load_state_dict(single)
    assert all(torch.equal(got[k], ref[k]) for k in ref)
