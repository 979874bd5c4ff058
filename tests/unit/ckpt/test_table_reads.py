"""A verify, a load (verified or not: row blocks, column blocks, 0-d), ``diff --deep`` and the JSON of a listed index read a checkpoint's
slices from its tables: no ``SliceEntry`` built.

``SliceEntry`` objects are built from a table by ``entries_from_records`` (every bulk and
on-demand build goes through its ``_set_dict`` pass) or by the model's constructor; both are
counted here, over a 1000-slice checkpoint saved sliced (hashes, no fingerprint: the bulk rehash)
and one saved gathered (1000 tensors with fingerprints: the per-slice rehash).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import unickpt.spec.slice_table as slice_table
from unickpt import GeneralCheckpointIO, verify_checkpoint
from unickpt.ckpt.reader import open_checkpoint
from unickpt.ckpt.safetensors_io import encode_header
from unickpt.ckpt.writer import build_block, build_index
from unickpt.errors import IntegrityError
from unickpt.spec.hashing import SliceHasher
from unickpt.spec.index import (
    ByteRange,
    LayoutInfo,
    SliceEntry,
    TensorEntry,
    as_listed,
    index_to_json,
    parse_index,
)
from unickpt.spec.naming import SLICED_SENTINEL, shard_name, slice_key
from unickpt.spec.slice_table import SliceColumns, SliceTable
from unickpt.store.publish import referenced_files
from unickpt.tools import merge_checkpoint
from unickpt.tools._torch import full_tensors

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
    _write_index(d, tensors, WORLD)
    m = nn.Module()
    for n in names:
        m.register_buffer(n.replace(".", "_"), torch.zeros(WORLD, 2))
    return _renamed(m, names)


def _write_index(d: Path, tensors: dict[str, TensorEntry], world: int) -> None:
    """The index of a sliced save of ``world`` ranks holding ``tensors``."""
    block = build_block(
        kind="model",
        created_by="test",
        layout=LayoutInfo(world_size=world, gathered=False),
        tensors=tensors,
        aliases={},
        save_id=None,
    )
    (d / "model.safetensors.index.json").write_bytes(index_to_json(build_index(block, sliced=True)))


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


# ---------------------------------------------------------------- a listed index written from its tables
_F1, _F2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
#: A listed index as hand-written: one slice without xxh3, one with a null xxh3 (and a ':' in its
#: key), an empty slice, a 0-d tensor; fields in any order.
_HAND = {
    "metadata": {"total_size": 40},
    "weight_map": {"a": _F1},
    "unickpt": {
        "format_version": 5,
        "kind": "model",
        "tensors": {
            "a": {
                "dtype": "F32",
                "shape": [2, 5],
                "slices": [
                    {"shape": [1, 5], "key": "k0", "file": _F1, "offsets": [0, 0]},
                    {"file": _F2, "key": "k:1", "offsets": [1, 0], "shape": [1, 5], "xxh3": None},
                    {
                        "xxh3": "abcdefabcdef0123",
                        "file": _F2,
                        "key": "k2",
                        "offsets": [2, 0],
                        "shape": [0, 5],
                    },
                ],
            },
            "b": {
                "dtype": "I8",
                "shape": [],
                "slices": [{"file": _F1, "key": "b", "offsets": [], "shape": [], "xxh3": "0000000000000000"}],
            },
        },
    },
}
# What index_to_json wrote for it when it serialised SliceEntry objects (the golden).
_HAND_JSON = (
    '{"metadata":{"total_size":40},"weight_map":{"a":"model-00001-of-00002.safetensors"},"unickpt":'
    '{"format_version":5,"kind":"model","dtype":"F32","created_by":"unickpt","layout":{"plugin":"general",'
    '"world_size":1,"mesh":{},"gathered":true},"aliases":{},"param_state":{},"tensors":{\n'
    '"a":{"shape":[2,5],"slices":[{"file":"model-00001-of-00002.safetensors","key":"k0","offsets":[0,0],'
    '"shape":[1,5]},{"file":"model-00002-of-00002.safetensors","key":"k:1","offsets":[1,0],"shape":[1,5]},'
    '{"file":"model-00002-of-00002.safetensors","key":"k2","offsets":[2,0],"shape":[0,5],'
    '"xxh3":"abcdefabcdef0123"}]},\n'
    '"b":{"dtype":"I8","shape":[],"slices":[{"file":"model-00001-of-00002.safetensors","key":"b",'
    '"offsets":[],"shape":[],"xxh3":"0000000000000000"}]}\n}}}\n'
)
# A writer's tensors with byte-range hashes (listed), a 0-d one among them, and one without ranges
# (written compactly), with the golden of the SliceEntry serialisation.
_RANGED_JSON = (
    '{"metadata":{"total_size":98},"weight_map":{"r":"model-00001-of-00002.safetensors",'
    '"z":"model-00001-of-00002.safetensors","n":"model-00001-of-00002.safetensors"},"unickpt":'
    '{"format_version":5,"kind":"model","dtype":"F32","files":["model-00001-of-00002.safetensors",'
    '"model-00002-of-00002.safetensors"],"created_by":"test","layout":{"plugin":"general","world_size":2,'
    '"mesh":{},"gathered":true},"aliases":{"r2":"r"},"param_state":{},"tensors":{\n'
    '"r":{"shape":[4,6],"fingerprint":"qqqqqqqqqqo","slices":[{"file":"model-00001-of-00002.safetensors",'
    '"key":"r@0","offsets":[0,0],"shape":[2,6],"ranges":[{"start":0,"end":24,"xxh3":"0123456789abcdef"},'
    '{"start":24,"end":48,"xxh3":"fedcba9876543210"}]},{"file":"model-00002-of-00002.safetensors",'
    '"key":"r@1","offsets":[2,0],"shape":[2,6],"xxh3":"00112233445566ff"},'
    '{"file":"model-00002-of-00002.safetensors","key":"r@2","offsets":[4,0],"shape":[0,6]}]},\n'
    '"z":{"dtype":"BF16","shape":[],"slices":[{"file":"model-00001-of-00002.safetensors","key":"zk",'
    '"offsets":[],"shape":[],"ranges":[{"start":0,"end":2,"xxh3":"1111111111111111"}]}]},\n'
    '"n":{"dtype":"F16","shape":[0],"file":0,"xxh3":"IiIiIiIiIiI"}\n}}}\n'
)


def _ranged_index() -> Any:
    cols = SliceColumns("r", (4, 6))
    halves = [
        ByteRange(start=0, end=24, xxh3="0123456789abcdef"),
        ByteRange(start=24, end=48, xxh3="fedcba9876543210"),
    ]
    cols.add(_F1, "r@0", [0, 0], [2, 6], None, halves)
    cols.add(_F2, "r@1", [2, 0], [2, 6], "00112233445566ff")
    cols.add(_F2, "r@2", [4, 0], [0, 6], None)
    r = TensorEntry.of_table("F32", (4, 6), cols.table(), fingerprint="a" * 16)
    cols = SliceColumns("z", ())
    cols.add(_F1, "zk", [], [], None, [ByteRange(start=0, end=2, xxh3="1" * 16)])
    z = TensorEntry.of_table("BF16", (), cols.table())
    cols = SliceColumns("n", (0,))
    cols.add(_F1, "n@0", [0], [0], "2" * 16)
    n = TensorEntry.of_table("F16", (0,), cols.table())
    block = build_block(
        kind="model",
        created_by="test",
        layout=LayoutInfo(world_size=2, gathered=True),
        tensors={"r": r, "z": z, "n": n},
        aliases={"r2": "r"},
        save_id=None,
    )
    return build_index(block, sliced=False)


def test_a_listed_index_is_written_from_its_tables(built: list[int]) -> None:
    """The bytes are those the SliceEntry serialisation wrote: null masks, ranges, empty and 0-d slices."""
    hand = parse_index(json.dumps(_HAND).encode(), "hand.index.json")
    built[0] = 0
    assert index_to_json(hand).decode() == _HAND_JSON
    ranged = _ranged_index()  # (UnickptBlock's validator reads its listed tensors' slices)
    built[0] = 0
    assert index_to_json(ranged).decode() == _RANGED_JSON
    again = parse_index(_RANGED_JSON.encode(), "ranged.index.json")
    assert index_to_json(again).decode() == _RANGED_JSON
    assert built[0] == 0
    # The python form keeps every field (None too), as a SliceEntry's model_dump does.
    a = hand.unickpt.tensors["a"].model_dump()  # type: ignore[union-attr]
    assert a["slices"][0] == {
        "file": _F1,
        "key": "k0",
        "offsets": [0, 0],
        "shape": [1, 5],
        "xxh3": None,
        "ranges": None,
    }
    assert built[0] == 0
    r = ranged.unickpt.tensors["r"].model_dump(exclude_defaults=True)
    assert r["slices"][0]["ranges"][1] == {"start": 24, "end": 48, "xxh3": "fedcba9876543210"}
    assert "xxh3" not in r["slices"][0] and r["slices"][1]["xxh3"] == "00112233445566ff"
    # Once read as SliceEntry objects, the same JSON still.
    assert [
        s.model_dump(mode="json", exclude_none=True) for s in hand.unickpt.tensors["a"].slices
    ] == json.loads(  # type: ignore[union-attr]
        _HAND_JSON
    )["unickpt"]["tensors"]["a"]["slices"]
    assert index_to_json(hand).decode() == _HAND_JSON


def test_a_listed_index_of_1000_slices_round_trips_without_slice_entry(
    tmp_path: Path, built: list[int]
) -> None:
    d = tmp_path / "sliced"
    _sliced(d)
    p = d / "model.safetensors.index.json"
    compact = parse_index(p.read_bytes(), str(p))
    built[0] = 0
    listed = json.dumps(as_listed(json.loads(p.read_bytes()))).encode()
    first = parse_index(listed, "listed.index.json")
    text = index_to_json(first)
    second = parse_index(text, "again.index.json")
    assert index_to_json(second) == text
    assert built[0] == 0
    assert json.loads(text)["unickpt"]["tensors"] == json.loads(listed)["unickpt"]["tensors"]
    for name, t in compact.unickpt.tensors.items():  # type: ignore[union-attr]
        rows = list(t.table.renamed(name).rows())
        assert len(rows) == WORLD
        assert list(second.unickpt.tensors[name].table.rows()) == rows  # type: ignore[union-attr]
    assert built[0] == 0


def test_diff_deep_compares_from_the_tables(
    tmp_path: Path, built: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    """``unickpt diff --deep`` reads both sides' slices from their tables and names the first
    differing element exactly."""
    from unickpt.cli.main import main

    a, b = tmp_path / "a", tmp_path / "b"
    _sliced(a)
    _sliced(b)
    built[0] = 0
    assert main(["diff", "--deep", "--quiet", str(a), str(b)]) == 0
    assert built[0] == 0
    f = b / shard_name("model", 7, WORLD)
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0x01  # the last tensor's element [6, 1]: the low bit of its top byte
    f.write_bytes(bytes(raw))
    capsys.readouterr()
    built[0] = 0
    assert main(["diff", "--deep", "--quiet", str(a), str(b)]) == 1
    assert built[0] == 0
    out = capsys.readouterr().out
    assert "  layer9.weight: 1 of 200 element(s) differ, first at index [6, 1] (flat 13)\n" in out
    assert "changed (1):\n  layer9.weight\n" in out


def test_the_files_a_listed_index_names_are_read_from_its_tables(tmp_path: Path, built: list[int]) -> None:
    """Publishing asks which data files an index names: the listed slices' file column, no ``SliceEntry``."""
    d = tmp_path / "sliced"
    _sliced(d)
    listed = json.dumps(as_listed(json.loads((d / "model.safetensors.index.json").read_bytes()))).encode()
    built[0] = 0
    files = referenced_files(listed)
    assert built[0] == 0
    # The weight_map of a sliced index names the sentinel; the slices name the shards.
    assert files == {SLICED_SENTINEL} | {shard_name("model", r + 1, WORLD) for r in range(WORLD)}


