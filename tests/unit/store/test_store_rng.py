"""Saves and loads through an object store leave the training's Python ``random`` stream alone.

botocore's retry backoff draws its jitter from ``random.random()``: a save that met one slow
S3 response shifted the next steps' data order and dropout (a resumed run stopped matching the
uninterrupted one after its next save). Here the store's writes and reads draw from ``random``
as that retry does, and the stream must come out of every save and load as it went in.
"""

from __future__ import annotations

import random
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

from unickpt import GeneralCheckpointIO
from unickpt.manager import CheckpointManager

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "manager"))
from test_manager import _train


@pytest.fixture
def drawing_store(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``memory://`` whose writes and reads each draw once from ``random``, as a retried request does."""
    draws = {"n": 0}

    def drawing(method: Any) -> Any:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            draws["n"] += 1
            random.random()
            return method(self, *args, **kwargs)

        return call

    for name in ("_open", "pipe_file", "cat_file"):
        monkeypatch.setattr(MemoryFileSystem, name, drawing(getattr(MemoryFileSystem, name)))
    yield draws
    MemoryFileSystem.store.clear()
    MemoryFileSystem.pseudo_dirs[:] = [""]


def test_checkpoint_io_save_and_load_keep_python_random(drawing_store: Any) -> None:
    url = f"memory://rng-{uuid.uuid4().hex}/ckpt"
    model = torch.nn.Linear(4, 3)
    io = GeneralCheckpointIO()
    random.seed(5)
    before = random.getstate()
    io.save_model(model, url, shard=True)
    io.load_model(model, url, verify=True)
    assert drawing_store["n"] > 0  # the store really drew
    assert random.getstate() == before


def test_manager_resume_through_a_drawing_store_is_bit_exact(drawing_store: Any) -> None:
    ref = _train(None, 12)
    url = f"memory://rng-{uuid.uuid4().hex}/run"
    first = _train(CheckpointManager(url, save_steps=5, keep_last=1), 5)
    rest = _train(CheckpointManager(url, save_steps=5, keep_last=1), 12, seed=77)
    assert drawing_store["n"] > 0
    assert first == {s: ref[s] for s in range(1, 6)}
    assert rest == {s: ref[s] for s in range(6, 13)}  # the save at step 10 left the stream alone
