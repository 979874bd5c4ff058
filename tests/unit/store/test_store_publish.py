"""The store layer's own API: one save lock chosen by the store's capability, one commit-point
PUT, one small-file writer (unickpt/store/lock.py, unickpt/store/publish.py)."""

from __future__ import annotations

import json
import os
import re
import uuid
from pathlib import Path

import pytest

from unickpt.errors import CheckpointBusyError, OutputExistsError
from unickpt.store.lock import LOCK_NAME, HeldFlock, StoreLock, directory_lock, save_lock
from unickpt.store.publish import (
    DirectoryOutput,
    StoreOutput,
    output_location,
    output_sink,
    put_commit_point,
    write_small_file,
)
from unickpt.store.storage import LocalStorage, open_storage, url_options


def test_capabilities_come_from_the_store_object(s3) -> None:
    local, _ = open_storage("/tmp")
    memory, _ = open_storage(f"memory://caps-{uuid.uuid4().hex[:8]}/x")
    remote, _ = open_storage(f"s3://{s3.bucket}/caps")
    assert (local.atomic_rename, local.conditional_put) == (True, False)
    assert (memory.atomic_rename, memory.conditional_put) == (False, False)
    assert (remote.atomic_rename, remote.conditional_put) == (False, True)


def test_save_lock_on_a_local_directory_is_the_flock(tmp_path: Path) -> None:
    d = str(tmp_path)
    with save_lock(LocalStorage(d), d, "a" * 32) as held:
        assert isinstance(held, HeldFlock)
        held.check("committing")  # a flock is never taken over while its holder lives
        assert held.holder() == "this save" and held.versions is None
        assert (tmp_path / LOCK_NAME).read_text().split() == [str(os.getpid())]
        with (
            pytest.raises(
                CheckpointBusyError, match=rf"{d} is being written by another save: its lock .*{LOCK_NAME}"
            ),
            directory_lock(d),
        ):
            pass
    assert not (tmp_path / LOCK_NAME).exists()  # unlinked by its holder on release
    with directory_lock(d):  # free again
        pass


def test_save_lock_on_a_store_is_the_lock_object_of_the_same_name() -> None:
    store, root = open_storage(f"memory://lock-{uuid.uuid4().hex[:8]}/ckpt")
    with save_lock(store, root, "a" * 32, listed=True) as held:
        assert isinstance(held, StoreLock) and held.listed is not None
        assert store.listdir(root) == [LOCK_NAME]
        assert json.loads(store.read_bytes(store.join(root, LOCK_NAME)))["save_id"] == "a" * 32
        with (
            pytest.raises(
                CheckpointBusyError, match=r"another save is writing this checkpoint directory \(save a{32}"
            ),
            save_lock(store, root, "b" * 32),
        ):
            pass
        held.check("committing")
    assert store.listdir(root) == []  # released: deleted


def test_commit_point_exclusive_never_overwrites() -> None:
    store, root = open_storage(f"memory://cp-{uuid.uuid4().hex[:8]}/out")
    path = store.join(root, "model.safetensors.index.json")
    assert put_commit_point(store, path, b"first", None, exclusive=True) is True
    assert put_commit_point(store, path, b"second", None, exclusive=True) is False
    assert store.read_bytes(path) == b"first"
    assert put_commit_point(store, path, b"third", None) is True  # not exclusive: replaced whole
    assert store.read_bytes(path) == b"third"


def test_small_file_writer_replaces_locally_and_puts_on_a_store(tmp_path: Path) -> None:
    target = tmp_path / "new" / "sub" / "lr_scheduler.json"
    write_small_file(str(target), b"one")
    write_small_file(str(target), b"two")
    assert target.read_bytes() == b"two"
    assert sorted(os.listdir(target.parent)) == ["lr_scheduler.json"]  # no staged name left
    url = f"memory://small-{uuid.uuid4().hex[:8]}/run/lr_scheduler.json"
    write_small_file(url, b"three")
    store, path = open_storage(url)
    assert store.read_bytes(path) == b"three"


