"""Mixture-of-experts checkpoints of the Hub in and out of unickpt, through a weight mapping.

transformers 5 fuses the experts of a layer in memory (Mixtral's ``mlp.experts.gate_up_proj``
of shape [E, 2I, H]) while the Hub keeps one tensor per expert
(``block_sparse_moe.experts.3.w1.weight``). The peer files here are written by transformers'
own ``save_pretrained`` (which reverses its mapping, as the Hub's files are); every comparison
is bit for bit against ``from_pretrained`` of the same files.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers.core_model_loading import (  # noqa: E402
    Chunk,
    Concatenate,
    Interleave,
    MergeModulelist,
    Transpose,
    WeightConverter,
    WeightRenaming,
)

from unickpt import GeneralCheckpointIO, StateMismatchError, merge_checkpoint  # noqa: E402

ARCHS = ["mixtral", "qwen2_moe"]


def _model(arch: str, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    if arch == "mixtral":
        cfg = transformers.MixtralConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=24,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            num_local_experts=4,
            num_experts_per_tok=2,
        )
        return transformers.MixtralForCausalLM(cfg)
    cfg = transformers.Qwen2MoeConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=8,
        shared_expert_intermediate_size=12,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    return transformers.Qwen2MoeForCausalLM(cfg)


def _files(d: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for p in sorted(glob.glob(os.path.join(d, "*.safetensors"))):
        out.update(load_file(p))
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module", params=ARCHS)
def peer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Any]:
    """(arch, the directory save_pretrained wrote, the model it wrote)."""
    arch = request.param
    model = _model(arch)
    d = tmp_path_factory.mktemp(f"hub-{arch}")
    model.save_pretrained(d)
    return arch, d, model


def test_peer_files_have_per_expert_keys(peer: tuple[str, Path, Any]) -> None:
    """The precondition: save_pretrained writes the Hub's per-expert keys, not the fused ones."""
    arch, d, model = peer
    names = set(_files(d))
    assert not any("gate_up_proj" in n for n in names)
    expert = "block_sparse_moe.experts.3.w1.weight" if arch == "mixtral" else "mlp.experts.3.gate_proj.weight"
    assert f"model.layers.1.{expert}" in names
    assert "model.layers.0.mlp.experts.gate_up_proj" in model.state_dict()


def test_hub_checkpoint_loads_bit_exact(peer: tuple[str, Path, Any]) -> None:
    arch, d, _ = peer
    ref = type(_model(arch)).from_pretrained(d)
    live = _model(arch, seed=1)
    report = GeneralCheckpointIO().load_model(live, d)
    assert report.missing == [] and report.unexpected == []
    _same(live.state_dict(), ref.state_dict())
    # Without the mapping the names do not match, as before: nothing is loaded.
    other = _model(arch, seed=2)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(StateMismatchError, match=r"experts\.gate_up_proj"):
        GeneralCheckpointIO().load_model(other, d, mapping=False)
    _same(other.state_dict(), before)


def test_atomic_load_and_verify_through_the_mapping(peer: tuple[str, Path, Any]) -> None:
    arch, d, model = peer
    io = GeneralCheckpointIO(atomic_load=True)
    live = _model(arch, seed=3)
    io.load_model(live, d, verify=True)
    _same(live.state_dict(), model.state_dict())


def test_merge_writes_hub_names_bit_exact(peer: tuple[str, Path, Any], tmp_path: Path) -> None:
    """A trained model saved sliced (fused names) merges into what save_pretrained writes."""
    arch, d, model = peer
    io = GeneralCheckpointIO()
    ck = tmp_path / "ck"
    io.save_model(model, ck, shard=True, gather_dtensor=False)
    assert "model.layers.0.mlp.experts.gate_up_proj@0" in _files(ck)  # stored as the model holds it
    # The sliced checkpoint of fused names still loads as it is (no mapping needed).
    back = _model(arch, seed=4)
    io.load_model(back, ck)
    _same(back.state_dict(), model.state_dict())
    out = tmp_path / "merged"
    merge_checkpoint(ck, out)
    _same(_files(out), _files(d))
    ref = type(model).from_pretrained(out)
    _same(ref.state_dict(), model.state_dict())
    # hub_names=False keeps the names as stored.
    raw = tmp_path / "raw"
    merge_checkpoint(ck, raw, hub_names=False)
    assert "model.layers.0.mlp.experts.gate_up_proj" in _files(raw)


