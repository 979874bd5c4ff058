"""A gathered save's flushes (issue 19): each staged data file is fsynced once, after its data."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from unickpt.io.save import SaveOptions, save_tensors
from unickpt.io.tensors import local_slices
from unickpt.spec.index import LayoutInfo
from unickpt.store.storage import LocalRange


def test_a_gathered_save_fsyncs_each_data_file_once_after_writing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 fsyncs the files it creates with its data (not each header first): every staged
    data file is flushed exactly once, after its last write, before it is renamed."""
    events: list[tuple[str, str]] = []
    real_fsync, real_pwrite = os.fsync, LocalRange.pwrite

    def fsync(fd: int) -> None:
        events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        real_fsync(fd)

    def pwrite(f: LocalRange, data: Any, pos: int) -> None:
        events.append(("write", os.path.basename(os.readlink(f"/proc/self/fd/{f.fd}"))))
        real_pwrite(f, data, pos)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(LocalRange, "pwrite", pwrite)
    g = torch.Generator().manual_seed(1)
    state = {f"t{i}": torch.randn(300, 300, generator=g) for i in range(4)}  # 4 files of 1 MB
    opts = SaveOptions(kind="model", shard=True, gather=True, size_per_shard_mb=0.5, layout=LayoutInfo())
    save_tensors(state, str(tmp_path), opts, local_slices)
    staged = sorted({f for e, f in events if f.startswith(".model-") and e == "write"})
    assert len(staged) == 4
    for f in staged:
        assert [e for e, g_ in events if g_ == f] == ["write", "fsync"], (f, events)
