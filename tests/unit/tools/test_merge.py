"""unickpt merge: every layout rebuilt bit for bit into a plain Hugging Face checkpoint."""

from __future__ import annotations

import itertools
import json
import math
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from unickpt import GeneralCheckpointIO, IntegrityError, merge_checkpoint
from unickpt.ckpt.reader import open_checkpoint
from unickpt.ckpt.safetensors_io import read_header
from unickpt.errors import IndexFileError
from unickpt.spec.boxes import flat_range_to_boxes
from unickpt.spec.dtypes import itemsize
from unickpt.spec.hashing import fingerprint_of_array
from unickpt.spec.index import load_index
from unickpt.spec.naming import SLICED_SENTINEL
from unickpt.tools._common import OutputExistsError
from unickpt.tools._write import SliceData, TensorData, write_checkpoint

RNG = np.random.default_rng(1234)


def _rand(dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Random raw words of ``dtype`` (any bit pattern, so NaN payloads must survive too)."""
    n = math.prod(shape)
    if dtype == "BOOL":
        return RNG.integers(0, 2, size=n, dtype=np.uint8).reshape(shape)
    isz = itemsize(dtype)
    return RNG.integers(0, 256, size=n * isz, dtype=np.uint8).view(f"<u{isz}").reshape(shape)


def _box(arr: np.ndarray, off: tuple[int, ...], shp: tuple[int, ...]) -> np.ndarray:
    return np.ascontiguousarray(arr[tuple(slice(o, o + n) for o, n in zip(off, shp, strict=True))])


def _tensor(dtype: str, arr: np.ndarray, boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> TensorData:
    return TensorData(dtype, arr.shape, [SliceData(o, s, _box(arr, o, s)) for o, s in boxes])


def _rows(shape: tuple[int, ...], cuts: list[int]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    edges = [0, *cuts, shape[0]]
    return [((a,) + (0,) * (len(shape) - 1), (b - a, *shape[1:])) for a, b in itertools.pairwise(edges)]


def _flat(shape: tuple[int, ...], parts: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    total = math.prod(shape)
    step = -(-total // parts)
    out = []
    for p in range(parts):
        for box, _ in flat_range_to_boxes(shape, min(total, p * step), min(total, (p + 1) * step)):
            out.append(box)
    return out


def hand_made_reference() -> tuple[dict[str, TensorData], dict[str, tuple[str, np.ndarray]]]:
    ref: dict[str, tuple[str, np.ndarray]] = {}
    tensors: dict[str, TensorData] = {}

    def add(
        name: str, dtype: str, shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]
    ) -> None:
        arr = _rand(dtype, shape)
        ref[name] = (dtype, arr)
        tensors[name] = _tensor(dtype, arr, boxes)

    add("col.weight", "F32", (6, 10), [((0, 0), (6, 3)), ((0, 3), (6, 3)), ((0, 6), (6, 4))])
    add("rows.uneven", "BF16", (33, 5), _rows((33, 5), [9, 18, 27]))
    add("rows.empty_rank", "F16", (3, 4), [((0, 0), (2, 4)), ((2, 0), (1, 4)), ((3, 0), (0, 4))])
    add("grid.2d", "F32", (7, 9), [((0, 0), (4, 5)), ((0, 5), (4, 4)), ((4, 0), (3, 5)), ((4, 5), (3, 4))])
    add("zero.flat3d", "F32", (5, 3, 7), _flat((5, 3, 7), 4))
    add("zero.flat1d", "I64", (11,), _flat((11,), 3))
    add("scalar", "F32", (), [((), ())])
    add("empty", "F32", (0, 4), [((0, 0), (0, 4))])
    add("mask", "BOOL", (4, 6), [((0, 0), (4, 2)), ((0, 2), (4, 4))])
    add("fp8.e4m3", "F8_E4M3", (8, 8), _rows((8, 8), [3]))
    add("fp8.e5m2", "F8_E5M2", (4, 6), [((0, 0), (4, 1)), ((0, 1), (4, 5))])
    add("int8.q", "I8", (3, 3, 3), [((0, 0, 0), (3, 3, 1)), ((0, 0, 1), (3, 3, 2))])
    return tensors, ref


def _check_merged(out: Path, ref: dict[str, tuple[str, np.ndarray]]) -> None:
    """Every tensor of the merged checkpoint equals ``ref`` byte for byte, read by the strict reader."""
    r = open_checkpoint(out)
    r.validate_structure()
    assert r.verify() == []
    assert set(r.tensors) == set(ref)
    for name, (dtype, arr) in ref.items():
        t = r.tensors[name]
        assert t.dtype == dtype and t.shape == list(arr.shape)
        assert len(t.slices) == 1 and t.slices[0].key == name
        got = bytes(r.read_key(t.table.file(0), t.table.key(0))) if arr.size else b""
        assert got == arr.tobytes(), name
        assert t.fingerprint == fingerprint_of_array(name, dtype, arr.tobytes(), list(arr.shape))
    r.close()


@pytest.mark.parametrize("files", [1, 3])
def test_hand_made_slices_merge_bit_exact(tmp_path: Path, files: int) -> None:
    tensors, ref = hand_made_reference()
    src = tmp_path / "src"
    write_checkpoint(str(src), tensors, sliced=True, files=files)
    out = tmp_path / "out"
    assert merge_checkpoint(src, out) == str(out)
    assert sorted(os.listdir(out)) == ["model.safetensors"]
    _check_merged(out, ref)
    h = read_header(out / "model.safetensors")
    assert h.metadata["format"] == "pt"
    # safetensors' own reader agrees for every dtype torch knows.
    sd = load_file(out / "model.safetensors")
    for name, (_dtype, arr) in ref.items():
        raw = sd[name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if arr.size else b""
        assert raw == arr.tobytes()


def test_no_verify_and_sharded_output(tmp_path: Path) -> None:
    tensors, ref = hand_made_reference()
    src = tmp_path / "src"
    write_checkpoint(str(src), tensors, sliced=True, files=2)
    out = tmp_path / "out"
    merge_checkpoint(src, out, max_shard_size=400, verify=False)
    files = sorted(os.listdir(out))
    assert "model.safetensors.index.json" in files
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 1 and all(f.startswith("model-0000") for f in shards)
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(idx["weight_map"]) == set(ref)
    assert idx["metadata"]["total_size"] == sum(a.nbytes for _, a in ref.values())
    _check_merged(out, ref)


def test_gathered_source_copy_file_range_path(tmp_path: Path) -> None:
    _tensors, ref = hand_made_reference()
    whole = {n: TensorData(d, a.shape, [SliceData((0,) * a.ndim, a.shape, a)]) for n, (d, a) in ref.items()}
    src = tmp_path / "src"
    write_checkpoint(str(src), whole, sliced=False, files=2)
    for verify in (True, False):
        out = tmp_path / f"out{verify}"
        merge_checkpoint(src, out, verify=verify)
        _check_merged(out, ref)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Embedding(11, 6),
        torch.nn.Linear(6, 9),
        torch.nn.BatchNorm1d(9),
        torch.nn.Linear(9, 3, bias=False),
    )
    m[2].running_mean.uniform_()
    m[1].to(torch.bfloat16)
    return m


@pytest.mark.parametrize("shard,gather", [(False, True), (True, True), (False, False), (True, False)])
def test_every_generalio_layout_merges(tmp_path: Path, shard: bool, gather: bool) -> None:
    import huggingface_hub

    m = _model()
    src = tmp_path / "ckpt"
    GeneralCheckpointIO().save_model(m, src, shard=shard, gather_dtensor=gather, size_per_shard=1)
    out = tmp_path / "merged"
    merge_checkpoint(src, out)
    sd = load_file(out / "model.safetensors")
    ref = m.state_dict()
    assert set(sd) == set(ref)
    for k, v in ref.items():
        assert sd[k].dtype == v.dtype and torch.equal(
            sd[k].view(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)
        ), k
    fresh = _model()
    for p in fresh.parameters():
        p.data.zero_()
    huggingface_hub.load_torch_model(fresh, str(out))
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, ref[k])


def test_tied_weights_stay_aliases(tmp_path: Path) -> None:
    emb = torch.nn.Embedding(5, 4)
    head = torch.nn.Linear(4, 5, bias=False)
    head.weight = emb.weight
    m = torch.nn.ModuleDict({"emb": emb, "head": head})
    src = tmp_path / "ckpt"
    GeneralCheckpointIO().save_model(m, src, shard=True, gather_dtensor=False)
    out = tmp_path / "merged"
    merge_checkpoint(src, out)
    r = open_checkpoint(out)
    assert r.block.aliases == {"head.weight": "emb.weight"}
    assert torch.equal(load_file(out / "model.safetensors")["emb.weight"], emb.weight.detach())


def test_dtype_cast(tmp_path: Path) -> None:
    tensors, ref = hand_made_reference()
    src = tmp_path / "src"
    write_checkpoint(str(src), tensors, sliced=True, files=2)
    out = tmp_path / "out"
    merge_checkpoint(src, out, dtype="bf16")
    sd = load_file(out / "model.safetensors")
    r = open_checkpoint(out)
    assert r.verify() == []
    for name, (dtype, arr) in ref.items():
        if dtype in ("F32", "F16", "BF16"):
            src_t = torch.from_numpy(arr.copy().reshape(-1)).view(
                {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[dtype]
            )
            expect = src_t.to(torch.bfloat16).reshape(arr.shape)
            assert sd[name].dtype == torch.bfloat16
            assert torch.equal(sd[name].view(torch.int16), expect.view(torch.int16)), name
            raw = expect.reshape(-1).view(torch.uint8).numpy().tobytes()
            assert r.tensors[name].fingerprint == fingerprint_of_array(name, "BF16", raw, list(arr.shape))
        else:
            assert r.tensors[name].dtype == dtype
    with pytest.raises(TypeError):
        merge_checkpoint(src, tmp_path / "bad", dtype="int4")


def test_corrupted_slice_fails_naming_tensor_and_leaves_no_output(tmp_path: Path) -> None:
    tensors, _ = hand_made_reference()
    src = tmp_path / "src"
    write_checkpoint(str(src), tensors, sliced=True, files=2)
    r = open_checkpoint(src)
    s = r.tensors["zero.flat3d"].slices[2]
    path, off, n = r.key_location(s.file, s.key)
    r.close()
    with open(path, "r+b") as f:
        f.seek(off + n // 2)
        b = f.read(1)
        f.seek(off + n // 2)
        f.write(bytes([b[0] ^ 0x10]))
    out = tmp_path / "out"
    with pytest.raises(IntegrityError) as ei:
        merge_checkpoint(src, out)
    assert ei.value.tensor == "zero.flat3d" and ei.value.file == s.file
    assert "zero.flat3d" in str(ei.value)
    assert not out.exists()
    assert [p for p in os.listdir(tmp_path) if p.startswith(".out")] == []
    # Without verification the (corrupt) bytes are copied as they are.
    merge_checkpoint(src, out, verify=False)
    assert out.exists()


def test_column_corruption_detected(tmp_path: Path) -> None:
    tensors, _ = hand_made_reference()
    src = tmp_path / "src"
    write_checkpoint(str(src), tensors, sliced=True)
    r = open_checkpoint(src)
    s = r.tensors["col.weight"].slices[1]
    path, off, _ = r.key_location(s.file, s.key)
    r.close()
    with open(path, "r+b") as f:
        f.seek(off)
        f.write(b"\xff\xff\xff\xff")
    with pytest.raises(IntegrityError, match=r"col\.weight"):
        merge_checkpoint(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_gap_in_slices_refused(tmp_path: Path) -> None:
    arr = _rand("F32", (6, 4))
    src = tmp_path / "src"
    write_checkpoint(str(src), {"w": _tensor("F32", arr, [((0, 0), (2, 4)), ((3, 0), (3, 4))])})
    with pytest.raises(IndexFileError, match="missing"):
        merge_checkpoint(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_existing_output_refused(tmp_path: Path) -> None:
    tensors, ref = hand_made_reference()
    src = tmp_path / "src"
    write_checkpoint(str(src), tensors)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    with pytest.raises(OutputExistsError):
        merge_checkpoint(src, tmp_path / "full")
    assert (tmp_path / "full" / "x").read_text() == "keep me"
    (tmp_path / "empty").mkdir()
    merge_checkpoint(src, tmp_path / "empty")
    _check_merged(tmp_path / "empty", ref)


def test_optimizer_merge(tmp_path: Path) -> None:
    from unickpt import OptimizerWrapper

    m = _model().float()
    opt = torch.optim.AdamW(
        [{"params": list(m[0].parameters()), "lr": 0.1}, {"params": list(m[1:].parameters())}]
    )
    m(torch.tensor([1, 2, 3])).sum().backward()
    opt.step()
    io = GeneralCheckpointIO()
    src = tmp_path / "ckpt"
    io.save_model(m, src, shard=True, gather_dtensor=False)
    io.save_optimizer(OptimizerWrapper(opt, m), src, shard=True, gather_dtensor=False)
    out = tmp_path / "merged"
    merge_checkpoint(src, out, optimizer=True)
    assert {"model.safetensors", "optimizer.safetensors"} <= set(os.listdir(out))
    ro = open_checkpoint(out, "optimizer")
    assert ro.verify() == []
    src_r = open_checkpoint(src, "optimizer")
    assert ro.block.param_groups == src_r.block.param_groups
    assert {n: t.fingerprint for n, t in ro.tensors.items()} == {
        n: t.fingerprint for n, t in src_r.tensors.items()
    }
    osd = load_file(out / "optimizer.safetensors")
    st = opt.state[m[1].weight]
    assert torch.equal(osd["state.1.weight.exp_avg"], st["exp_avg"])
    # The merged optimizer checkpoint loads back through the normal API (into a stepped optimizer:
    # see test_core_load_optimizer_into_fresh_optimizer for the fresh case).
    opt2 = torch.optim.AdamW([{"params": list(m[0].parameters())}, {"params": list(m[1:].parameters())}])
    m(torch.tensor([1, 2, 3])).sum().backward()
    opt2.step()
    io.load_optimizer(OptimizerWrapper(opt2, m), out)
    assert torch.equal(opt2.state[m[1].weight]["exp_avg_sq"], st["exp_avg_sq"])
    assert opt2.param_groups[0]["lr"] == 0.1


def test_merged_index_entries_match_plain_hf(tmp_path: Path) -> None:
    tensors, _ = hand_made_reference()
    src = tmp_path / "src"
    write_checkpoint(str(src), tensors, sliced=True, files=2)
    out = tmp_path / "out"
    merge_checkpoint(src, out, max_shard_size=300)
    idx = load_index(out / "model.safetensors.index.json")
    assert idx.unickpt is not None and idx.unickpt.layout.gathered
    for name, f in idx.weight_map.items():
        assert name in read_header(out / f).entries


def test_core_load_optimizer_into_fresh_optimizer(tmp_path: Path) -> None:
    from unickpt import OptimizerWrapper

    m = _model().float()
    opt = torch.optim.AdamW(m.parameters())
    m(torch.tensor([1, 2, 3])).sum().backward()
    opt.step()
    io = GeneralCheckpointIO()
    io.save_optimizer(OptimizerWrapper(opt, m), tmp_path / "o", shard=True, gather_dtensor=False)
    opt2 = torch.optim.AdamW(m.parameters())
    io.load_optimizer(OptimizerWrapper(opt2, m), tmp_path / "o")
    assert torch.equal(opt2.state[m[1].weight]["exp_avg"], opt.state[m[1].weight]["exp_avg"])


def test_tiny_llama_sliced_merge_from_pretrained_same_logits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    src = tmp_path / "sliced"
    GeneralCheckpointIO().save_model(model, src, shard=True, gather_dtensor=False, size_per_shard=1)
    assert (src / "config.json").exists()
    # Before the merge, transformers refuses the sliced checkpoint, naming what to do.
    with pytest.raises(OSError, match=re.escape(SLICED_SENTINEL)):
        transformers.LlamaForCausalLM.from_pretrained(str(src))
    out = tmp_path / "hf"
    merge_checkpoint(src, out)
    loaded = transformers.LlamaForCausalLM.from_pretrained(str(out)).eval()
    ids = torch.tensor([[1, 5, 9, 33, 2]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


@pytest.mark.parametrize("max_shard_size", ["5GB", 400])
def test_merge_writes_as_the_output_storage_can(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, max_shard_size: int | str
) -> None:
    """The strategy comes from the output storage's ``range_write``, not from the sink's type: a
    local output whose storage cannot write at offsets is streamed (a sharded output's save id
    fixed up front, a single file written aside and copied in), with the same tensors, and the
    same bytes for a single file."""
    from unickpt.store.storage import LocalStorage

    tensors, ref = hand_made_reference()
    src = tmp_path / "src"
    write_checkpoint(str(src), tensors, sliced=True, files=2)
    merge_checkpoint(src, tmp_path / "in_place", max_shard_size=max_shard_size)
    monkeypatch.setattr(LocalStorage, "range_write", False)
    merge_checkpoint(src, tmp_path / "streamed", max_shard_size=max_shard_size)
    monkeypatch.undo()
    _check_merged(tmp_path / "streamed", ref)
    names = sorted(os.listdir(tmp_path / "in_place"))
    assert sorted(os.listdir(tmp_path / "streamed")) == names
    same = [
        (tmp_path / "in_place" / n).read_bytes() == (tmp_path / "streamed" / n).read_bytes() for n in names
    ]
    # a single file: its header rewritten in place, or written aside and copied in, is the same;
    # sharded, the streamed files carry the save id fixed before they were written
    assert same == ([True] if max_shard_size == "5GB" else [False] * len(names))