@pytest.mark.parametrize("shard", [False, True])
def test_gathered_save_writes_hub_names_bit_exact(
    peer: tuple[str, Path, Any], tmp_path: Path, shard: bool
) -> None:
    arch, d, model = peer
    io = GeneralCheckpointIO()
    out = tmp_path / "gathered"
    io.save_model(model, out, shard=shard)
    _same(_files(out), _files(d))
    _same(type(model).from_pretrained(out).state_dict(), model.state_dict())
    back = _model(arch, seed=6)
    io.load_model(back, out, verify=True)  # unickpt's own index, Hub names, through the mapping
    _same(back.state_dict(), model.state_dict())
    io.save_model(model, tmp_path / "fused", shard=shard, mapping=False)
    assert "model.layers.0.mlp.experts.gate_up_proj" in _files(tmp_path / "fused")


def test_convert_bin_of_fused_names_writes_hub_names(peer: tuple[str, Path, Any], tmp_path: Path) -> None:
    """``convert --from bin`` of a state dict the model holds (fused experts), with its config.json."""
    from unickpt.tools.convert import convert_checkpoint

    _, d, model = peer
    src = tmp_path / "bin"
    src.mkdir()
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, src / "pytorch_model.bin")
    (src / "config.json").write_bytes((d / "config.json").read_bytes())
    out = tmp_path / "hf"
    convert_checkpoint(src, out, source="bin", target="hf")
    _same(_files(out), _files(d))
    _same(type(model).from_pretrained(out).state_dict(), model.state_dict())


def test_merge_of_hub_names_leaves_them_alone(peer: tuple[str, Path, Any], tmp_path: Path) -> None:
    """A gathered save's output (the Hub's names already) merges unchanged: no renaming twice."""
    _, d, model = peer
    GeneralCheckpointIO().save_model(model, tmp_path / "g", shard=True)
    merge_checkpoint(tmp_path / "g", tmp_path / "m")
    _same(_files(tmp_path / "m"), _files(d))


def test_merge_dtype_cast_through_the_mapping(peer: tuple[str, Path, Any], tmp_path: Path) -> None:
    _, d, model = peer
    ck = tmp_path / "ck"
    GeneralCheckpointIO().save_model(model, ck, shard=True, gather_dtensor=False)
    merge_checkpoint(ck, tmp_path / "bf16", dtype="bf16")
    got = _files(tmp_path / "bf16")
    want = {k: v.to(torch.bfloat16) for k, v in _files(d).items()}
    _same(got, want)


def _drop_key(d: Path, out: Path, name: str, replace: torch.Tensor | None = None) -> None:
    out.mkdir()
    for p in glob.glob(os.path.join(d, "*")):
        if p.endswith(".safetensors"):
            t = load_file(p)
            if replace is None:
                del t[name]
            else:
                t[name] = replace
            save_file(t, out / os.path.basename(p), metadata={"format": "pt"})
        else:
            (out / os.path.basename(p)).write_bytes(Path(p).read_bytes())


def test_missing_expert_key_is_a_clear_mismatch(peer: tuple[str, Path, Any], tmp_path: Path) -> None:
    arch, d, _ = peer
    up = "block_sparse_moe.experts.2.w3.weight" if arch == "mixtral" else "mlp.experts.2.up_proj.weight"
    gone = f"model.layers.0.{up}"
    _drop_key(d, tmp_path / "bad", gone)
    live = _model(arch, seed=1)
    before = {k: v.clone() for k, v in live.state_dict().items()}
    with pytest.raises(StateMismatchError) as ei:
        GeneralCheckpointIO().load_model(live, tmp_path / "bad")
    msg = str(ei.value)
    assert "model.layers.0.mlp.experts.gate_up_proj" in msg
    assert repr(gone) in msg and "found indices [0, 1, 3]" in msg
    _same(live.state_dict(), before)  # nothing loaded


def test_wrong_expert_shape_is_a_clear_mismatch(peer: tuple[str, Path, Any], tmp_path: Path) -> None:
    arch, d, _ = peer
    down = "block_sparse_moe.experts.1.w2.weight" if arch == "mixtral" else "mlp.experts.1.down_proj.weight"
    name = f"model.layers.1.{down}"
    good = _files(d)[name]
    _drop_key(d, tmp_path / "bad", name, replace=torch.zeros(good.shape[0], good.shape[1] + 1))
    with pytest.raises(StateMismatchError) as ei:
        GeneralCheckpointIO().load_model(_model(arch, seed=1), tmp_path / "bad")
    msg = str(ei.value)
    assert "model.layers.1.mlp.experts.down_proj" in msg
    assert repr(name) in msg and str([good.shape[0], good.shape[1] + 1]) in msg and "cannot be stacked" in msg


