"""A verify and a verified load read a checkpoint's slices from its tables: no ``SliceEntry`` built.

``SliceEntry`` objects are built from a table by ``entries_from_records`` (every bulk and
on-demand build goes through its ``_set_dict`` pass) or by the model's constructor; both are
counted here, over a 1000-slice checkpoint saved sliced (hashes, no fingerprint: the bulk rehash)
and one saved gathered (1000 tensors with fingerprints: the per-slice rehash).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import unickpt.spec.slice_table as slice_table
from unickpt import GeneralCheckpointIO, verify_checkpoint
from unickpt.ckpt.reader import open_checkpoint
from unickpt.ckpt.safetensors_io import encode_header
from unickpt.ckpt.writer import build_block, build_index
from unickpt.errors import IntegrityError
from unickpt.spec.hashing import SliceHasher
from unickpt.spec.index import LayoutInfo, SliceEntry, TensorEntry, index_to_json
from unickpt.spec.naming import shard_name, slice_key
from unickpt.spec.slice_table import SliceTable

WORLD, TENSORS = 100, 10  # 1000 slices: one row of every tensor per rank's file


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A counter of the ``SliceEntry`` objects built while the test runs."""
    count = [0]
    set_dict = slice_table._set_dict

    def counting(obj: Any, d: Any) -> None:
        count[0] += 1
        set_dict(obj, d)

    init = SliceEntry.__init__

    def counting_init(self: Any, *a: Any, **kw: Any) -> None:
        count[0] += 1
        init(self, *a, **kw)

    monkeypatch.setattr(slice_table, "_set_dict", counting)
    monkeypatch.setattr(SliceEntry, "__init__", counting_init)
    return count


def _sliced(d: Path) -> nn.Module:
    """A sliced checkpoint of WORLD x TENSORS slices (row r of every tensor in rank r's file)."""
    d.mkdir()
    names = [f"layer{i}.weight" for i in range(TENSORS)]
    data = {
        n: torch.arange(WORLD * 2, dtype=torch.float32).reshape(WORLD, 2) + i for i, n in enumerate(names)
    }
    cols: dict[str, dict[str, list[Any]]] = {
        n: {"files": [], "keys": [], "offsets": [], "shapes": [], "hashes": []} for n in names
    }
    for r in range(WORLD):
        fname = shard_name("model", r + 1, WORLD)
        header, _ = encode_header(
            [(slice_key(n, r), "F32", (1, 2)) for n in names], {"format": "unickpt-sliced"}
        )
        with open(d / fname, "wb") as f:
            f.write(header)
            for n in names:
                row = data[n][r : r + 1].numpy().tobytes()
                f.write(row)
                h = SliceHasher()
                h.update(row)
                c = cols[n]
                c["files"].append(fname)
                c["keys"].append(slice_key(n, r))
                c["offsets"].append([r, 0])
                c["shapes"].append([1, 2])
                c["hashes"].append(h.hexdigest())
    tensors = {
        n: TensorEntry.of_table("F32", (WORLD, 2), SliceTable.from_columns(n, (WORLD, 2), **cols[n]))
        for n in names
    }
    block = build_block(
        kind="model",
        created_by="test",
        layout=LayoutInfo(world_size=WORLD, gathered=False),
        tensors=tensors,
        aliases={},
        save_id=None,
    )
    (d / "model.safetensors.index.json").write_bytes(index_to_json(build_index(block, sliced=True)))
    m = nn.Module()
    for n in names:
        m.register_buffer(n.replace(".", "_"), torch.zeros(WORLD, 2))
    return _renamed(m, names)


def _renamed(m: nn.Module, names: list[str]) -> nn.Module:
    out = nn.Module()
    for n in names:
        layer, leaf = n.split(".")
        if not hasattr(out, layer):
            out.add_module(layer, nn.Module())
        getattr(out, layer).register_buffer(leaf, torch.zeros(WORLD, 2))
    return out


def _gathered(d: Path) -> nn.Module:
    """A gathered save of 1000 small tensors, each with its hash and fingerprint."""
    m = nn.Module()
    for i in range(WORLD * TENSORS):
        m.register_buffer(f"b{i}", torch.full((3,), float(i)))
    GeneralCheckpointIO().save_model(m, str(d))
    return m


@pytest.mark.parametrize("layout", ["sliced", "gathered"])
def test_verify_and_verified_load_build_no_slice_entry(tmp_path: Path, built: list[int], layout: str) -> None:
    d = tmp_path / layout
    m = _sliced(d) if layout == "sliced" else _gathered(d)
    built[0] = 0
    report = verify_checkpoint(str(d))
    assert not list(report) and report.hashed == WORLD * TENSORS
    assert built[0] == 0
    GeneralCheckpointIO().load_model(m, str(d), verify=True)
    assert built[0] == 0
    with open_checkpoint(str(d)) as r:
        assert r.verify() == []
    assert built[0] == 0


def test_a_failed_verified_load_names_the_slice(tmp_path: Path, built: list[int]) -> None:
    d = tmp_path / "sliced"
    m = _sliced(d)
    f = d / shard_name("model", 7, WORLD)
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0xFF  # the last tensor's row 6
    f.write_bytes(bytes(raw))
    built[0] = 0
    with pytest.raises(IntegrityError) as e:
        GeneralCheckpointIO().load_model(m, str(d), verify=True)
    assert built[0] == 0
    (fl,) = e.value.failures
    assert (fl.tensor, fl.file, fl.key) == (
        "layer9.weight",
        os.path.basename(f),
        slice_key("layer9.weight", 6),
    )


def test_diff_rehashes_from_the_table(tmp_path: Path, built: list[int]) -> None:
    """No fingerprint recorded: diff computes them from the data, rehashing every slice on the way."""
    from unickpt.tools.diff import diff_checkpoints

    a, b = tmp_path / "a", tmp_path / "b"
    _sliced(a)
    _sliced(b)
    f = b / shard_name("model", 7, WORLD)
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0xFF  # the last tensor's row 6
    f.write_bytes(bytes(raw))
    built[0] = 0
    rep = diff_checkpoints(str(a), str(b))
    assert built[0] == 0
    key = slice_key("layer9.weight", 6)
    (msg,) = rep.integrity_failures
    assert msg.startswith(f"{b}: tensor 'layer9.weight' in file {f.name!r} (key {key!r}): expected xxh3-64 ")
