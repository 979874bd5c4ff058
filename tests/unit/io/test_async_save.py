"""``io/async_save.py``: an async save returns the path a synchronous save of the same arguments returns.

``committed_path`` computes it before anything is written (the save is committed later, by the
writer process or a thread); what the store says (a local path or none) decides, never the
location's spelling: a relative directory comes back absolute, a single file below the path as
given, a ``file://`` URL as its local path, a ``memory://`` URL as given.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
import torch

from unickpt.errors import UnickptError
from unickpt.io import GeneralCheckpointIO
from unickpt.io.async_save import committed_path

pytestmark = pytest.mark.timeout(300)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)


@pytest.mark.parametrize("shard", [True, False])
def test_async_returns_what_the_sync_save_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shard: bool
) -> None:
    monkeypatch.chdir(tmp_path)
    io = GeneralCheckpointIO()
    tag = uuid.uuid4().hex[:8]
    locations = ["rel", f"file://{tmp_path}/url", f"memory://unickpt-{tag}/m"]
    if not shard:
        locations.append("one.safetensors")
    try:
        for loc in locations:
            sync = io.save_model(
                _model(), f"{loc}-sync" if not loc.endswith(".safetensors") else "s-" + loc, shard=shard
            )
            got = io.save_model(
                _model(),
                f"{loc}-async" if not loc.endswith(".safetensors") else "a-" + loc,
                shard=shard,
                use_async=True,
            )
            io.wait()
            assert got == sync.replace("-sync", "-async").replace("s-one", "a-one"), loc
    finally:
        io.close()
    assert os.path.isabs(committed_path("rel", "model", True, False))
    assert committed_path("rel", "model", False, True) == os.path.join("rel", "model.safetensors")
    assert committed_path(f"file://{tmp_path}/x", "model", True, False) == f"{tmp_path}/x"
    assert committed_path(f"memory://unickpt-{tag}/y", "model", True, False) == f"memory://unickpt-{tag}/y"


def test_a_sharded_save_into_a_file_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"")
    with pytest.raises(UnickptError, match="is a directory"):
        committed_path(str(f), "model", True, False)
