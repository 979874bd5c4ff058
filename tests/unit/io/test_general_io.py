"""Single-process CheckpointIO: the four layouts, dtypes, ties, optimizer, strictness, HF compatibility."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file

from unickpt import (
    GeneralCheckpointIO,
    IncompleteCheckpointError,
    IntegrityError,
    OptimizerWrapper,
    StateMismatchError,
    UnsafePathError,
    UnsupportedError,
)
from unickpt.ckpt.reader import open_checkpoint

LAYOUTS = [(False, True), (True, True), (False, False), (True, False)]  # (shard, gather_dtensor)


# Its own model, not the shared ones: what these tests check is its shape (a tied head, a
# BatchNorm's buffers, a 0-dim, an empty and a non-persistent buffer).
class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.proj = nn.Linear(6, 33)
        self.bn = nn.BatchNorm1d(33)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.register_buffer("scale", torch.tensor(0.5))  # 0-dim buffer
        self.register_buffer("empty", torch.zeros(0, 3))
        self.register_buffer("tmp", torch.ones(2), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.proj(self.emb(x))) * self.scale


def fresh(seed: int) -> Tiny:
    torch.manual_seed(seed)
    m = Tiny()
    with torch.no_grad():
        m.bn.running_mean.uniform_()
        m.bn.num_batches_tracked.fill_(seed + 3)
    return m


def assert_same(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype, k
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize(("shard", "gather"), LAYOUTS)
def test_four_layouts_round_trip(tmp_path: Path, shard: bool, gather: bool) -> None:
    io = GeneralCheckpointIO()
    src = fresh(0)
    out = io.save_model(src, tmp_path / "ck", shard=shard, gather_dtensor=gather, size_per_shard=0.001)
    dst = fresh(1)
    report = io.load_model(dst, out, verify=True)
    assert_same(src, dst)
    assert dst.head.weight is dst.emb.weight
    assert report.missing == [] and report.unexpected == []
    r = open_checkpoint(out)
    assert r.block.aliases == {"head.weight": "emb.weight"}
    assert r.block.layout.gathered is gather
    assert r.verify() == []
    if shard:
        assert len(r.files) > 1


def test_layout_detection_and_fingerprints_agree(tmp_path: Path) -> None:
    io = GeneralCheckpointIO()
    src = fresh(0)
    fps = []
    for i, (shard, gather) in enumerate(LAYOUTS):
        out = io.save_model(src, tmp_path / f"c{i}", shard=shard, gather_dtensor=gather, size_per_shard=0.001)
        fps.append({n: t.fingerprint for n, t in open_checkpoint(out).tensors.items()})
    assert all(fp == fps[0] for fp in fps)
    assert all(v is not None for v in fps[0].values())


def test_gathered_sharded_is_a_hugging_face_checkpoint(tmp_path: Path) -> None:
    from huggingface_hub import load_torch_model

    src = fresh(0)
    out = GeneralCheckpointIO().save_model(src, tmp_path / "hf", shard=True, size_per_shard=0.001)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] > 0
    files = sorted(set(index["weight_map"].values()))
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    merged: dict[str, torch.Tensor] = {}
    for f in files:
        merged.update(load_file(os.path.join(out, f)))
    assert torch.equal(merged["proj.weight"], src.proj.weight)
    dst = fresh(1)
    load_torch_model(dst, out, strict=False)
    assert torch.equal(dst.proj.weight, src.proj.weight)
    assert torch.equal(dst.bn.running_mean, src.bn.running_mean)


def test_sliced_checkpoint_fails_loudly_in_hugging_face_loaders(tmp_path: Path) -> None:
    from huggingface_hub import load_torch_model

    out = GeneralCheckpointIO().save_model(fresh(0), tmp_path / "s", shard=True, gather_dtensor=False)
    with pytest.raises(FileNotFoundError, match="run-unickpt-merge"):
        load_torch_model(fresh(1), out)
    raw = load_file(os.path.join(out, "model-00001-of-00001.safetensors"))
    assert "proj.weight" not in raw and "proj.weight@0" in raw


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.int8,
        torch.uint8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
    ],
)
def test_every_dtype_round_trips_bit_exactly(tmp_path: Path, dtype: torch.dtype) -> None:
    # The tensor under test in three layouts (plain, non-contiguous, 0-dim), one dtype each case.
    class Holder(nn.Module):
        def __init__(self, t: torch.Tensor) -> None:
            super().__init__()
            self.register_buffer("t", t)
            self.register_buffer("nc", t.t())  # non-contiguous
            self.register_buffer("s", t[0, 0].clone())  # 0-dim

    g = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 255, (5, 7), generator=g, dtype=torch.uint8)
    itemsize = torch.empty((), dtype=dtype).element_size()
    t = (
        torch.randint(0, 255, (5, 7 * itemsize), generator=g, dtype=torch.uint8).view(dtype)
        if dtype != torch.bool
        else raw > 100
    )
    t[0, 0] = t[0, 1]
    src = Holder(t)
    for shard, gather in LAYOUTS:
        out = GeneralCheckpointIO().save_model(
            src, tmp_path / f"{shard}{gather}", shard=shard, gather_dtensor=gather
        )
        dst = Holder(torch.zeros_like(t))
        GeneralCheckpointIO().load_model(dst, out, verify=True)
        for name in ("t", "nc", "s"):
            a, b = getattr(src, name), getattr(dst, name)
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), name


def _optim(m: nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        [
            {"params": [m.proj.weight, m.proj.bias], "lr": lr},
            {"params": [m.emb.weight, m.bn.weight, m.bn.bias], "lr": lr * 10, "weight_decay": 0.0},
        ]
    )


def test_optimizer_two_groups_round_trip(tmp_path: Path) -> None:
    io = GeneralCheckpointIO()
    m = fresh(0)
    opt = _optim(m, 1e-3)
    for _ in range(2):
        m(torch.tensor([1, 2, 3])).square().sum().backward()
        opt.step()
        opt.zero_grad()
    for shard, gather in LAYOUTS:
        path = tmp_path / f"o{shard}{gather}"
        io.save_optimizer(
            OptimizerWrapper(opt, m), path, shard=shard, gather_dtensor=gather, size_per_shard=0.001
        )
        m2 = fresh(1)
        opt2 = _optim(m2, 5.0)
        io.load_optimizer(OptimizerWrapper(opt2, m2), path, verify=True)
        s1, s2 = opt.state_dict(), opt2.state_dict()
        assert s1["param_groups"] == s2["param_groups"]
        assert s1["state"].keys() == s2["state"].keys()
        for i in s1["state"]:
            for k in s1["state"][i]:
                assert torch.equal(s1["state"][i][k], s2["state"][i][k]), (i, k)
    idx = json.loads((tmp_path / "oTrueTrue" / "optimizer.safetensors.index.json").read_text())
    groups = idx["unickpt"]["param_groups"]
    assert groups[0]["params"] == ["proj.weight", "proj.bias"]
    assert groups[1]["weight_decay"] == 0.0
    assert idx["unickpt"]["tensors"]["state.proj.weight.exp_avg"]["param"] == "proj.weight"


def test_optimizer_without_state_loads_without_state(tmp_path: Path) -> None:
    io = GeneralCheckpointIO()
    m = fresh(0)
    opt = _optim(m, 1e-3)
    io.save_optimizer(OptimizerWrapper(opt, m), tmp_path / "o", shard=True)
    m2 = fresh(1)
    opt2 = _optim(m2, 1.0)
    io.load_optimizer(OptimizerWrapper(opt2, m2), tmp_path / "o")
    assert len(opt2.state) == 0
    assert opt2.param_groups[0]["lr"] == 1e-3


def test_optimizer_needs_the_model(tmp_path: Path) -> None:
    m = fresh(0)
    with pytest.raises(UnsupportedError, match=r"Booster\.boost"):
        GeneralCheckpointIO().save_optimizer(_optim(m, 1.0), tmp_path / "o")


def test_strict_mismatch_reports_everything_and_touches_nothing(tmp_path: Path) -> None:
    io = GeneralCheckpointIO()
    out = io.save_model(fresh(0), tmp_path / "ck", shard=True)

    class Other(Tiny):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(6, 34)  # shape mismatch
            self.extra = nn.Linear(2, 2)  # missing from checkpoint
            del self.bn  # unexpected in checkpoint

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    dst = Other()
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(StateMismatchError) as ei:
        io.load_model(dst, out)
    msg = str(ei.value)
    assert "proj.weight: checkpoint has shape [33, 6], model has [34, 6]" in msg
    assert "extra.weight" in ei.value.missing
    assert "bn.running_mean" in ei.value.unexpected
    assert all(torch.equal(before[k], v) for k, v in dst.state_dict().items())


def test_strict_false_reports_and_loads_the_rest(tmp_path: Path) -> None:
    io = GeneralCheckpointIO()
    src = fresh(0)
    out = io.save_model(src, tmp_path / "ck", shard=True)

    class NewHead(Tiny):
        def __init__(self) -> None:
            super().__init__()
            self.new_head = nn.Linear(33, 2)

    dst = NewHead()
    report = io.load_model(dst, out, strict=False)
    assert report.missing == ["new_head.weight", "new_head.bias"]
    assert report.unexpected == []
    assert torch.equal(dst.proj.weight, src.proj.weight)


def test_dtype_mismatch_raises_unless_cast_is_asked(tmp_path: Path) -> None:
    io = GeneralCheckpointIO()
    src = fresh(0).to(torch.bfloat16)
    out = io.save_model(src, tmp_path / "ck")
    dst = fresh(1)
    with pytest.raises(StateMismatchError, match="allow_dtype_cast"):
        io.load_model(dst, out)
    io.load_model(dst, out, allow_dtype_cast=True)
    assert torch.equal(dst.proj.weight, src.proj.weight.float())


def test_prefix_saves_a_submodule_into_a_larger_model(tmp_path: Path) -> None:
    io = GeneralCheckpointIO()
    sub = nn.Linear(4, 3)
    out = io.save_model(sub, tmp_path / "ck", shard=True, prefix="encoder")
    assert "encoder.weight" in open_checkpoint(out).tensors
    big = nn.Module()
    big.encoder = nn.Linear(4, 3)
    big.decoder = nn.Linear(3, 4)
    io.load_model(big.encoder, out, prefix="encoder")
    assert torch.equal(big.encoder.weight, sub.weight)
    io.load_model(big, out, strict=False)
    assert torch.equal(big.encoder.bias, sub.bias)


def test_wrapper_names_never_reach_the_file(tmp_path: Path) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    io = GeneralCheckpointIO()
    plain = fresh(0)
    wrapped = fresh(0)
    wrapped.proj = checkpoint_wrapper(wrapped.proj)
    compiled = torch.compile(wrapped, backend="eager")
    out = io.save_model(compiled, tmp_path / "ck", shard=True)
    assert set(open_checkpoint(out).tensors) == {n for n in plain.state_dict() if n != "head.weight"}
    target = fresh(1)
    target.proj = checkpoint_wrapper(target.proj)
    io.load_model(torch.compile(target, backend="eager"), io.save_model(plain, tmp_path / "p", shard=True))
    assert torch.equal(target.proj._checkpoint_wrapped_module.weight, plain.proj.weight)


def test_verify_pinpoints_a_flipped_byte(tmp_path: Path) -> None:
    io = GeneralCheckpointIO()
    out = io.save_model(fresh(0), tmp_path / "ck", shard=True, size_per_shard=0.001)
    r = open_checkpoint(out)
    s = r.tensors["proj.weight"].slices[0]
    path, off, _ = r.key_location(s.file, s.key)
    r.close()
    with open(path, "r+b") as f:
        f.seek(off + 17)
        b = f.read(1)
        f.seek(off + 17)
        f.write(bytes([b[0] ^ 0x10]))
    dst = fresh(1)
    before = dst.proj.weight.clone()
    with pytest.raises(IntegrityError) as ei:
        io.load_model(dst, out, verify=True)
    assert ei.value.tensor == "proj.weight" and ei.value.file == s.file
    assert [f.tensor for f in ei.value.failures] == ["proj.weight"]
    assert torch.equal(dst.proj.weight, before)
    failures = open_checkpoint(out).verify()
    assert [(f.tensor, f.file) for f in failures] == [("proj.weight", s.file)]


def test_directory_without_index_is_not_a_checkpoint(tmp_path: Path) -> None:
    io = GeneralCheckpointIO()
    out = io.save_model(fresh(0), tmp_path / "ck", shard=True)
    os.unlink(os.path.join(out, "model.safetensors.index.json"))
    with pytest.raises(IncompleteCheckpointError, match="no committed model checkpoint"):
        io.load_model(fresh(1), out)


def test_malicious_index_is_refused(tmp_path: Path) -> None:
    io = GeneralCheckpointIO()
    out = io.save_model(fresh(0), tmp_path / "ck", shard=True)
    p = os.path.join(out, "model.safetensors.index.json")
    text = Path(p).read_text()
    Path(p).write_text(text.replace('"model-00001-of-00001.safetensors"', '"../../etc/passwd.safetensors"'))
    with pytest.raises(UnsafePathError, match="refusing data file name"):
        io.load_model(fresh(1), out)


def test_resave_in_place_replaces_files(tmp_path: Path) -> None:
    io = GeneralCheckpointIO()
    io.save_model(fresh(0), tmp_path / "ck", shard=True, size_per_shard=0.0005)
    n_before = len(os.listdir(tmp_path / "ck"))
    io.save_model(fresh(2), tmp_path / "ck", shard=True)
    assert sorted(os.listdir(tmp_path / "ck")) == [
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
    ]
    assert n_before > 2
    dst = fresh(1)
    io.load_model(dst, tmp_path / "ck")
    assert_same(fresh(2), dst)


def test_lr_scheduler_round_trip_as_json(tmp_path: Path) -> None:
    io = GeneralCheckpointIO()
    m = fresh(0)
    opt = _optim(m, 0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(3):
        opt.step()
        sched.step()
    path = io.save_lr_scheduler(sched, tmp_path)
    assert json.loads(Path(path).read_text())["state"]["last_epoch"] == 3
    opt2 = _optim(fresh(1), 0.1)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=7, gamma=0.9)
    io.load_lr_scheduler(sched2, tmp_path)
    assert sched2.state_dict() == sched.state_dict()


def test_lr_scheduler_paths_as_colossalai_names_them(tmp_path: Path) -> None:
    """Colossal-AI's ``save_lr_scheduler``/``load_lr_scheduler`` take one file path of any name
    (``torch.save``/``torch.load``). Here a name without ``.json`` is a directory both ways, so
    the same path round-trips; a missing path is refused naming the path given, not only the
    ``lr_scheduler.json`` inside it that was looked for."""
    io = GeneralCheckpointIO()
    opt = _optim(fresh(0), 0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    opt.step()
    sched.step()
    given = tmp_path / "ck" / "scheduler.pt"
    io.save_lr_scheduler(sched, given)
    sched2 = torch.optim.lr_scheduler.StepLR(_optim(fresh(1), 0.1), step_size=7)
    io.load_lr_scheduler(sched2, given)
    assert sched2.state_dict() == sched.state_dict()
    missing = tmp_path / "ck" / "scheduler.bin"
    with pytest.raises(IncompleteCheckpointError) as e:
        io.load_lr_scheduler(sched2, missing)
    assert str(e.value) == (
        f"no LR scheduler state at {missing}: it is not a file and {missing}/lr_scheduler.json "
        "does not exist (a directory's scheduler state is its lr_scheduler.json)"
    )
    with pytest.raises(IncompleteCheckpointError, match=r"^no LR scheduler state at .*/nothing\.json$"):
        io.load_lr_scheduler(sched2, tmp_path / "nothing.json")
    (tmp_path / "empty").mkdir()  # a directory without the file: the file looked for is named
    with pytest.raises(IncompleteCheckpointError) as e:
        io.load_lr_scheduler(sched2, tmp_path / "empty")
    assert (
        f"at {tmp_path / 'empty'}: it is not a file and {tmp_path / 'empty'}/lr_scheduler.json does"
        in str(e.value)
    )
    assert sched2.state_dict() == sched.state_dict()  # nothing changed


def test_hf_config_written_beside_weights(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    model = transformers.LlamaForCausalLM(cfg)
    out = GeneralCheckpointIO().save_model(model, tmp_path / "hf", shard=True)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["hidden_size"] == 16
    loaded = transformers.LlamaForCausalLM.from_pretrained(out)
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_optimizer_loads_into_fresh_optimizer_when_gradients_exist(tmp_path: Path) -> None:
    """torch's own state initialisation skips optimizers whose parameters have gradients."""
    io = GeneralCheckpointIO()
    m = fresh(0)
    opt = _optim(m, 0.1)
    m(torch.tensor([1, 2])).sum().backward()
    opt.step()
    io.save_optimizer(OptimizerWrapper(opt, m), tmp_path / "o", shard=True)
    io.save_model(m, tmp_path / "m", shard=True)
    m2 = fresh(1)
    opt2 = _optim(m2, 0.5)
    m2(torch.tensor([3, 4])).sum().backward()
    grad = m2.proj.weight.grad.clone()
    io.load_model(m2, tmp_path / "m")
    io.load_optimizer(OptimizerWrapper(opt2, m2), tmp_path / "o")
    assert_same(m, m2)  # loading the optimizer never moves parameters
    assert torch.equal(m2.proj.weight.grad, grad)  # nor drops the user's gradients
    assert torch.equal(opt2.state[m2.proj.weight]["exp_avg"], opt.state[m.proj.weight]["exp_avg"])
    assert opt2.param_groups[0]["lr"] == 0.1


