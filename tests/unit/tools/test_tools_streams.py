"""``unickpt convert`` and ``merge`` stream to and from a real S3 API (moto's server): URL sources
are read in place (DCP through torch's fsspec reader, ``.bin`` through a file object on the
store), URL outputs are written to the store with no local copy (a single file's header part
uploaded last), and a failed conversion or merge leaves nothing."""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict

from unickpt.ckpt.reader import open_checkpoint
from unickpt.cli.main import main
from unickpt.tools.convert import convert_checkpoint

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")


def _fs(s3: Any) -> Any:
    import s3fs

    return s3fs.S3FileSystem(**s3.storage_options("tester"))


def _objects(s3: Any, url: str) -> dict[str, bytes]:
    return dict(s3.objects(url))


def _uploads(s3: Any) -> list[Any]:
    return list(s3.open_uploads(s3.bucket))


def _tensors(where: str | Path, kind: str = "model") -> dict[str, bytes]:
    with open_checkpoint(where, kind) as r:
        return {
            n: b"".join(bytes(r.read_key(s.file, s.key)) for s in t.slices)
            for n, t in r.block.tensors.items()
        }


def _upload(s3: Any, local: Path, name: str) -> str:
    _fs(s3).put(str(local), f"{s3.bucket}/{name}", recursive=True)
    return f"s3://{s3.bucket}/{name}"