def test_all_experts_of_a_layer_short_is_a_shape_mismatch(
    peer: tuple[str, Path, Any], tmp_path: Path
) -> None:
    """The last expert gone from every projection: the stack is one short of the model's."""
    arch, d, _ = peer
    names = ["w1", "w2", "w3"] if arch == "mixtral" else ["gate_proj", "up_proj", "down_proj"]
    base = "model.layers.0." + ("block_sparse_moe.experts.3." if arch == "mixtral" else "mlp.experts.3.")
    (tmp_path / "bad").mkdir()
    t = _files(d)
    for n in names:
        del t[base + n + ".weight"]
    save_file(t, tmp_path / "bad" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(StateMismatchError) as ei:
        GeneralCheckpointIO().load_model(_model(arch, seed=1), tmp_path / "bad")
    msg = str(ei.value)
    assert "model.layers.0.mlp.experts.gate_up_proj: the mapping builds shape [3," in msg
    assert "the model has shape [4," in msg


# ---------------------------------------------------------------------------- user-passed ops
# Its own model: the fused, stacked, transposed and interleaved layouts are what the mappings map.
class Fused(torch.nn.Module):
    """A non-transformers model: fused QKV, experts stacked in one parameter, a transposed
    projection, gate and up as two parameters, an interleaved one, a renamed norm."""

    def __init__(self, h: int = 8, e: int = 3) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(h, 3 * h, bias=False)
        self.experts = torch.nn.Parameter(torch.randn(e, 2 * h, h))
        self.proj_t = torch.nn.Parameter(torch.randn(h, 2 * h))
        self.gate = torch.nn.Parameter(torch.randn(h, h))
        self.up = torch.nn.Parameter(torch.randn(h, h))
        self.inter = torch.nn.Parameter(torch.randn(2 * h, h))
        self.norm = torch.nn.LayerNorm(h)


USER_MAPPING = [
    WeightRenaming(r"^old_norm\.", "norm."),
    WeightConverter(["attn.q.weight", "attn.k.weight", "attn.v.weight"], "qkv.weight", [Concatenate(dim=0)]),
    WeightConverter("moe.*.weight", "experts", [MergeModulelist(dim=0)]),
    WeightConverter("proj.weight", "proj_t", [Transpose(0, 1)]),
    WeightConverter("gate_up.weight", ["gate", "up"], [Chunk(dim=0)]),
    WeightConverter("inter_hub.weight", "inter", [Interleave(dim=0)]),
]


def _user_stored(h: int = 8, e: int = 3) -> dict[str, torch.Tensor]:
    torch.manual_seed(5)
    t = {f"attn.{x}.weight": torch.randn(h, h) for x in "qkv"}
    t.update({f"moe.{i}.weight": torch.randn(2 * h, h) for i in range(e)})
    t["proj.weight"] = torch.randn(2 * h, h)
    t["gate_up.weight"] = torch.randn(2 * h, h)
    t["inter_hub.weight"] = torch.randn(2 * h, h)
    t["old_norm.weight"] = torch.randn(h)
    t["old_norm.bias"] = torch.randn(h)
    return t


def test_user_ops_load_and_merge_back(tmp_path: Path) -> None:
    stored = _user_stored()
    (tmp_path / "hub").mkdir()
    save_file(stored, tmp_path / "hub" / "model.safetensors", metadata={"format": "pt"})
    m = Fused()
    report = GeneralCheckpointIO().load_model(m, tmp_path / "hub", mapping=USER_MAPPING)
    assert report.missing == [] and report.unexpected == []
    sd = m.state_dict()
    assert torch.equal(sd["qkv.weight"], torch.cat([stored[f"attn.{x}.weight"] for x in "qkv"]))
    assert torch.equal(sd["experts"], torch.stack([stored[f"moe.{i}.weight"] for i in range(3)]))
    assert torch.equal(sd["proj_t"], stored["proj.weight"].T)
    assert torch.equal(sd["gate"], stored["gate_up.weight"][:8]) and torch.equal(
        sd["up"], stored["gate_up.weight"][8:]
    )
    # Interleave as transformers' own op computes it.
    want = Interleave(dim=0).convert({"x": stored["inter_hub.weight"]}, ["x"], ["inter"])["inter"]
    assert torch.equal(sd["inter"], want)
    assert torch.equal(sd["norm.weight"], stored["old_norm.weight"])
    # Saved as the model holds it, merged back through the same mapping reversed: the stored names.
    ck = tmp_path / "ck"
    GeneralCheckpointIO().save_model(m, ck, shard=True, gather_dtensor=False)
    merge_checkpoint(ck, tmp_path / "back", mapping=USER_MAPPING)
    _same(_files(tmp_path / "back"), stored)
    GeneralCheckpointIO().save_model(m, tmp_path / "gathered", mapping=USER_MAPPING)
    _same(_files(tmp_path / "gathered"), stored)


def test_user_mapping_reads_only_the_experts_a_box_needs(tmp_path: Path) -> None:
    """A box of the stacked experts (as an FSDP rank holds it) reads only those experts' bytes."""
    from unickpt.ckpt.reader import open_checkpoint
    from unickpt.io.load import box_fetcher
    from unickpt.io.mapping import plan_load

    stored = _user_stored()
    save_file(stored, tmp_path / "model.safetensors", metadata={"format": "pt"})
    reader = open_checkpoint(str(tmp_path), "model")
    shapes = {n: (e.dtype, tuple(e.shape)) for n, e in reader.tensors.items()}
    lp = plan_load(USER_MAPPING, shapes, {"experts": (3, 16, 8), "qkv.weight": (24, 8)})
    assert lp.problems == []
    node = lp.built["experts"]
    reads: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
    fetch, close = box_fetcher(reader)

    def counting(name: str, off: tuple[int, ...], shp: tuple[int, ...]) -> torch.Tensor:
        reads.append((name, off, shp))
        return fetch(name, off, shp)

    try:
        got = node.build((1, 0, 0), (2, 16, 8), counting)
        assert reads == [("moe.1.weight", (0, 0), (16, 8)), ("moe.2.weight", (0, 0), (16, 8))]
        assert torch.equal(got, torch.stack([stored["moe.1.weight"], stored["moe.2.weight"]]))
        reads.clear()
        # Rows 8..15 of the fused QKV: the k projection alone.
        got = lp.built["qkv.weight"].build((8, 0), (8, 8), counting)
        assert reads == [("attn.k.weight", (0, 0), (8, 8))]
        assert torch.equal(got, stored["attn.k.weight"])
    finally:
        close()
        reader.close()


def _no_assembly(monkeypatch: pytest.MonkeyPatch) -> None:
    """A load through a mapping never builds a live box from whole pieces (no stack, no cat)."""
    from unickpt.io import mapping

    def refuse(*a: Any, **k: Any) -> Any:
        raise AssertionError("a mapped load assembled a box")

    for node in (mapping.Stack, mapping.Cat, mapping.Narrow, mapping.Swap, mapping.Interleave, mapping.Leaf):
        monkeypatch.setattr(node, "build", refuse)


@pytest.mark.parametrize("atomic", [False, True])
def test_mapped_loads_reuse_the_pooled_host_buffers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, atomic: bool
) -> None:
    """In place, every stored box of a mapped target goes through the load's two host buffers of
    the pool (bounded by the largest box, whatever the count of experts) and its parts are copied
    where they land; atomically onto a device, the boxes are staged in exact-size pool buffers,
    handed back after the copy and reused by the next load. On CPU the device step is a copy:
    ``off_host`` is made to call a CPU tensor a device one so that the device's code runs."""
    from unickpt.io import load as load_mod
    from unickpt.io.pinned import POOL

    e, h = 6, 8
    stored = _user_stored(h, e)
    save_file(stored, tmp_path / "model.safetensors", metadata={"format": "pt"})
    _no_assembly(monkeypatch)
    POOL.release()
    if atomic:
        monkeypatch.setattr(load_mod, "off_host", lambda t: t.device.type != "meta")
    try:
        for _ in range(2):  # the second load allocates nothing
            before = POOL.allocations
            m = Fused(h, e)
            GeneralCheckpointIO(atomic_load=atomic).load_model(m, tmp_path, mapping=USER_MAPPING)
            sd = m.state_dict()
            assert torch.equal(sd["experts"], torch.stack([stored[f"moe.{i}.weight"] for i in range(e)]))
            assert torch.equal(sd["qkv.weight"], torch.cat([stored[f"attn.{x}.weight"] for x in "qkv"]))
            assert torch.equal(sd["proj_t"], stored["proj.weight"].T)
            assert torch.equal(sd["up"], stored["gate_up.weight"][h:])
            want = Interleave(dim=0).convert({"x": stored["inter_hub.weight"]}, ["x"], ["inter"])["inter"]
            assert torch.equal(sd["inter"], want)
            sets = {s.tag: s for s in POOL.sets()}
            assert not any(s.leased for s in sets.values())  # handed back after the copy
            largest = max(t.numel() * 4 for t in stored.values())
            if atomic:  # exact sizes: the bytes of every stored box the targets are made of, once
                assert sets["load-staged"].nbytes == sum(t.numel() * 4 for t in stored.values())
            else:  # two buffers, none larger than the largest box
                held = sets["load"]
                assert len(held) <= 2 and held.nbytes <= 2 * largest, (len(held), held.nbytes)
            if _:
                assert POOL.allocations == before
    finally:
        POOL.release()


