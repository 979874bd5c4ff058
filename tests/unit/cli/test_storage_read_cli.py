"""The offline tools on checkpoints in a real S3 API (moto's server): inspect reads only the index,
verify / diff / merge / convert stream through the reader; ``--storage-option`` and missing backends."""

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
from unickpt.cli.storage_opts import parse_storage_options
from unickpt.errors import ConfigError


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(48, 64), nn.ReLU(), nn.Linear(64, 40), nn.ReLU(), nn.Linear(40, 9))


def _fs(s3: Any) -> Any:
    import s3fs

    return s3fs.S3FileSystem(**s3.storage_options("uploader"))


def _saved(s3: Any, tmp_path: Path, name: str, seed: int = 0) -> tuple[Path, str]:
    model = _model(seed)
    opt = torch.optim.AdamW(model.named_parameters(), lr=0.01)
    model(torch.randn(3, 48)).sum().backward()
    opt.step()
    local = tmp_path / name
    io = GeneralCheckpointIO()
    io.save_model(model, str(local), shard=True, size_per_shard=0.01)
    io.save_optimizer(opt, str(local), shard=True, size_per_shard=0.01)
    _fs(s3).put(str(local), f"{s3.bucket}/{name}", recursive=True)
    return local, f"s3://{s3.bucket}/{name}"


AGENT = 'config_kwargs={"user_agent_extra": "unickpt-client/cli"}'


def test_parse_storage_options() -> None:
    assert parse_storage_options(
        ["anon=true", "n=3", "endpoint_url=http://h:1", 'k={"a": [1]}', "s=x=y"]
    ) == {
        "anon": True,
        "n": 3,
        "endpoint_url": "http://h:1",
        "k": {"a": [1]},
        "s": "x=y",
    }
    with pytest.raises(ConfigError, match="--storage-option 'novalue': expected KEY=VALUE"):
        parse_storage_options(["novalue"])


def test_inspect_reads_only_the_index(s3, tmp_path, capsys) -> None:
    local, url = _saved(s3, tmp_path, "ckpt")
    s3.reset()
    assert main(["inspect", url, "--json", "--storage-option", AGENT]) == 0
    info = json.loads(capsys.readouterr().out)
    index = local / "model.safetensors.index.json"
    assert info["path"] == url and info["index"] == f"{url}/model.safetensors.index.json"
    assert info["tensors"] == json.loads(json.dumps(_inspect_local(local)))["tensors"]
    assert s3.served("GET", "cli") == index.stat().st_size
    s3.reset()
    assert main(["inspect", url, "--kind", "optimizer", "--storage-option", AGENT]) == 0
    assert s3.served("GET", "cli") == (local / "optimizer.safetensors.index.json").stat().st_size


def _inspect_local(local: Path) -> dict[str, Any]:
    from unickpt.tools.inspect import inspect_checkpoint

    return inspect_checkpoint(local, slices=True)  # as `inspect --json` lists them


def test_verify_url_and_a_flipped_byte(s3, tmp_path, capsys) -> None:
    local, url = _saved(s3, tmp_path, "ckpt")
    assert main(["verify", url, "-q"]) == 0
    assert main(["verify", url, "--kind", "optimizer", "-q"]) == 0
    victim = sorted(p.name for p in local.glob("model-*.safetensors"))[0]
    data = bytearray((local / victim).read_bytes())
    data[-3] ^= 1
    _fs(s3).pipe_file(f"{url}/{victim}", bytes(data))
    capsys.readouterr()
    assert main(["verify", url, "-q"]) == 1
    err = capsys.readouterr().err
    assert f"FAILED: {url}: 1 integrity failure(s)" in err and victim in err


def test_diff_url_against_local_and_url(s3, tmp_path, capsys) -> None:
    local, url = _saved(s3, tmp_path, "a")
    _, other = _saved(s3, tmp_path, "b", seed=3)
    assert main(["diff", url, str(local), "--deep"]) == 0
    assert "identical" in capsys.readouterr().out.lower()
    assert main(["diff", url, other]) == 1
    out = capsys.readouterr().out
    assert "0.weight" in out


def test_merge_from_url_to_local(s3, tmp_path) -> None:
    local, url = _saved(s3, tmp_path, "ckpt")
    assert main(["merge", url, str(tmp_path / "from-url"), "--optimizer", "-q"]) == 0
    assert main(["merge", str(local), str(tmp_path / "from-local"), "--optimizer", "-q"]) == 0
    for kind in ("model", "optimizer"):
        with (
            open_checkpoint(tmp_path / "from-url", kind) as a,
            open_checkpoint(tmp_path / "from-local", kind) as b,
        ):
            assert a.block.tensors.keys() == b.block.tensors.keys()
            for name, t in a.block.tensors.items():
                (sa,) = t.slices
                (sb,) = b.block.tensors[name].slices
                assert bytes(a.read_key(sa.file, sa.key)) == bytes(b.read_key(sb.file, sb.key)), name
                assert t.fingerprint == b.block.tensors[name].fingerprint


def test_convert_url_to_dcp(s3, tmp_path) -> None:
    local, url = _saved(s3, tmp_path, "ckpt")
    assert main(["convert", url, str(tmp_path / "dcp"), "--to", "dcp", "-q"]) == 0
    assert main(["convert", str(local), str(tmp_path / "dcp-local"), "--to", "dcp", "-q"]) == 0
    a = sorted(p.name for p in (tmp_path / "dcp").iterdir())
    assert a == sorted(p.name for p in (tmp_path / "dcp-local").iterdir()) and ".metadata" in a


def test_storage_option_reaches_the_store(s3, tmp_path, monkeypatch, capsys) -> None:
    _, url = _saved(s3, tmp_path, "ckpt")
    for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(k)
    opts = ["--storage-option", f"endpoint_url={s3.endpoint}", "--storage-option", "key=testing"]
    opts += ["--storage-option", "secret=testing", "--storage-option", "skip_instance_cache=true"]
    assert main(["inspect", url, *opts]) == 0
    capsys.readouterr()
    # The options last for one command only.
    import fsspec.config

    assert "endpoint_url" not in fsspec.config.conf.get("s3", {})
    assert main(["inspect", str(tmp_path / "ckpt"), "--storage-option", "anon=true"]) == 2
    assert "--storage-option applies to URLs" in capsys.readouterr().err


def test_missing_backend_names_the_extra(capsys) -> None:
    assert main(["inspect", "gs://bucket/run/ckpt"]) == 2
    assert "pip install 'unickpt[gcs]'" in capsys.readouterr().err


def test_missing_checkpoint_on_url(s3, tmp_path, capsys) -> None:
    url = f"s3://{s3.bucket}/none"
    assert main(["verify", url]) == 2
    # as for a local path: nothing there at all
    assert f"no checkpoint at {url}: the path does not exist" in capsys.readouterr().err
    assert main(["verify", str(tmp_path / "none")]) == 2
    assert f"no checkpoint at {tmp_path / 'none'}: the path does not exist" in capsys.readouterr().err
