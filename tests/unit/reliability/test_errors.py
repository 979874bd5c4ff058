"""The exception tree of ``unickpt.errors`` is complete: every error unickpt raises on purpose."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import unickpt
from unickpt import errors

PKG = Path(__file__).resolve().parents[3] / "unickpt"


def test_every_error_is_an_unickpt_error_with_its_builtin_base() -> None:
    classes = [getattr(errors, n) for n in errors.__all__ if n != "IntegrityFailure"]
    assert all(issubclass(c, errors.UnickptError) for c in classes)
    assert issubclass(errors.OutputExistsError, FileExistsError)
    assert issubclass(errors.ConfigError, ValueError)
    # The top-level package exports the whole tree.
    assert {n for n in errors.__all__ if n != "IntegrityFailure"} <= set(unickpt.__all__)
    # errors.py's docstring draws every class of the tree.
    assert all(n in (errors.__doc__ or "") for n in errors.__all__ if n != "IntegrityFailure")


def test_tools_keep_exporting_output_exists_error() -> None:
    from unickpt.tools._common import OutputExistsError

    assert OutputExistsError is errors.OutputExistsError


def test_bad_settings_raise_config_error() -> None:
    from unickpt.ckpt.reader import open_checkpoint

    with pytest.raises(errors.ConfigError, match="storage_options are for fsspec URLs"):
        open_checkpoint("/nonexistent", storage_options={"anon": True})


def test_no_assert_in_library_code() -> None:
    found = [
        f"{p.relative_to(PKG.parent)}:{node.lineno}"
        for p in PKG.rglob("*.py")
        for node in ast.walk(ast.parse(p.read_text(), str(p)))
        if isinstance(node, ast.Assert)
    ]
    assert not found