_MEASURE_MAPPED = """
import json, sys, torch
from transformers.core_model_loading import MergeModulelist, WeightConverter
from unickpt import GeneralCheckpointIO

def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) * 1024

class Stacked(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = torch.nn.Parameter(torch.empty(8, 1024, 512))  # 16 MiB, 2 MiB an expert

mapping = [WeightConverter("moe.*.weight", "experts", [MergeModulelist(dim=0)])]
m = Stacked()
GeneralCheckpointIO().load_model(m, sys.argv[1], mapping=mapping)
m2 = Stacked()
with torch.no_grad():
    m2.experts.fill_(1.0)  # its pages resident before the measure
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base = hwm()
GeneralCheckpointIO().load_model(m2, sys.argv[1], mapping=mapping)
assert torch.equal(m.experts, m2.experts)
print(json.dumps({"added": hwm() - base}))
"""


def test_a_mapped_load_holds_the_largest_stored_box_not_the_sum(tmp_path: Path) -> None:
    """Eight stored experts loaded into one stacked parameter: the load holds its host buffers
    (two, each at most one expert), never the stacked tensor nor the experts all at once."""
    import json
    import subprocess
    import sys

    torch.manual_seed(0)
    save_file(
        {f"moe.{i}.weight": torch.randn(1024, 512) for i in range(8)},
        tmp_path / "model.safetensors",
        metadata={"format": "pt"},
    )
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE_MAPPED, str(tmp_path)], capture_output=True, text=True, check=True
    )
    added = json.loads(out.stdout)["added"]
    assert added < 0.3 * (16 << 20), added  # the sum is 16 MiB; two experts 4 MiB


