"""The version string lives in one place: ``unickpt.__version__``."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest

import unickpt

ROOT = Path(__file__).resolve().parents[3]


def test_pyproject_reads_the_version_from_the_package() -> None:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"]
    assert "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "unickpt.__version__"}
    assert importlib.metadata.version("unickpt") == unickpt.__version__


def test_no_other_module_spells_the_version() -> None:
    literal = re.compile(r"""["']unickpt \d+\.\d+""")
    spelled = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "unickpt").rglob("*.py")
        if p != ROOT / "unickpt" / "__init__.py" and literal.search(p.read_text())
    ]
    assert not spelled


def test_writers_stamp_the_package_version() -> None:
    from unickpt.io import write_strategy
    from unickpt.tools import _write

    stamp = f"unickpt {unickpt.__version__}"
    assert stamp == write_strategy.VERSION
    assert stamp == _write.write_checkpoint.__kwdefaults__["created_by"]
