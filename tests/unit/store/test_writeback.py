"""Early writeback while a data file is written: the same bytes, hints that cover the file in
order, and a save that fsyncs every file before committing whatever the hints did."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from unickpt import GeneralCheckpointIO
from unickpt.ckpt.safetensors_io import SafetensorsWriter
from unickpt.store import storage as storage_mod


def _write(path: Path, arrays: dict[str, np.ndarray], writeback: bool) -> None:
    specs = [(k, "F32", tuple(a.shape)) for k, a in arrays.items()]
    w = SafetensorsWriter(str(path), specs, {"format": "pt"}, writeback=writeback)
    for k, a in arrays.items():
        w.write(k, memoryview(a).cast("B"))
    w.close()


def test_writeback_hints_cover_the_file_in_order_and_change_no_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(0)
    arrays = {
        f"t{i}": rng.standard_normal(n, dtype=np.float32) for i, n in enumerate([10, 70_000, 3, 250_001])
    }
    hints: list[tuple[int, int]] = []
    monkeypatch.setattr(storage_mod, "start_writeback", lambda fd, off, n: hints.append((off, n)))
    monkeypatch.setattr(SafetensorsWriter, "WRITEBACK_BYTES", 64 << 10)
    _write(tmp_path / "a.safetensors", arrays, writeback=True)
    _write(tmp_path / "b.safetensors", arrays, writeback=False)
    a, b = (tmp_path / "a.safetensors").read_bytes(), (tmp_path / "b.safetensors").read_bytes()
    assert a == b
    assert len(hints) == len(a) // (64 << 10)  # one per full 64 KiB written; the rest goes with the fsync
    pos = 0
    for off, n in hints:
        assert off == pos and n >= 64 << 10
        pos += n
    assert pos <= len(a)


def test_save_hints_writeback_only_when_it_fsyncs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(storage_mod, "start_writeback", lambda fd, off, n: calls.append(n))
    monkeypatch.setattr(SafetensorsWriter, "WRITEBACK_BYTES", 64 << 10)
    fsynced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (fsynced.append(fd), real_fsync(fd))[1])
    model = nn.Linear(512, 512)
    GeneralCheckpointIO(fsync=False).save_model(model, tmp_path / "nofsync", shard=True)
    assert calls == []
    GeneralCheckpointIO().save_model(model, tmp_path / "m", shard=True)
    assert sum(calls) >= 512 * 512 * 4 - (64 << 10) and fsynced
    loaded = nn.Linear(512, 512)
    GeneralCheckpointIO().load_model(loaded, tmp_path / "m", verify=True)
    assert torch.equal(loaded.weight, model.weight)