def test_a_tool_output_is_published_whole_or_not_at_all(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with output_sink(str(out)) as sink:
        assert isinstance(sink, DirectoryOutput) and not out.exists()  # staged under a hidden name
        assert sink.url == str(out) and sink.root != sink.url
        sink.put("config.json", b"{}")
    assert sorted(os.listdir(out)) == ["config.json"]
    with pytest.raises(OutputExistsError, match=rf"{out} already exists"), output_sink(str(out)):
        pass
    failed = tmp_path / "failed"
    with pytest.raises(RuntimeError, match="boom"), output_sink(str(failed)) as sink:
        sink.put("config.json", b"{}")
        raise RuntimeError("boom")
    assert not failed.exists() and sorted(os.listdir(tmp_path)) == ["out"]
    url = f"memory://tool-{uuid.uuid4().hex[:8]}/out"
    with pytest.raises(RuntimeError, match="boom"), output_sink(url) as sink:
        sink.put("config.json", b"{}")
        raise RuntimeError("boom")
    store, root = open_storage(url)
    assert store.listdir(root) == []  # nothing left: neither the file nor the lock object


def test_storage_options_apply_to_urls_only(tmp_path: Path) -> None:
    """One set of options given with a local location and a URL: the URL's, ignored locally
    (where ``open_storage`` alone refuses them), for the small-file writer and a tool's output."""
    opts = {"skip_instance_cache": True}
    assert url_options(str(tmp_path), opts) is None
    assert url_options(f"file://{tmp_path}", opts) is None
    assert url_options("memory://b/x", opts) == opts
    target = tmp_path / "side" / "config.json"
    write_small_file(str(target), b"{}", opts)
    assert target.read_bytes() == b"{}"
    out = tmp_path / "out"
    with output_sink(str(out), opts) as sink:
        assert isinstance(sink, DirectoryOutput)  # a staged directory: the local store renames
        sink.put("config.json", b"{}")
    assert sorted(os.listdir(out)) == ["config.json"]
    url = f"memory://opts-{uuid.uuid4().hex[:8]}/out"
    with output_sink(url, opts) as sink:
        assert isinstance(sink, StoreOutput)  # a store without rename
        sink.put("config.json", b"{}")
    store, root = open_storage(url)
    assert store.read_bytes(store.join(root, "config.json")) == b"{}"


def test_output_location_is_the_shown_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert output_location("rel/out") == str(tmp_path / "rel" / "out")  # absolute
    assert output_location("memory://b/out/") == "memory://b/out"  # a URL as given
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_bytes(b"")
    with pytest.raises(OutputExistsError, match="already exists and is not an empty directory"):
        output_location("used")


# ----------------------------------------------------------------------------- a checkpoint of parts
def test_parts_output_on_a_store_is_fenced(s3, monkeypatch) -> None:
    """Two writers of one checkpoint of parts on a store: the second is refused while the first
    holds the prefix's lock; a writer whose lock was taken over as stale (a stalled process that
    resumes) commits nothing and removes nothing of its successor's."""
    from unickpt.store.publish import PartsOutput, open_parts

    url = f"s3://{s3.bucket}/parts/last.ckpt"
    monkeypatch.setenv("UNICKPT_STORE_LOCK_STALE", "100")
    a = PartsOutput(url, "state.json")
    assert a.root == url and a.location("model") == f"{url}/model"
    with pytest.raises(CheckpointBusyError):
        PartsOutput(url, "state.json")
    write_small_file(a.location("model/w.bin"), b"a")
    monkeypatch.setenv("UNICKPT_STORE_LOCK_STALE", "0")
    b = PartsOutput(url, "state.json")  # takes A's lock over; clears what A wrote
    monkeypatch.setenv("UNICKPT_STORE_LOCK_STALE", "100")
    write_small_file(b.location("model/w.bin"), b"b")
    with pytest.raises(CheckpointBusyError, match="lost its lock"):
        a.commit(b"{}")  # A resumes: refused, and its abort leaves B's objects
    b.commit(b'{"by": "b"}')
    where, raw = open_parts(url, "state.json")
    assert (where, raw) == (url, b'{"by": "b"}')
    store, root = open_storage(url)
    assert store.read_bytes(store.join(root, "model/w.bin")) == b"b"
    assert sorted(store.listdir(root)) == ["model", "state.json"]  # the lock released


def test_parts_output_puts_back_a_copy_left_aside(tmp_path: Path) -> None:
    """Where the kernel cannot swap two names, the old copy is renamed aside before the new one
    goes in: killed between the two, readers find the aside copy, and the next writer puts it back
    before staging (so an abort leaves the old checkpoint where it was)."""
    from unickpt.errors import IncompleteCheckpointError
    from unickpt.store.publish import PartsOutput, open_parts

    target = tmp_path / "last.ckpt"
    out = PartsOutput(str(target), "state.json")
    write_small_file(out.location("model/w.bin"), b"old")
    out.commit(b"old")
    aside = tmp_path / ".last.ckpt.replaced-0123456789ab"
    os.rename(target, aside)  # the state a kill after the first rename leaves
    assert open_parts(str(target), "state.json") == (str(aside), b"old")
    (tmp_path / ".last.ckpt.replaced-ba9876543210").mkdir()  # an uncommitted one: removed
    again = PartsOutput(str(target), "state.json")
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(again.root), "last.ckpt"]
    again.abort()
    assert os.listdir(tmp_path) == ["last.ckpt"]
    assert open_parts(str(target), "state.json") == (str(target), b"old")
    (target / "state.json").unlink()
    with pytest.raises(
        IncompleteCheckpointError, match=r"last\.ckpt: no state\.json; not a committed checkpoint"
    ):
        open_parts(str(target), "state.json")


def test_open_parts_names_what_it_found(tmp_path: Path) -> None:
    from unickpt.errors import IncompleteCheckpointError
    from unickpt.store.publish import open_parts

    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_bytes(b"x")
    for name, found in (
        ("empty", "no state.json; not a committed checkpoint"),
        ("file", "found a file, not a checkpoint directory"),
        ("nothing", "missing"),
    ):
        with pytest.raises(IncompleteCheckpointError, match=rf"{name}: {re.escape(found)}$"):
            open_parts(str(tmp_path / name), "state.json")
