"""PEFT adapters against real peft and transformers models: ``save_adapter`` writes what peft's own
``save_pretrained`` writes (same names, same bytes, same config) and ``PeftModel.from_pretrained``
loads it; ``load_adapter`` reads unickpt's output and peft's; ``merge --merge-adapters`` equals
``merge_and_unload()`` bit for bit in fp32 (and bf16) and loads into the base architecture with
no missing or unexpected keys; unsupported adapters are refused by name."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from unickpt import GeneralCheckpointIO, merge_checkpoint
from unickpt.ckpt.reader import UNICKPT_METADATA_KEY, open_checkpoint
from unickpt.cli.main import main
from unickpt.errors import (
    ConfigError,
    IncompleteCheckpointError,
    IntegrityError,
    StateMismatchError,
    UnsupportedError,
)

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _llama(seed: int = 0, dtype: torch.dtype = torch.float32) -> Any:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return transformers.LlamaForCausalLM(cfg).to(dtype)


def _gpt2(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32)
    return transformers.GPT2LMHeadModel(cfg)


def _lora_llama(seed: int = 0, **kw: Any) -> Any:
    dtype = kw.pop("dtype", torch.float32)
    cfg: dict[str, Any] = dict(
        r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    cfg.update(kw)
    base = _llama(0, dtype)
    torch.manual_seed(seed + 100)
    return peft.get_peft_model(base, peft.LoraConfig(**cfg))


def _adapter_state(model: Any) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if "lora_" in k}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


# -------------------------------------------------------------------- save_adapter / load_adapter


def test_save_adapter_writes_what_peft_writes_and_peft_loads_it(tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    model = _lora_llama()
    path = GeneralCheckpointIO().save_adapter(model, tmp_path / "ours")
    assert path == str(tmp_path / "ours" / "adapter_model.safetensors")
    model.save_pretrained(tmp_path / "peer")
    ours, peer = (
        load_file(tmp_path / "ours/adapter_model.safetensors"),
        load_file(tmp_path / "peer/adapter_model.safetensors"),
    )
    _equal(ours, peer)
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in ours
    assert json.loads((tmp_path / "ours/adapter_config.json").read_text()) == json.loads(
        (tmp_path / "peer/adapter_config.json").read_text()
    )
    # peft's metadata, plus unickpt's block (hashes, fingerprints) that unickpt's reader checks.
    with safe_open(tmp_path / "ours/adapter_model.safetensors", "pt") as f:
        meta = f.metadata()
    assert meta["format"] == "pt" and UNICKPT_METADATA_KEY in meta
    with open_checkpoint(tmp_path / "ours/adapter_model.safetensors", "model") as r:
        assert r.verify() == [] and all(s.xxh3 for t in r.tensors.values() for s in t.slices)
    loaded = peft.PeftModel.from_pretrained(_llama(), tmp_path / "ours")
    _equal(_adapter_state(loaded), _adapter_state(model))


def test_load_adapter_reads_peft_output_and_its_own_bit_exact(tmp_path: Path) -> None:
    model = _lora_llama()
    model.save_pretrained(tmp_path / "peer")
    io = GeneralCheckpointIO()
    io.save_adapter(model, tmp_path / "ours")
    for src in ("peer", "ours", "ours/adapter_model.safetensors"):
        target = _lora_llama(seed=7)  # other random LoRA weights
        assert not torch.equal(
            _adapter_state(target)[next(iter(_adapter_state(model)))],
            next(iter(_adapter_state(model).values())),
        )
        report = io.load_adapter(target, tmp_path / src, verify=src != "peer")
        assert report.missing == [] and report.unexpected == [] and len(report.loaded) == 8
        _equal(_adapter_state(target), _adapter_state(model))


def test_load_adapter_into_another_adapter_name(tmp_path: Path) -> None:
    model = _lora_llama()
    GeneralCheckpointIO().save_adapter(model, tmp_path / "ad")
    target = _lora_llama(seed=3)
    target.add_adapter("other", peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    GeneralCheckpointIO().load_adapter(target, tmp_path / "ad", adapter_name="other")
    sd = target.state_dict()
    for k, v in _adapter_state(model).items():
        assert torch.equal(sd[k.replace(".default.", ".other.")], v), k


def test_save_adapter_of_gpt2_with_modules_to_save(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    model = peft.get_peft_model(
        _gpt2(),
        peft.LoraConfig(
            r=2, lora_alpha=3, target_modules=["c_attn"], modules_to_save=["ln_f"], init_lora_weights=False
        ),
    )
    GeneralCheckpointIO().save_adapter(model, tmp_path / "ours")
    model.save_pretrained(tmp_path / "peer")
    ours = load_file(tmp_path / "ours/adapter_model.safetensors")
    _equal(ours, load_file(tmp_path / "peer/adapter_model.safetensors"))
    assert "base_model.model.transformer.ln_f.weight" in ours
    loaded = peft.PeftModel.from_pretrained(_gpt2(seed=5), tmp_path / "ours")
    _equal(
        {k: v for k, v in loaded.state_dict().items() if "lora_" in k or "modules_to_save" in k},
        {k: v for k, v in model.state_dict().items() if "lora_" in k or "modules_to_save" in k},
    )


def test_a_damaged_adapter_is_an_integrity_error(tmp_path: Path) -> None:
    model = _lora_llama()
    GeneralCheckpointIO().save_adapter(model, tmp_path / "ad")
    f = tmp_path / "ad/adapter_model.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    target = _lora_llama(seed=3)
    before = _adapter_state(target)
    with pytest.raises(IntegrityError) as e:
        GeneralCheckpointIO().load_adapter(target, tmp_path / "ad", verify=True)
    assert "lora_B.weight" in e.value.tensor and "adapter_model.safetensors" in e.value.file
    _equal(_adapter_state(target), before)  # nothing copied


def test_load_adapter_refuses_a_different_config(tmp_path: Path) -> None:
    GeneralCheckpointIO().save_adapter(_lora_llama(), tmp_path / "ad")
    with pytest.raises(ConfigError) as e:
        GeneralCheckpointIO().load_adapter(_lora_llama(lora_alpha=8), tmp_path / "ad")
    msg = str(e.value)
    assert "adapter_config.json" in msg and "lora_alpha: the model's adapter has 8, the file 4" in msg
    with pytest.raises((ConfigError, StateMismatchError)) as e2:
        GeneralCheckpointIO().load_adapter(_lora_llama(r=4), tmp_path / "ad")
    assert "r: the model's adapter has 4, the file 2" in str(e2.value)


def test_load_adapter_without_config_still_checks_shapes(tmp_path: Path) -> None:
    GeneralCheckpointIO().save_adapter(_lora_llama(), tmp_path / "ad")
    os.remove(tmp_path / "ad/adapter_config.json")
    with pytest.raises(StateMismatchError) as e:
        GeneralCheckpointIO().load_adapter(_lora_llama(r=4), tmp_path / "ad")
    assert e.value.mismatched and all("lora_" in n for n in e.value.mismatched)


def test_adapters_need_a_peft_model(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedError, match=r"not a peft model \(no peft_config\)"):
        GeneralCheckpointIO().save_adapter(_llama(), tmp_path / "ad")
    with pytest.raises(ConfigError, match="no adapter 'nope'"):
        GeneralCheckpointIO().save_adapter(_lora_llama(), tmp_path / "ad", adapter_name="nope")
    assert not (tmp_path / "ad").exists()


def test_booster_save_adapter(tmp_path: Path) -> None:
    from unickpt import Booster

    booster = Booster()
    model, *_ = booster.boost(_lora_llama())
    booster.save_adapter(model, str(tmp_path / "ad"))
    target, *_ = Booster().boost(_lora_llama(seed=4))
    booster.load_adapter(target, str(tmp_path / "ad"), verify=True)
    _equal(_adapter_state(target.unwrap()), _adapter_state(model.unwrap()))


# -------------------------------------------------------------------- merge --merge-adapters


def _check_merged(model: Any, out: Path) -> None:
    import copy

    want = copy.deepcopy(model).merge_and_unload().state_dict()
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, output_loading_info=True, dtype=next(iter(want.values())).dtype
    )
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set(), info
    _equal(loaded.state_dict(), want)


@pytest.mark.parametrize(
    "case",
    ["llama", "llama_rslora_patterns", "llama_bf16", "gpt2_fan_in_fan_out_modules_to_save"],
)
def test_merge_adapters_equals_merge_and_unload(tmp_path: Path, case: str) -> None:
    if case == "llama":
        model = _lora_llama(target_modules=["q_proj", "v_proj", "down_proj"])
    elif case == "llama_rslora_patterns":
        model = _lora_llama(
            r=4,
            lora_alpha=7,
            use_rslora=True,
            target_modules=["q_proj", "v_proj", "down_proj"],
            rank_pattern={"down_proj": 2},
            alpha_pattern={"layers.1.self_attn.v_proj": 3},
        )
    elif case == "llama_bf16":
        model = _lora_llama(dtype=torch.bfloat16)
    else:
        model = peft.get_peft_model(
            _gpt2(),
            peft.LoraConfig(
                r=2,
                lora_alpha=5,
                target_modules=["c_attn", "c_fc"],
                modules_to_save=["ln_f"],
                init_lora_weights=False,
            ),
        )
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "modules_to_save" in n:
                    p.add_(0.5)
    # A sliced checkpoint in two files: the merge rebuilds every tensor from its slices.
    GeneralCheckpointIO().save_model(
        model, str(tmp_path / "ck"), shard=True, gather_dtensor=False, size_per_shard=0.001
    )
    assert (tmp_path / "ck/adapter_config.json").exists()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        merge_checkpoint(tmp_path / "ck", tmp_path / "hf", merge_adapters=True)
    assert not (tmp_path / "hf/adapter_config.json").exists()
    _check_merged(model, tmp_path / "hf")


def test_merge_adapters_from_the_cli_and_with_a_given_config(tmp_path: Path) -> None:
    model = _lora_llama()
    GeneralCheckpointIO().save_model(model, str(tmp_path / "ck"), shard=True, gather_dtensor=False)
    assert main(["merge", "--merge-adapters", "-q", str(tmp_path / "ck"), str(tmp_path / "hf")]) == 0
    _check_merged(model, tmp_path / "hf")
    # A checkpoint without adapter_config.json: the config comes from the peft model or a file.
    os.replace(tmp_path / "ck/adapter_config.json", tmp_path / "cfg.json")
    with pytest.raises(IncompleteCheckpointError, match=r"no adapter config at .*ck/adapter_config.json"):
        merge_checkpoint(tmp_path / "ck", tmp_path / "hf2", merge_adapters=True)
    assert not (tmp_path / "hf2").exists()
    with pytest.raises(
        ConfigError, match=r"adapter_config \(--adapter-config\) is the config of --merge-adapters"
    ):
        merge_checkpoint(tmp_path / "ck", tmp_path / "hf2", adapter_config=model.peft_config["default"])
    merge_checkpoint(
        tmp_path / "ck", tmp_path / "hf2", merge_adapters=True, adapter_config=model.peft_config["default"]
    )
    _check_merged(model, tmp_path / "hf2")
    assert (
        main(
            [
                "merge",
                "-q",
                "--merge-adapters",
                "--adapter-config",
                str(tmp_path / "cfg.json"),
                str(tmp_path / "ck"),
                str(tmp_path / "hf3"),
            ]
        )
        == 0
    )
    _check_merged(model, tmp_path / "hf3")


def _saved(tmp_path: Path, model: Any) -> Path:
    GeneralCheckpointIO().save_model(model, str(tmp_path / "ck"), shard=True, gather_dtensor=False)
    return tmp_path / "ck"


def _edit_config(ck: Path, **changes: Any) -> None:
    cfg = json.loads((ck / "adapter_config.json").read_text())
    cfg.update(changes)
    (ck / "adapter_config.json").write_text(json.dumps(cfg))


def test_merge_refuses_dora_and_other_adapters(tmp_path: Path) -> None:
    ck = _saved(tmp_path, _lora_llama(use_dora=True))
    with pytest.raises(UnsupportedError, match=r"adapter_config.json: use_dora=True is not supported"):
        merge_checkpoint(ck, tmp_path / "hf", merge_adapters=True)
    _edit_config(ck, use_dora=False)  # the tensors still say DoRA
    with pytest.raises(
        UnsupportedError,
        match=r"tensor 'base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector.default.weight' belongs to a DoRA adapter",
    ):
        merge_checkpoint(ck, tmp_path / "hf", merge_adapters=True)
    assert not (tmp_path / "hf").exists()


def test_merge_refuses_non_lora_and_lora_bias(tmp_path: Path) -> None:
    model = peft.get_peft_model(
        _llama(), peft.IA3Config(target_modules=["q_proj", "down_proj"], feedforward_modules=["down_proj"])
    )
    ck = _saved(tmp_path / "ia3", model)
    with pytest.raises(UnsupportedError, match=r"peft_type is 'IA3'; only LoRA adapters"):
        merge_checkpoint(ck, tmp_path / "hf", merge_adapters=True)
    ck = _saved(tmp_path / "bias", _lora_llama(lora_bias=True))
    with pytest.raises(UnsupportedError, match="lora_bias=True is not supported"):
        merge_checkpoint(ck, tmp_path / "hf", merge_adapters=True)
    _edit_config(ck, lora_bias=False)
    with pytest.raises(UnsupportedError, match=r"tensor '.*lora_B.default.bias' is a LoRA bias"):
        merge_checkpoint(ck, tmp_path / "hf", merge_adapters=True)


def test_merge_refuses_a_config_that_does_not_match_the_tensors(tmp_path: Path) -> None:
    ck = _saved(tmp_path, _lora_llama())
    _edit_config(ck, r=3)
    with pytest.raises(
        StateMismatchError, match=r"tensor '.*lora_A.default.weight' has rank 2, but .* r=3"
    ) as e:
        merge_checkpoint(ck, tmp_path / "hf", merge_adapters=True)
    assert e.value.mismatched
    _edit_config(ck, r=2, lora_alpha=0)
    with pytest.raises(ConfigError, match="lora_alpha must be a positive number, found 0"):
        merge_checkpoint(ck, tmp_path / "hf", merge_adapters=True)
    assert not (tmp_path / "hf").exists()


def test_merge_adapters_of_a_plain_model_is_refused(tmp_path: Path) -> None:
    ck = _saved(tmp_path, _llama())
    with pytest.raises(
        UnsupportedError,
        match=r"is not a PeftModel's checkpoint: \d+ tensor\(s\) are not under 'base_model.model.'",
    ):
        merge_checkpoint(
            ck,
            tmp_path / "hf",
            merge_adapters=True,
            adapter_config={"peft_type": "LORA", "r": 2, "lora_alpha": 4},
        )


def test_merge_adapters_checks_slice_hashes(tmp_path: Path) -> None:
    model = _lora_llama()
    GeneralCheckpointIO().save_model(model, str(tmp_path / "ck"), shard=False)
    f = tmp_path / "ck/model.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(IntegrityError) as e:
        merge_checkpoint(tmp_path / "ck", tmp_path / "hf", merge_adapters=True)
    assert e.value.tensor and "model.safetensors" in e.value.file
    assert not (tmp_path / "hf").exists()


_PEAK = r"""
import sys, threading, time
import peft, torch
from torch import nn
from unickpt import GeneralCheckpointIO, merge_checkpoint

