"""What io asks the store layer of a location instead of its spelling: the options that apply,
a name below it, a side file, and how a save names what it committed (``store.storage``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from unickpt.store.storage import (
    FsspecStorage,
    LocalStorage,
    is_local_file,
    join_location,
    open_location,
    side_file,
    url_options,
)


def test_options_apply_to_urls_only(tmp_path: Path) -> None:
    opts = {"anon": True}
    assert url_options("s3://bucket/ck", opts) is opts
    assert url_options(str(tmp_path), opts) is None
    assert url_options(f"file://{tmp_path}", opts) is None


def test_names_below_a_location_use_its_separator(tmp_path: Path) -> None:
    assert join_location("s3://bucket/ck", "a.json") == "s3://bucket/ck/a.json"
    assert join_location("s3://bucket/ck/", "a.json") == "s3://bucket/ck/a.json"
    assert join_location(str(tmp_path), "a.json") == os.path.join(str(tmp_path), "a.json")


def test_a_side_file_is_the_location_or_below_it(tmp_path: Path) -> None:
    f = tmp_path / "sched"
    f.write_text("{}")
    assert is_local_file(f) and not is_local_file("s3://bucket/sched")
    assert side_file(str(f), "s.json", ".json") == str(f)  # an existing file, whatever its name
    assert side_file(str(tmp_path), "s.json", ".json") == os.path.join(str(tmp_path), "s.json")
    assert side_file(str(tmp_path / "new.json"), "s.json", ".json") == str(tmp_path / "new.json")
    assert side_file("s3://bucket/ck", "s.json", ".json") == "s3://bucket/ck/s.json"
    assert side_file("s3://bucket/ck/x.json", "s.json", ".json") == "s3://bucket/ck/x.json"
    d = tmp_path / "dir.json"
    d.mkdir()
    assert side_file(str(d), "s.json", ".json") == os.path.join(str(d), "s.json")  # a directory


def test_a_local_location_is_shown_absolute_its_single_file_as_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    where = open_location("ck", {"ignored": 1})
    assert isinstance(where.storage, LocalStorage)
    assert where.path == where.shown == str(tmp_path / "ck") and not where.is_file
    assert where.shown_file("model.safetensors") == os.path.join("ck", "model.safetensors")
    (tmp_path / "f.bin").write_bytes(b"")
    existing = open_location(f"file://{tmp_path}/f.bin", None)
    assert existing.is_file and existing.shown_file("model.safetensors") == f"{tmp_path}/f.bin"


def test_a_url_is_shown_as_given() -> None:
    where = open_location("memory://loc/ck", None)
    assert isinstance(where.storage, FsspecStorage) and not where.is_file
    assert where.shown == where.shown_file("model.safetensors") == "memory://loc/ck"
    one = open_location("memory://loc/m.safetensors", None)
    assert one.is_file and one.shown_file("model.safetensors") == "memory://loc/m.safetensors"