def test_a_load_of_column_slices_and_a_scalar_builds_no_slice_entry(tmp_path: Path, built: list[int]) -> None:
    """Column blocks (not row blocks: read part by part into the tensor) and a 0-d tensor are read by
    file and key from their tables."""
    d = tmp_path / "columns"
    d.mkdir()
    w = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    s = torch.tensor(7.5)
    parts = 3
    cols: dict[str, list[Any]] = {"files": [], "keys": [], "offsets": [], "shapes": [], "hashes": []}
    scalar: dict[str, list[Any]] = {}
    for r in range(parts):
        fname = shard_name("model", r + 1, parts)
        block = w[:, 2 * r : 2 * r + 2].contiguous().numpy().tobytes()
        entries = [(slice_key("w", r), "F32", (4, 2))] + ([(slice_key("s", 0), "F32", ())] if r == 1 else [])
        header, _ = encode_header(entries, {"format": "unickpt-sliced"})
        with open(d / fname, "wb") as f:
            f.write(header + block + (s.numpy().tobytes() if r == 1 else b""))
        for n, data, target, off, shape in [("w", block, cols, [0, 2 * r], [4, 2])] + (
            [("s", s.numpy().tobytes(), scalar, [], [])] if r == 1 else []
        ):
            h = SliceHasher()
            h.update(data)
            for k, v in (("files", fname), ("keys", slice_key(n, 0 if n == "s" else r)), ("offsets", off)):
                target.setdefault(k, []).append(v)
            target.setdefault("shapes", []).append(shape)
            target.setdefault("hashes", []).append(h.hexdigest())
    tensors = {
        "w": TensorEntry.of_table("F32", (4, 6), SliceTable.from_columns("w", (4, 6), **cols)),
        "s": TensorEntry.of_table("F32", (), SliceTable.from_columns("s", (), **scalar)),
    }
    _write_index(d, tensors, parts)
    m = nn.Module()
    m.register_buffer("w", torch.zeros(4, 6))
    m.register_buffer("s", torch.tensor(0.0))
    built[0] = 0
    GeneralCheckpointIO().load_model(m, str(d), verify=True)
    assert built[0] == 0
    assert torch.equal(m.w, w) and torch.equal(m.s, s)


@pytest.mark.parametrize("layout", ["sliced", "gathered"])
@pytest.mark.parametrize(
    "dtype,verify", [(None, True), (None, False), ("bf16", True)], ids=["stream", "copy", "cast"]
)
def test_merge_builds_no_slice_entry(
    tmp_path: Path, built: list[int], layout: str, dtype: str | None, verify: bool
) -> None:
    """Merge's row groups, runs (streamed or copied in the kernel) and bands (a cast) read the
    tables: the output is bit-exact and no ``SliceEntry`` is built."""
    d = tmp_path / layout
    _sliced(d) if layout == "sliced" else _gathered(d)
    with open_checkpoint(d) as r:
        want = full_tensors(r)
    built[0] = 0
    merge_checkpoint(d, tmp_path / "out", dtype=dtype, verify=verify)
    assert built[0] == 0
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(got) == sorted(want)
    for n, v in want.items():
        assert torch.equal(got[n], v.to(torch.bfloat16) if dtype else v), n