def test_loads_a_plain_hugging_face_sharded_checkpoint(tmp_path: Path) -> None:
    from huggingface_hub import save_torch_state_dict

    src = fresh(0)
    (tmp_path / "hf").mkdir()
    save_torch_state_dict(src.state_dict(), tmp_path / "hf", max_shard_size=300)
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    dst = fresh(1)
    report = GeneralCheckpointIO().load_model(dst, tmp_path / "hf", strict=False)
    assert report.unexpected == []
    assert_same(src, dst)
    r = open_checkpoint(tmp_path / "hf")
    assert not r.has_unickpt_block and all(s.xxh3 is None for t in r.tensors.values() for s in t.slices)


def test_saving_a_stateless_optimizer_invents_no_state(tmp_path: Path) -> None:
    """SGD without momentum keeps no state: saving it must not run torch's zero-gradient step."""
    io = GeneralCheckpointIO()
    m = fresh(0)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    calls = []
    opt.register_step_pre_hook(lambda *a: calls.append(1))
    io.save_optimizer(OptimizerWrapper(opt, m), tmp_path / "o", shard=True)
    assert calls == [] and len(opt.state) == 0 and all(p.grad is None for p in m.parameters())
    block = open_checkpoint(tmp_path / "o", "optimizer").block
    assert block.tensors == {} and block.param_groups is not None
    assert block.param_groups[0]["params"][0] == "emb.weight"