def mem_kb():  # anonymous and shared-anonymous memory (the merge maps its tensors)
    return sum(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(("RssAnon", "RssShmem")))

# Its own model (in the child): 64 MB of base weights, enough to see merge's peak memory.
class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(1024, 1024, bias=False) for _ in range(16)])

torch.manual_seed(0)
cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=[f"layers.{i}" for i in range(16)], init_lora_weights=False)
GeneralCheckpointIO().save_model(peft.get_peft_model(M(), cfg), sys.argv[1], shard=True, gather_dtensor=False)
peak, stop = [0], []
base = mem_kb()
def sample():
    while not stop:
        peak[0] = max(peak[0], mem_kb())
        time.sleep(0.002)
t = threading.Thread(target=sample)
t.start()
merge_checkpoint(sys.argv[1], sys.argv[2], merge_adapters=True)
stop.append(1)
t.join()
print((peak[0] - base) / 1024, (mem_kb() - base) / 1024)
"""


@pytest.mark.slow
def test_merge_adapters_holds_a_few_tensors_at_a_time(tmp_path: Path) -> None:
    """16 LoRA layers of 4 MiB (64 MiB): the merge's memory peaks at a few tensors (the weight
    being merged, its delta, the previous one being hashed) and is given back after."""
    import subprocess
    import sys

    if not Path("/proc/self/status").exists():
        pytest.skip("needs /proc")
    cp = subprocess.run(
        [sys.executable, "-c", _PEAK, str(tmp_path / "ck"), str(tmp_path / "hf")],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert cp.returncode == 0, cp.stderr[-3000:]
    peak_mb, after_mb = map(float, cp.stdout.split()[-2:])
    assert peak_mb < 28, peak_mb  # 64 MiB merged; one tensor is 4 MiB
    assert after_mb < 8, after_mb


def test_adapter_config_lists_a_set_in_the_order_peft_writes_it(tmp_path: Path) -> None:
    """``target_modules`` is a set that peft writes as a list in the order its ``to_dict`` copy
    iterates. Two colliding names iterate in another order in a copy of a copy: the config must be
    dumped from the config's own set, as peft's save dumps it, whatever the hash seed."""
    import copy
    import itertools

    def order_shifts(names: set[str]) -> bool:
        return list(copy.deepcopy(names)) != list(copy.deepcopy(copy.deepcopy(names)))

    shifting = next(
        {a, b} for a, b in itertools.combinations([f"proj_{i}" for i in range(64)], 2) if order_shifts({a, b})
    )
    model = _lora_llama()
    model.peft_config["default"].target_modules = shifting
    GeneralCheckpointIO().save_adapter(model, tmp_path / "ours")
    model.save_pretrained(tmp_path / "peer")
    ours, peer = (json.loads((tmp_path / d / "adapter_config.json").read_text()) for d in ("ours", "peer"))
    assert sorted(ours["target_modules"]) == sorted(shifting)
    assert ours["target_modules"] == peer["target_modules"]


def test_merge_refuses_hostile_rank_and_alpha_patterns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rank_pattern and alpha_pattern are the file's: a value that is not a positive number and a
    key that is not a regular expression are refused naming the pattern; a pattern that backtracks
    exponentially under re (peft's get_pattern_key would run for hours on a long module name) runs
    under the regex module's deadline, and past it is refused; nothing is written."""
    import re
    import time

    from unickpt.spec.naming import shown
    from unickpt.tools import merge_adapters

    ck = _saved(tmp_path, _lora_llama())
    merge_checkpoint(ck, tmp_path / "plain", merge_adapters=True)
    slow = r"(\w|\w\w)+!$"
    cases: list[tuple[dict[str, Any], type[Exception], str, float]] = [
        (
            {"rank_pattern": {"q_proj": 0}},
            ConfigError,
            r"rank_pattern\['q_proj'\] must be a positive number, found 0",
            1.0,
        ),
        (
            {"alpha_pattern": {"q_proj": "x" * 10**6}},
            ConfigError,
            r"alpha_pattern\['q_proj'\] must be a positive number, found 'xxx",
            1.0,
        ),
        (
            {"rank_pattern": ["q_proj"]},
            ConfigError,
            r"rank_pattern must be an object of patterns, found \['q_proj'\]",
            1.0,
        ),
        (
            {"rank_pattern": {"q_proj(": 2}},
            ConfigError,
            r"pattern 'q_proj\(' is not a regular expression",
            1.0,
        ),
        (
            {"alpha_pattern": {slow: 3}},
            UnsupportedError,
            re.escape(
                f"pattern {shown(slow)} took over 1e-09 s to match module 'model.layers.0.self_attn.q_proj'"
            ),
            1e-9,
        ),
    ]
    for changes, err, match, seconds in cases:
        monkeypatch.setattr(merge_adapters, "PATTERN_SECONDS", seconds)
        _edit_config(ck, rank_pattern={}, alpha_pattern={})
        _edit_config(ck, **changes)
        with pytest.raises(err, match=match) as e:
            merge_checkpoint(ck, tmp_path / "hf", merge_adapters=True)
        assert len(str(e.value)) < 2000
        assert not (tmp_path / "hf").exists()
    # Nested quantifiers that match nothing here: done at once, the merge as without the pattern.
    monkeypatch.setattr(merge_adapters, "PATTERN_SECONDS", 1.0)
    _edit_config(ck, rank_pattern={}, alpha_pattern={"(.*.*)*x$": 3})
    start = time.monotonic()
    merge_checkpoint(ck, tmp_path / "hf", merge_adapters=True)
    assert time.monotonic() - start < 30.0
    names = sorted(p.name for p in (tmp_path / "plain").iterdir())
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == names
    from safetensors.torch import load_file

    for name in names:
        if name.endswith(".safetensors"):
            _equal(load_file(tmp_path / "hf" / name), load_file(tmp_path / "plain" / name))
