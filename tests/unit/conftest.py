"""Fixtures shared by every unit test; the models and the checkpoint builder they use are in
``_reliability.py`` (importable: ``pythonpath`` holds tests/unit)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _reliability import save_checkpoint


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``long`` run first: pytest-xdist hands out tests in this order, and a long test
    taken last would run alone while the other workers have nothing left to do."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


@pytest.fixture
def make_checkpoint(tmp_path: Path) -> Callable[..., Path]:
    """``make_checkpoint(name="ck", seed=0, **save_checkpoint's options) -> path``: a checkpoint
    of ``Tiny(seed)`` (or ``model=``) under ``tmp_path``."""

    def make(name: str = "ck", seed: int = 0, **kw: Any) -> Path:
        path = tmp_path / name
        save_checkpoint(path, seed, **kw)
        return path

    return make
