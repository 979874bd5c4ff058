"""Lightning's Trainer saving and resuming through ``UnickptCheckpointIO``: bit-exact resume, unickpt's hashes."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch", reason="lightning is not installed (make peers)")

from unickpt import verify_checkpoint  # noqa: E402
from unickpt.errors import IncompleteCheckpointError, IntegrityError  # noqa: E402
from unickpt.integrations.lightning import STATE_FILE, UnickptCheckpointIO  # noqa: E402


class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        self.losses: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> object:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, betas=(0.8, 0.95))
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": sched}


def _data() -> torch.utils.data.DataLoader[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(24, 6, generator=g)
    ds = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    return torch.utils.data.DataLoader(ds, batch_size=6, shuffle=False)


def _trainer(root: Path, epochs: int, **kw: object) -> pl.Trainer:
    return pl.Trainer(
        default_root_dir=root,
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[UnickptCheckpointIO()],
        **kw,  # type: ignore[arg-type]
    )


def test_resume_is_bit_exact_and_files_carry_hashes(tmp_path: Path) -> None:
    full = _Tiny()
    _trainer(tmp_path / "full", 4, enable_checkpointing=False).fit(full, _data())

    first = _Tiny()
    ckpt_cb = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ck", save_top_k=-1, save_last=True)
    _trainer(tmp_path / "a", 2, callbacks=[ckpt_cb]).fit(first, _data())
    ckpt = tmp_path / "ck" / "epoch=1-step=8.ckpt"
    assert ckpt.is_dir() and (ckpt / STATE_FILE).is_file()
    assert sorted(os.listdir(ckpt)) == [STATE_FILE, "model", "state"]
    # No pickle anywhere: safetensors, JSON.
    for f in ckpt.rglob("*"):
        if f.is_file():
            assert f.suffix in (".safetensors", ".json"), f
    for part in ("model", "state"):
        report = verify_checkpoint(str(ckpt / part))
        assert list(report) == [] and report.unickpt_block, report
        assert report.hashed == report.slices > 0 and report.unhashed == 0
        assert report.fingerprints == report.tensors > 0
    # The CLI's verify passes too (exit 0).
    import subprocess
    import sys

    cli = subprocess.run(
        [sys.executable, "-m", "unickpt", "verify", str(ckpt / "model")], capture_output=True
    )
    assert cli.returncode == 0, cli.stdout + cli.stderr
    meta = json.loads((ckpt / STATE_FILE).read_text())
    assert meta["checkpoint"]["epoch"] == 1 and meta["checkpoint"]["global_step"] == 8

    second = _Tiny()
    resumed_cb = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ck", save_top_k=-1, save_last=True)
    with warnings.catch_warnings():  # Lightning's note that the callback's directory is not empty
        warnings.filterwarnings("ignore", "Checkpoint directory .* exists and is not empty")
        _trainer(tmp_path / "b", 4, callbacks=[resumed_cb]).fit(second, _data(), ckpt_path=str(ckpt))
    # The callback's own state came back, and it went on saving (last.ckpt replaced in place).
    assert sorted(os.listdir(tmp_path / "ck")) == [f"epoch={e}-step={4 * (e + 1)}.ckpt" for e in range(4)] + [
        "last.ckpt"
    ]
    assert any(k.startswith("ModelCheckpoint") for k in meta["checkpoint"]["callbacks"])
    assert UnickptCheckpointIO().load_checkpoint(tmp_path / "ck" / "last.ckpt")["global_step"] == 16
    assert first.losses + second.losses == full.losses  # bit-exact floats
    for (n, a), (_, b) in zip(full.state_dict().items(), second.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    so, fo = second.trainer.optimizers[0].state_dict(), full.trainer.optimizers[0].state_dict()
    assert so["param_groups"] == fo["param_groups"]
    for k, st in fo["state"].items():
        for key, v in st.items():
            assert torch.equal(so["state"][k][key], v), (k, key)


def test_checkpoint_dict_round_trips_exactly(tmp_path: Path) -> None:
    io = UnickptCheckpointIO()
    sd = {"net.0.weight": torch.randn(3, 4), "net.0.bias": torch.arange(3, dtype=torch.bfloat16)}
    ck = {
        "state_dict": sd,
        "epoch": 3,
        "global_step": 17,
        "optimizer_states": [
            {
                "state": {0: {"step": torch.tensor(5.0), "exp_avg": torch.ones(3, 4)}},
                "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0, 1]}],
            }
        ],
        "callbacks": {
            "ModelCheckpoint{'monitor': None}": {"best_model_score": None, "kth_value": float("inf")}
        },
        "hyper_parameters": {"name": "x", "sizes": [1, 2]},
    }
    path = tmp_path / "c.ckpt"
    io.save_checkpoint(ck, path)
    back = io.load_checkpoint(path)
    assert sorted(back) == sorted(ck)
    for k, v in sd.items():
        assert back["state_dict"][k].dtype == v.dtype and torch.equal(back["state_dict"][k], v)
    st = back["optimizer_states"][0]
    assert st["param_groups"] == ck["optimizer_states"][0]["param_groups"]  # type: ignore[index]
    assert isinstance(st["param_groups"][0]["betas"], tuple)
    assert torch.equal(st["state"][0]["exp_avg"], torch.ones(3, 4)) and st["state"][0]["step"].item() == 5.0
    assert back["callbacks"] == ck["callbacks"] and back["hyper_parameters"] == ck["hyper_parameters"]
    # The inf score is a JSON literal, as in every JSON file unickpt writes (no tag of its own).
    text = (path / STATE_FILE).read_text()
    assert '"kth_value": Infinity' in text and "__float__" not in text
    # Saving again under the same name replaces it atomically; nothing left beside it.
    ck["epoch"] = 4
    io.save_checkpoint(ck, path)
    assert io.load_checkpoint(path)["epoch"] == 4
    assert sorted(os.listdir(tmp_path)) == ["c.ckpt"]
    io.remove_checkpoint(path)
    assert not path.exists()


def test_a_flipped_byte_is_caught_and_a_torn_save_never_commits(tmp_path: Path) -> None:
    io = UnickptCheckpointIO()
    path = tmp_path / "c.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.arange(64, dtype=torch.float32)}, "epoch": 1}, path)
    data = next((path / "model").glob("*.safetensors"))
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 0x40
    data.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match="'w'"):
        io.load_checkpoint(path)
    with pytest.raises(IncompleteCheckpointError, match="missing"):
        io.load_checkpoint(tmp_path / "nothing.ckpt")
    # A value JSON cannot hold fails the save before anything is committed; the old one stays.
    io.save_checkpoint({"state_dict": {"w": torch.zeros(2)}, "epoch": 1}, path)
    from unickpt.errors import UnsupportedError

    with pytest.raises(UnsupportedError, match="hyper_parameters"):
        io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "hyper_parameters": {"f": object()}}, path)
    assert torch.equal(io.load_checkpoint(path)["state_dict"]["w"], torch.zeros(2))
    assert sorted(os.listdir(tmp_path)) == ["c.ckpt"]


def test_a_save_failing_at_any_stage_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    from unickpt import _faults

    io = UnickptCheckpointIO()
    path = tmp_path / "last.ckpt"
    old = {
        "state_dict": {"w": torch.zeros(4)},
        "epoch": 1,
        "optimizer_states": [{"state": {0: {"m": torch.ones(4)}}}],
    }
    io.save_checkpoint(old, path)
    new = {
        "state_dict": {"w": torch.ones(4)},
        "epoch": 2,
        "optimizer_states": [{"state": {0: {"m": torch.zeros(4)}}}],
    }
    with _faults.tracing() as stages:
        io.save_checkpoint(new, tmp_path / "probe.ckpt")
    io.remove_checkpoint(tmp_path / "probe.ckpt")
    assert {"save.write", "save.commit", "model.hf_config"} <= set(stages), stages
    for stage in dict.fromkeys(stages):
        with _faults.injected(stage, 0), pytest.raises(_faults.InjectedFault):
            io.save_checkpoint(new, path)
        back = io.load_checkpoint(path)
        assert back["epoch"] == 1 and torch.equal(back["state_dict"]["w"], torch.zeros(4)), stage
        assert sorted(os.listdir(tmp_path)) == ["last.ckpt"], (stage, os.listdir(tmp_path))
    io.save_checkpoint(new, path)
    assert io.load_checkpoint(path)["epoch"] == 2


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ('{"checkpoint": {}, "checkpoint": {}}', "has a duplicate key 'checkpoint'"),
        ('{"checkpoint": ', "is not valid JSON"),
        ("[" * 100_000 + "]" * 100_000, "is nested too deeply"),
        (b'{"checkpoint": "\xff"}', "is not valid JSON (not UTF-8"),
    ],
)
def test_a_hostile_state_file_is_refused_naming_it(tmp_path: Path, text: str | bytes, found: str) -> None:
    from unickpt.errors import IndexFileError

    io = UnickptCheckpointIO()
    path = tmp_path / "c.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.zeros(2)}, "epoch": 1}, path)
    meta = path / STATE_FILE
    meta.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(IndexFileError) as e:
        io.load_checkpoint(path)
    assert str(meta) in str(e.value) and found in str(e.value), str(e.value)


def _s3_objects(s3: object, prefix: str) -> list[str]:
    import boto3

    client = boto3.client("s3", endpoint_url=s3.endpoint)  # type: ignore[attr-defined]
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=s3.bucket, Prefix=prefix)  # type: ignore[attr-defined]
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


def test_a_trainer_saves_to_and_resumes_from_an_object_store(tmp_path: Path, s3: object) -> None:
    """``ModelCheckpoint(dirpath="s3://...")``: Lightning's own file system and unickpt's storage
    layer take the same store (moto's S3 server); top-k removal, ``last.ckpt`` replaced in place,
    and a resume from the URL that matches an uninterrupted run bit for bit."""
    url = f"s3://{s3.bucket}/ck"  # type: ignore[attr-defined]
    full = _Tiny()
    _trainer(tmp_path / "full", 4, enable_checkpointing=False).fit(full, _data())
    first = _Tiny()
    cb = pl.callbacks.ModelCheckpoint(dirpath=url, save_top_k=1, monitor="step", mode="max", save_last=True)
    _trainer(tmp_path / "a", 2, callbacks=[cb]).fit(first, _data())
    keys = _s3_objects(s3, "ck/")
    # top-k kept one epoch checkpoint (the other removed whole), and last.ckpt
    assert {k.split("/")[1] for k in keys} == {"epoch=1-step=8.ckpt", "last.ckpt"}, keys
    assert "ck/last.ckpt/lightning.json" in keys and not any(k.endswith(".pt") for k in keys)
    report = verify_checkpoint(f"{url}/last.ckpt/model")
    assert list(report) == [] and report.hashed == report.slices > 0
    second = _Tiny()
    cb2 = pl.callbacks.ModelCheckpoint(dirpath=url, save_top_k=1, monitor="step", mode="max", save_last=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Checkpoint directory .* exists and is not empty")
        _trainer(tmp_path / "b", 4, callbacks=[cb2]).fit(second, _data(), ckpt_path=f"{url}/last.ckpt")
    assert first.losses + second.losses == full.losses
    for (n, a), (_, b) in zip(full.state_dict().items(), second.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    assert UnickptCheckpointIO().load_checkpoint(f"{url}/last.ckpt")["global_step"] == 16
    assert {k.split("/")[1] for k in _s3_objects(s3, "ck/")} == {"epoch=3-step=16.ckpt", "last.ckpt"}


def test_a_failed_save_on_an_object_store_commits_nothing_and_leaves_nothing(s3: object) -> None:
    """A save over a committed checkpoint on a store un-commits it first (its ``lightning.json``
    goes before anything else), so a failure part way leaves no checkpoint of that name, never a
    mix; the objects it wrote are removed; the next save of that name commits whole."""
    from unittest import mock

    url = f"s3://{s3.bucket}/run/last.ckpt"  # type: ignore[attr-defined]
    io = UnickptCheckpointIO()
    io.save_checkpoint({"state_dict": {"w": torch.zeros(4)}, "epoch": 1, "m": torch.ones(3)}, url)
    assert io.load_checkpoint(url)["epoch"] == 1
    import unickpt.integrations.lightning as lightning

    with (
        mock.patch.object(lightning, "state_json", side_effect=RuntimeError("disk on fire")),
        pytest.raises(RuntimeError, match="disk on fire"),
    ):
        io.save_checkpoint({"state_dict": {"w": torch.ones(4)}, "epoch": 2, "m": torch.zeros(3)}, url)
    assert _s3_objects(s3, "run/") == []
    with pytest.raises(IncompleteCheckpointError, match=r"last\.ckpt: missing"):
        io.load_checkpoint(url)
    io.save_checkpoint({"state_dict": {"w": torch.ones(4)}, "epoch": 2, "m": torch.zeros(3)}, url)
    back = io.load_checkpoint(url)
    assert back["epoch"] == 2 and torch.equal(back["state_dict"]["w"], torch.ones(4))
    assert torch.equal(back["m"], torch.zeros(3))
    # A prefix with objects but no lightning.json is no checkpoint, and is not removed.
    from unickpt.errors import UnsupportedError
    from unickpt.store.publish import write_small_file

    other = f"s3://{s3.bucket}/run/other.ckpt"  # type: ignore[attr-defined]
    write_small_file(f"{other}/notes.txt", b"mine")
    with pytest.raises(IncompleteCheckpointError, match=r"other\.ckpt: no lightning\.json"):
        io.load_checkpoint(other)
    with pytest.raises(UnsupportedError, match=r"without lightning\.json; refusing"):
        io.remove_checkpoint(other)
    io.remove_checkpoint(url)
    assert _s3_objects(s3, "run/") == ["run/other.ckpt/notes.txt"]
