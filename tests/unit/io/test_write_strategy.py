"""The save engine's strategy table: which write strategy a save's options and its store's
capabilities choose (``io.save.choose_strategy``), and one save per strategy a single process runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from unickpt.io import GeneralCheckpointIO
from unickpt.io import save as save_mod
from unickpt.io.funnel_save import Funnel, FunnelSingle
from unickpt.io.hf_save import InPlaceHF
from unickpt.io.parts_save import SharedParts
from unickpt.io.save import Sliced, choose_strategy, save_tensors, writes_in_place
from unickpt.io.tensors import local_slices
from unickpt.io.write_strategy import SaveOptions
from unickpt.spec.index import LayoutInfo
from unickpt.store.storage import LocalStorage, Storage, open_storage


def _opts(*, shard: bool, gather: bool) -> SaveOptions:
    return SaveOptions("model", shard, gather, 1024, LayoutInfo())


class _Bare(Storage):
    """A store that can do nothing the strategies ask for (no offsets, no renames, no shared parts)."""


def test_sliced_saves_are_sliced_on_any_store() -> None:
    for store in (LocalStorage("/tmp"), _Bare()):
        assert isinstance(choose_strategy(_opts(shard=True, gather=False), store), Sliced)


def test_gathered_save_in_a_directory_writes_in_place() -> None:
    store = LocalStorage("/tmp")
    assert writes_in_place(store)
    live = choose_strategy(_opts(shard=True, gather=True), store)
    assert isinstance(live, InPlaceHF) and live.rows is not None
    copy = choose_strategy(_opts(shard=False, gather=True), store, live=False)
    assert isinstance(copy, InPlaceHF) and copy.rows is None  # an async save's copies stay as they are


def test_range_write_without_renames_is_not_in_place() -> None:
    class _Offsets(_Bare):
        range_write = True

    assert not writes_in_place(_Offsets())
    assert isinstance(choose_strategy(_opts(shard=True, gather=True), _Offsets()), Funnel)


def test_a_store_without_offsets_nor_shared_parts_funnels() -> None:
    store, _ = open_storage("memory://choose/x")
    assert isinstance(choose_strategy(_opts(shard=True, gather=True), store), Funnel)
    single = choose_strategy(_opts(shard=False, gather=True), store)
    assert isinstance(single, FunnelSingle)


def test_shared_multipart_uploads_share_the_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    store, _ = open_storage("memory://choose/y")
    monkeypatch.setattr(save_mod, "supports_shared_parts", lambda s: True)
    chosen = choose_strategy(_opts(shard=True, gather=True), store)
    assert isinstance(chosen, SharedParts) and chosen.store is store


@pytest.mark.parametrize(
    ("location", "shard", "gather", "strategy"),
    [
        ("local", True, False, "sliced"),
        ("local", True, True, "in-place"),
        ("local", False, True, "in-place"),
        ("memory", True, False, "sliced"),
        ("memory", True, True, "funnel"),
        ("memory", False, True, "funnel-single"),
    ],
)
def test_each_strategy_saves_what_it_was_given(
    tmp_path: Path, location: str, shard: bool, gather: bool, strategy: str
) -> None:
    path = str(tmp_path / "ck") if location == "local" else f"memory://engine-{tmp_path.name}/{strategy}"
    opts = _opts(shard=shard, gather=gather)
    store, _ = open_storage(path)
    assert choose_strategy(opts, store).name == strategy
    tensors = {
        "a": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "b": torch.ones(5, dtype=torch.int64),
    }
    committed = save_tensors(tensors, path, opts, local_slices)
    m = torch.nn.Module()
    m.register_buffer("a", torch.zeros(3, 4))
    m.register_buffer("b", torch.zeros(5, dtype=torch.int64))
    GeneralCheckpointIO().load_model(m, committed, verify=True)
    for name, want in tensors.items():
        assert torch.equal(m.state_dict()[name], want), name