@pytest.fixture
def no_local_staging(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any temporary directory or file made while converting fails the test."""

    def refuse(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("a conversion from and to URLs staged something on local disk")

    for name in ("TemporaryDirectory", "mkdtemp", "NamedTemporaryFile", "mkstemp"):
        monkeypatch.setattr(tempfile, name, refuse)


def _training_dcp(tmp_path: Path) -> Path:
    torch.manual_seed(5)
    m = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, betas=(0.8, 0.9))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(2):
        m(torch.randn(4, 6)).square().sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    msd, osd = get_state_dict(m, opt)
    src = tmp_path / "dcp-train"
    state = {"model": msd, "optim": osd, "lr_scheduler": sched.state_dict(), "train_state": {"step": 2}}
    dcp.save(state, checkpoint_id=str(src), no_dist=True)
    return src


def test_training_dcp_url_to_url_streams_and_equals_the_local_conversion(
    s3: Any, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    src = _training_dcp(tmp_path)
    ref = tmp_path / "ref"
    convert_checkpoint(src, ref, source="dcp")
    url = _upload(s3, src, "train-src")
    out = f"s3://{s3.bucket}/train-out"
    request.getfixturevalue("no_local_staging")
    assert main(["convert", url, out, "--from", "dcp", "-q"]) == 0
    got = _objects(s3, out)
    assert sorted(got) == sorted(p.name for p in ref.iterdir())
    assert got["lr_scheduler.json"] == (ref / "lr_scheduler.json").read_bytes()
    for kind in ("model", "optimizer"):
        assert _tensors(out, kind) == _tensors(ref, kind)
    with open_checkpoint(out, "optimizer") as a, open_checkpoint(ref, "optimizer") as b:
        assert a.block.param_groups == b.block.param_groups
        assert a.block.param_state == b.block.param_state
    assert _uploads(s3) == []


def test_dcp_url_source_fetches_only_the_entries_converted(s3: Any, tmp_path: Path) -> None:
    """A DCP source is read in place: selecting half of its bytes fetches about that half."""
    torch.manual_seed(0)
    sd = {"keep": {"w": torch.randn(2048, 2048)}, "drop": {"w": torch.randn(2048, 2048)}}
    src = tmp_path / "dcp-two"
    dcp.save(sd, checkpoint_id=str(src), no_dist=True)
    url = _upload(s3, src, "two")
    total = sum(p.stat().st_size for p in src.iterdir())
    s3.reset()
    convert_checkpoint(url, tmp_path / "kept", source="dcp", strip_prefix="keep.")
    assert _tensors(tmp_path / "kept") == {"w": sd["keep"]["w"].numpy().tobytes()}
    served = s3.served("GET")
    assert 16 << 20 <= served < 0.7 * total, (served, total)


def test_bin_url_to_url_streams(s3: Any, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    torch.manual_seed(2)
    sd = {"a.weight": torch.randn(8, 4), "b.bias": torch.randn(3).to(torch.bfloat16)}
    d = tmp_path / "bin"
    d.mkdir()
    torch.save(sd, d / "pytorch_model.bin")
    (d / "config.json").write_text('{"model_type": "mlp"}')
    (d / "generation_config.json").write_text('{"do_sample": false}')
    url = _upload(s3, d, "bin-src")
    out = f"s3://{s3.bucket}/bin-out"
    request.getfixturevalue("no_local_staging")
    assert convert_checkpoint(url, out, source="bin") == out
    got = _objects(s3, out)
    assert got["config.json"] == b'{"model_type": "mlp"}'
    assert got["generation_config.json"] == b'{"do_sample": false}'
    assert _tensors(out) == {k: v.view(torch.uint8).numpy().tobytes() for k, v in sd.items()}


def test_failed_conversions_to_a_url_leave_nothing(
    s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = _training_dcp(tmp_path)
    url = _upload(s3, src, "fail-src")
    import unickpt.tools._write as write_mod

    real = write_mod._raw
    calls = {"n": 0}

    def third_fails(d: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("disk gone")
        return real(d)

    monkeypatch.setattr(write_mod, "_raw", third_fails)
    out = f"s3://{s3.bucket}/fail-out"
    with pytest.raises(OSError, match="disk gone"):
        convert_checkpoint(url, out, source="dcp", max_shard_size="1KB")
    assert _objects(s3, out) == {}
    monkeypatch.setattr(write_mod, "_raw", real)
    # The same output URL is free: a retry writes it whole.
    assert convert_checkpoint(url, out, source="dcp") == out
    assert "model.safetensors.index.json" in _objects(s3, out)
    # An export to DCP failing after its data files: no .distcp object is left either.
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    def finish_fails(self: Any, *a: Any, **k: Any) -> None:
        raise OSError("metadata lost")

    monkeypatch.setattr(FsspecWriter, "finish", finish_fails)
    dcp_out = f"s3://{s3.bucket}/fail-dcp"
    with pytest.raises(CheckpointException, match="metadata lost"):
        convert_checkpoint(out, dcp_out, source="unickpt", target="dcp")
    assert _objects(s3, dcp_out) == {}
    assert _uploads(s3) == []


def _big_saved(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    """A sliced checkpoint of about 12 MiB: a single-file merge of it needs two 8 MiB parts."""
    from unickpt import GeneralCheckpointIO

    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2560), torch.nn.Linear(2560, 256))
    local = tmp_path / "big"
    GeneralCheckpointIO().save_model(model, str(local), shard=True, size_per_shard=4)
    return local, model


def test_single_file_merge_to_url_streams_with_its_header_part_last(
    s3: Any, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    from unickpt.tools.merge import merge_checkpoint

    local, model = _big_saved(tmp_path)
    merge_checkpoint(local, tmp_path / "ref")
    ref = (tmp_path / "ref" / "model.safetensors").read_bytes()
    assert len(ref) > 8 << 20  # more than one part
    url = _upload(s3, local, "big")
    out = f"s3://{s3.bucket}/big-merged"
    request.getfixturevalue("no_local_staging")
    s3.reset()
    merge_checkpoint(url, out)
    got = _objects(s3, out)
    assert got["model.safetensors"] == ref  # the same bytes as the local merge, header included
    assert s3.received("PUT") == len(ref)  # every byte uploaded once: no staging copy, no re-upload
    assert _uploads(s3) == []
    sd = {k: v.numpy().tobytes() for k, v in model.state_dict().items()}
    assert _tensors(out) == sd


def test_failed_single_file_merge_to_url_leaves_nothing(s3: Any, tmp_path: Path) -> None:
    from unickpt.errors import IntegrityError
    from unickpt.tools.merge import merge_checkpoint

    local, _ = _big_saved(tmp_path)
    # The last data file's last bytes are damaged: the merge fails after uploading parts.
    victim = sorted(local.glob("model-*.safetensors"))[-1]
    data = bytearray(victim.read_bytes())
    data[-2] ^= 1
    victim.write_bytes(bytes(data))
    out = f"s3://{s3.bucket}/big-failed"
    with pytest.raises(IntegrityError, match=victim.name):
        merge_checkpoint(local, out)
    assert _objects(s3, out) == {}
    assert _uploads(s3) == []
