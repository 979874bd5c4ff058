"""The offline tools writing to a real S3 API (moto's server): merge to a URL (streamed, committed
last, nothing left by a failure), the side files a Hugging Face loader needs, convert to and from
URLs, diff between a URL and a local path."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from unickpt import GeneralCheckpointIO
from unickpt.ckpt.reader import open_checkpoint
from unickpt.cli.main import main
from unickpt.errors import IntegrityError, OutputExistsError
from unickpt.tools.merge import merge_checkpoint


def _fs(s3: Any) -> Any:
    import s3fs

    return s3fs.S3FileSystem(**s3.storage_options("tester"))


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(48, 64), nn.ReLU(), nn.Linear(64, 40), nn.ReLU(), nn.Linear(40, 9))


def _saved(s3: Any, tmp_path: Path, name: str) -> tuple[Path, str]:
    """A sharded model + optimizer checkpoint with side files, locally and uploaded."""
    model = _model(0)
    opt = torch.optim.AdamW(model.named_parameters(), lr=0.01)
    model(torch.randn(3, 48)).sum().backward()
    opt.step()
    local = tmp_path / name
    io = GeneralCheckpointIO()
    io.save_model(model, str(local), shard=True, size_per_shard=0.01)
    io.save_optimizer(opt, str(local), shard=True, size_per_shard=0.01)
    (local / "config.json").write_text('{"model_type": "mlp"}')
    (local / "tokenizer.json").write_text('{"version": "1.0"}')
    (local / "lr_scheduler.json").write_text('{"state": {"last_epoch": 1}}')
    _fs(s3).put(str(local), f"{s3.bucket}/{name}", recursive=True)
    return local, f"s3://{s3.bucket}/{name}"


def _tensors(where: str | Path, kind: str = "model") -> dict[str, bytes]:
    with open_checkpoint(where, kind) as r:
        out = {}
        for name, t in r.block.tensors.items():
            (s,) = t.slices
            out[name] = bytes(r.read_key(s.file, s.key))
        return out


def _objects(s3: Any, url: str) -> dict[str, bytes]:
    return dict(s3.objects(url))


def _uploads(s3: Any) -> list[Any]:
    return list(s3.open_uploads(s3.bucket))


@pytest.mark.slow
@pytest.mark.parametrize("shard", ["20KB", "5GB"])
def test_merge_url_to_url_equals_local_merge(s3, tmp_path, shard: str) -> None:
    local, url = _saved(s3, tmp_path, "ckpt")
    out = f"s3://{s3.bucket}/merged"
    both = shard == "5GB"  # the optimizer too (its side file with it)
    merge_checkpoint(url, out, max_shard_size=shard, optimizer=both)
    merge_checkpoint(local, tmp_path / "ref", max_shard_size=shard, optimizer=both)
    got = _objects(s3, out)
    ref = sorted(p.name for p in (tmp_path / "ref").iterdir())
    assert sorted(got) == ref
    # The side files a loader needs came from the store.
    assert got["config.json"] == b'{"model_type": "mlp"}' and got["tokenizer.json"] == b'{"version": "1.0"}'
    assert got.get("lr_scheduler.json") == (b'{"state": {"last_epoch": 1}}' if both else None)
    for kind in ("model", "optimizer") if both else ("model",):
        assert _tensors(out, kind) == _tensors(tmp_path / "ref", kind)
    if shard == "5GB":  # a single file is written as locally: the same bytes
        assert got["model.safetensors"] == (tmp_path / "ref" / "model.safetensors").read_bytes()
    else:
        assert len([n for n in got if n.startswith("model-")]) == 2
        index = json.loads(got["model.safetensors.index.json"])
        assert set(index["weight_map"].values()) == {n for n in got if n.startswith("model-")}
        # The same merge again gives the same bytes (the save id is derived, not random).
        merge_checkpoint(url, f"{out}-again", max_shard_size=shard)
        assert _objects(s3, f"{out}-again") == got
    assert main(["diff", out, str(local)]) == 0
    assert main(["verify", out, "-q"]) == 0
    assert _uploads(s3) == []


def test_merge_to_url_refuses_a_used_prefix(s3, tmp_path) -> None:
    local, url = _saved(s3, tmp_path, "ckpt")
    with pytest.raises(OutputExistsError, match=f"{url} already holds"):
        merge_checkpoint(local, url)
    # before the source is opened, as for a local output in use
    for out in (url, str(local)):
        with pytest.raises(OutputExistsError):
            merge_checkpoint(tmp_path / "no-such-source", out)


def test_failed_merge_to_url_leaves_nothing(s3, tmp_path) -> None:
    local, _ = _saved(s3, tmp_path, "ckpt")
    # The last data file's bytes are damaged: the merge fails after uploading the first files.
    victim = sorted(local.glob("model-*.safetensors"))[-1]
    data = bytearray(victim.read_bytes())
    data[-2] ^= 1
    victim.write_bytes(bytes(data))
    out = f"s3://{s3.bucket}/merged"
    with pytest.raises(IntegrityError, match=victim.name):
        merge_checkpoint(local, out, max_shard_size="20KB")
    assert _objects(s3, out) == {}
    assert _uploads(s3) == []


@pytest.mark.slow
def test_cli_merge_to_url_uploads_each_byte_once(s3, tmp_path) -> None:
    local, _ = _saved(s3, tmp_path, "ckpt")
    out = f"s3://{s3.bucket}/cli-merged"
    s3.reset()
    assert main(["merge", str(local), out, "--max-shard-size", "20KB", "-q"]) == 0
    got = _objects(s3, out)
    merge_checkpoint(local, tmp_path / "ref", max_shard_size="20KB")
    assert _tensors(out) == _tensors(tmp_path / "ref")
    # Every object was uploaded once, whole: no copy, no retry, no re-upload.
    assert s3.received("PUT") == sum(len(v) for v in got.values())
    assert main(["merge", str(local), out, "-q"]) == 2  # the output exists now


def _sources(s3: Any, tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """A model-only DCP checkpoint and a pytorch_model.bin (with its config.json), local and uploaded."""
    import torch.distributed.checkpoint as dcp

    sd = _model(1).state_dict()
    out = {}
    dcp_dir = tmp_path / "dcp-src"
    dcp.save({"model": sd}, checkpoint_id=str(dcp_dir), no_dist=True)
    bin_dir = tmp_path / "bin-src"
    bin_dir.mkdir()
    torch.save(sd, bin_dir / "pytorch_model.bin")
    (bin_dir / "config.json").write_text('{"model_type": "mlp"}')
    for name, d in (("dcp", dcp_dir), ("bin", bin_dir)):
        _fs(s3).put(str(d), f"{s3.bucket}/{name}-src", recursive=True)
        out[name] = (d, f"s3://{s3.bucket}/{name}-src")
    return out


@pytest.mark.slow
def test_convert_from_and_to_urls(s3, tmp_path) -> None:
    from unickpt.tools.convert import convert_checkpoint

    for source, (local, url) in _sources(s3, tmp_path).items():
        ref = tmp_path / f"{source}-ref"
        convert_checkpoint(local, ref, source=source, strip_prefix="model." if source == "dcp" else None)
        kw: dict[str, Any] = {"source": source, "strip_prefix": "model." if source == "dcp" else None}
        # URL -> local, local -> URL, URL -> URL: the same tensors, bit-exact.
        convert_checkpoint(url, tmp_path / f"{source}-from-url", **kw)
        assert _tensors(tmp_path / f"{source}-from-url") == _tensors(ref)
        for src in (local, url):
            out = f"s3://{s3.bucket}/{source}-to-url-{'url' if src == url else 'local'}"
            assert convert_checkpoint(src, out, **kw) == out
            got = _objects(s3, out)
            assert sorted(got) == sorted(p.name for p in ref.iterdir())
            assert _tensors(out) == _tensors(ref)
            if source == "bin":
                assert got["config.json"] == b'{"model_type": "mlp"}'
    # A unickpt checkpoint on a URL exported as DCP to a URL: .metadata among the objects.
    _, url = _saved(s3, tmp_path, "ckpt")
    out = f"s3://{s3.bucket}/as-dcp"
    assert main(["convert", url, out, "--to", "dcp", "-q"]) == 0
    assert ".metadata" in _objects(s3, out)
    assert _uploads(s3) == []


def test_convert_url_refusals(s3, tmp_path, capsys) -> None:
    url = f"s3://{s3.bucket}/src"
    # A URL source is read in place like a local one: an empty prefix is no checkpoint.
    assert main(["convert", url, str(tmp_path / "o"), "--from", "colossalai", "-q"]) == 2
    assert f"{url} is not a Colossal-AI sharded optimizer checkpoint: no pytorch_optim.bin.index.json" in (
        capsys.readouterr().err
    )
    assert main(["convert", url, str(tmp_path / "o"), "--from", "deepspeed", "-q"]) == 2
    assert f"{url} does not exist" in capsys.readouterr().err
    _, used = _saved(s3, tmp_path, "ckpt")
    assert main(["convert", used, used, "--to", "dcp", "-q"]) == 2
    assert f"{used} already holds" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("shard", ["4KB", "5GB"])
def test_merge_to_url_loads_in_transformers(s3, tmp_path, shard: str) -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    local = tmp_path / "src"
    GeneralCheckpointIO().save_model(model, str(local), shard=True, size_per_shard=0.002)
    (local / "config.json").write_text(cfg.to_json_string())
    _fs(s3).put(str(local), f"{s3.bucket}/src", recursive=True)
    out = f"s3://{s3.bucket}/hf"
    merge_checkpoint(f"s3://{s3.bucket}/src", out, max_shard_size=shard)
    # The URL's objects, as they are, are a directory transformers loads.
    got = tmp_path / "got"
    got.mkdir()
    for name, data in _objects(s3, out).items():
        (got / name).write_bytes(data)
    loaded = transformers.LlamaForCausalLM.from_pretrained(got)
    ref = model.state_dict()
    sd = loaded.state_dict()
    assert sd.keys() == ref.keys()
    for k, v in ref.items():
        assert torch.equal(sd[k], v) and sd[k].dtype == v.dtype, k
    assert (shard == "5GB") == (got / "model.safetensors").exists()