def test_bad_mapping_argument_is_a_config_error(tmp_path: Path) -> None:
    from unickpt.errors import ConfigError

    save_file(_user_stored(), tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="not a transformers WeightRenaming or WeightConverter"):
        GeneralCheckpointIO().load_model(Fused(), tmp_path, mapping=[("attn.q.weight", "qkv.weight")])
    with pytest.raises(ConfigError, match="mapping must be None, False or a list"):
        GeneralCheckpointIO().load_model(Fused(), tmp_path, mapping="mixtral")


def _rename_key(d: Path, out: Path, old: str, new: str) -> None:
    out.mkdir()
    for p in glob.glob(os.path.join(d, "*")):
        if p.endswith(".safetensors"):
            t = load_file(p)
            save_file(
                {new if k == old else k: v for k, v in t.items()},
                out / os.path.basename(p),
                metadata={"format": "pt"},
            )
        elif not p.endswith(".index.json"):
            (out / os.path.basename(p)).write_bytes(Path(p).read_bytes())


@pytest.mark.parametrize("index", ["1000000000000", "9" * 5000, "\u00b2", "3" * 19])
def test_a_hostile_expert_index_is_a_clear_mismatch(
    peer: tuple[str, Path, Any], tmp_path: Path, index: str
) -> None:
    """An expert index in a name is the checkpoint's claim: one of 10^12 names the experts it lacks
    without walking (or allocating) 10^12 of anything, and one no int() reads (5,000 digits, a
    superscript digit, 19 digits) is a name like any other, unexpected: in seconds, nothing loaded."""
    import time

    arch, d, _ = peer
    expert = (
        "block_sparse_moe.experts.{}.w1.weight" if arch == "mixtral" else "mlp.experts.{}.gate_proj.weight"
    )
    old, new = f"model.layers.1.{expert.format(3)}", f"model.layers.1.{expert.format(index)}"
    _rename_key(d, tmp_path / "bad", old, new)
    live = _model(arch, seed=1)
    before = {k: v.clone() for k, v in live.state_dict().items()}
    start = time.monotonic()
    with pytest.raises(StateMismatchError) as ei:
        GeneralCheckpointIO().load_model(live, tmp_path / "bad")
    assert time.monotonic() - start < 10.0
    msg = str(ei.value)
    assert len(msg) < 6000, len(msg)
    if index == "1000000000000":
        assert f"(indices 0..{index} of " in msg and "found indices [0, 1, 2, 1000000000000]" in msg
    else:  # the layer's other experts are then unexpected too, the renamed one among them
        assert "found indices [0, 1, 2]" in msg and "in the checkpoint but not in the model (" in msg
        assert index[:50] in msg
    _same(live.state_dict(), before)


def test_a_fused_tensor_of_a_billion_empty_experts_is_refused_not_split(tmp_path: Path) -> None:
    """A fused experts tensor claims its expert count in its shape: [10^9, 0, H] holds no byte, and
    its merge to Hub names would make 2 x 10^9 tensors. Refused in bounded time, naming the
    tensor, the shape and the limit; nothing is written. At the limit it merges."""
    import time

    from unickpt.errors import UnsupportedError
    from unickpt.io.mapping import MAX_SPLIT_PARTS

    for experts in (10**9, MAX_SPLIT_PARTS + 1):
        m = _model("mixtral")
        layer = m.model.layers[0].mlp.experts
        layer.gate_up_proj = torch.nn.Parameter(torch.zeros((experts, 0, layer.gate_up_proj.shape[2])))
        ck = tmp_path / f"ck-{experts}"
        GeneralCheckpointIO().save_model(m, ck, shard=True, gather_dtensor=False)
        start = time.monotonic()
        with pytest.raises(UnsupportedError) as ei:
            merge_checkpoint(ck, tmp_path / f"out-{experts}")
        assert time.monotonic() - start < 10.0
        msg = str(ei.value)
        assert msg.startswith("model.layers.0.mlp.experts.*.w1.weight (WeightConverter")
        assert (
            f"splitting a tensor of shape [{experts}, 0, 16] along dim 0 would make {experts} tensors; "
            in msg
        )
        assert f"a mapping makes at most {MAX_SPLIT_PARTS} of one" in msg
        assert not (tmp_path / f"out-{experts}").exists()
    m = _model("mixtral")
    layer = m.model.layers[0].mlp.experts
    layer.gate_up_proj = torch.nn.Parameter(torch.zeros((MAX_SPLIT_PARTS, 0, layer.gate_up_proj.shape[2])))
    GeneralCheckpointIO().save_model(m, tmp_path / "ck", shard=True, gather_dtensor=False)
    merge_checkpoint(tmp_path / "ck", tmp_path / "out")
    got = _files(tmp_path / "out")
    assert got[f"model.layers.0.block_sparse_moe.experts.{MAX_SPLIT_PARTS - 1}.w1.weight"].shape == (0, 16)


def test_a_config_of_a_million_layers_is_refused_while_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """config.json's sizes are the file's claim: its architecture is built on the meta device (for its
    names and mapping) only up to MAX_META_MODULES submodules, then refused, naming the file and the
    way around; nothing is written. The real config builds (and merges) under the same limit."""
    import json
    import time

    from unickpt.errors import CheckpointFormatError
    from unickpt.io import mapping

    model = _model("mixtral")
    ck = tmp_path / "ck"
    GeneralCheckpointIO().save_model(model, ck, shard=True, gather_dtensor=False)
    monkeypatch.setattr(mapping, "MAX_META_MODULES", 1000)  # the real 2-layer config registers far fewer
    merge_checkpoint(ck, tmp_path / "ok")
    cfg = json.loads((ck / "config.json").read_text())
    cfg["num_hidden_layers"] = 10**6
    (ck / "config.json").write_text(json.dumps(cfg))
    start = time.monotonic()
    with pytest.raises(CheckpointFormatError) as ei:
        merge_checkpoint(ck, tmp_path / "out")
    assert time.monotonic() - start < 10.0
    assert str(ei.value).startswith(
        "config.json: its architecture 'MixtralForCausalLM' registered more than 1000 modules"
    )
    assert str(ei.value).endswith("refused: correct the config, or remove it")
    assert not (tmp_path / "out").exists()
    (ck / "config.json").unlink()  # the way around: without it, the names as stored
    merge_checkpoint(ck, tmp_path / "raw")
