"""Plans and local boxes kept for repeated save layouts (issue 19): reused only for equal inputs."""

from __future__ import annotations

import json
import struct
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from unickpt.ckpt.reader import open_checkpoint
from unickpt.errors import DistributedError, StateMismatchError
from unickpt.io import hf_save, tensors
from unickpt.io.hf_save import InPlaceHF
from unickpt.io.load import load_tensors
from unickpt.io.planner import SavePlan, plan_save
from unickpt.io.save import SaveOptions, save_tensors
from unickpt.io.tensors import local_slices
from unickpt.io.write_strategy import PlanInputs
from unickpt.spec.index import LayoutInfo


def _metas(rows: int = 10) -> list[list[tuple[Any, ...]]]:
    half = rows // 2
    return [
        [("w", "F32", (rows, 3), (0, 0), (half, 3)), ("b", "F32", (3,), (0,), (3,))],
        [("w", "F32", (rows, 3), (half, 0), (rows - half, 3)), ("b", "F32", (3,), (0,), (3,))],
    ]


def _plan(metas: list[list[tuple[Any, ...]]], kind: str = "model") -> SavePlan:
    """A gathered save's plan in the directory ``d``, as the in-place strategy plans it."""
    opts = SaveOptions(kind=kind, shard=False, gather=True, size_per_shard_mb=1.0, layout=LayoutInfo())
    return InPlaceHF(None).plan(PlanInputs(metas, metas, opts, "d", "d", None))


def test_a_plan_is_reused_for_equal_metas_only() -> None:
    first = _plan(_metas())
    assert _plan(_metas()) is first  # built alike: kept
    # Equal metas in other containers only miss the cache: an equal plan, planned again.
    again = [[tuple(list(x) if isinstance(x, tuple) else x for x in m) for m in ms] for ms in _metas()]
    assert _plan(again) == first
    other = _plan(_metas(12))
    assert other is not first
    assert [(ps.offsets, ps.shape, ps.rank) for ps in other.slices["w"]] == [
        ((0, 0), (6, 3), 0),
        ((6, 0), (6, 3), 1),
    ]
    assert _plan(_metas(), "optimizer") is not first
    # The plan is plan_save's (the replicated bias written once).
    assert first == plan_save(_metas(), kind="model", size_per_shard_bytes=None, sliced=True)
    assert len(first.slices["b"]) == 1


def test_a_failed_plan_is_not_kept() -> None:
    bad = _metas()
    bad[1][0] = ("w", "BF16", (10, 3), (5, 0), (5, 3))
    kept = len(hf_save._cache)
    for _ in range(2):  # raised again on the second save: nothing was kept
        with pytest.raises(DistributedError, match=r"d: the ranks disagree on the dtype or global shape"):
            _plan(bad)
    gap = _metas()
    gap[1][0] = ("w", "F32", (10, 3), (6, 0), (4, 3))  # row 5 written by nobody
    for _ in range(2):
        with pytest.raises(StateMismatchError, match=r"tensor 'w'"):
            _plan(gap)
    assert len(hf_save._cache) == kept


def test_only_the_last_plans_are_kept() -> None:
    first = _plan(_metas(100))
    for rows in range(101, 101 + hf_save._KEEP):
        _plan(_metas(rows))
    assert len(hf_save._cache) <= hf_save._KEEP
    assert not hf_save.holds(first)
    assert _plan(_metas(100)) is not first


def test_layouts_of_many_slices_are_planned_every_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hf_save, "_MAX_SLICES", 3)
    first = _plan(_metas(200))  # 4 slices
    assert _plan(_metas(200)) is not first
    assert not hf_save.holds(first)


def _opts() -> SaveOptions:
    return SaveOptions(kind="model", shard=True, gather=True, size_per_shard_mb=1.0, layout=LayoutInfo())


def _names_in_file(path: Path) -> list[str]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return [k for k in json.loads(raw[8 : 8 + n]) if k != "__metadata__"]


def _roundtrip(state: dict[str, torch.Tensor], d: Path) -> None:
    save_tensors(state, str(d), _opts(), local_slices)
    targets = {k: torch.zeros_like(v) for k, v in state.items()}
    load_tensors(open_checkpoint(str(d), "model"), targets, local_slices, strict=True, verify=True)
    for k, v in state.items():
        assert torch.equal(targets[k], v), k
    assert _names_in_file(d / "model-00001-of-00001.safetensors") == list(state)


def test_repeated_gathered_saves_follow_every_change_of_layout(tmp_path: Path) -> None:
    """The same layout saved again reuses its plan; a new order, shape or tensor is planned anew."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 3, generator=g), torch.randn(7, generator=g)
    _roundtrip({"a": a, "b": b}, tmp_path / "d")
    kept = set(hf_save._cache)
    _roundtrip({"a": a + 1, "b": b}, tmp_path / "d")  # same layout: no new plan kept
    assert set(hf_save._cache) == kept
    _roundtrip({"b": b, "a": a}, tmp_path / "d")  # names in another order: the file follows it
    _roundtrip({"a": torch.randn(6, 3, generator=g), "b": b}, tmp_path / "d")
    _roundtrip({"a": a, "b": b, "c": torch.arange(4, dtype=torch.int64)}, tmp_path / "d")
    _roundtrip({"a": a.to(torch.bfloat16), "b": b}, tmp_path / "d")


class _Mesh:
    """Stands in for a DeviceMesh: the box computation is replaced below."""


def test_local_boxes_are_kept_per_mesh_object(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []

    def fake(gshape: tuple[int, ...], mesh: Any, placements: Any) -> tuple[list[int], list[int]]:
        calls.append((gshape, mesh, placements))
        return [len(calls), 2], [3 * len(calls), 0]

    # A stand-in module: importing torch's DTensor package takes seconds.
    stub = types.SimpleNamespace(compute_local_shape_and_global_offset=fake)
    monkeypatch.setitem(sys.modules, "torch.distributed.tensor._utils", stub)
    monkeypatch.setattr(tensors, "_BOXES", {})
    m1, m2 = _Mesh(), _Mesh()
    assert tensors._local_box((8, 2), m1, ("S0",)) == ((1, 2), (3, 0))
    assert tensors._local_box((8, 2), m1, ["S0"]) == ((1, 2), (3, 0))  # kept
    assert len(calls) == 1
    assert tensors._local_box((8, 2), m2, ("S0",)) == ((2, 2), (6, 0))  # another mesh
    assert tensors._local_box((9, 2), m1, ("S0",)) == ((3, 2), (9, 0))  # another shape
    assert tensors._local_box((8, 2), m1, ("R",)) == ((4, 2), (12, 0))  # other placements
    assert tensors._local_box((8, 2), m1, ({"unhashable": 1},)) == ((5, 2), (15, 0))
    assert tensors._local_box((8, 2), m1, ({"unhashable": 1},)) == ((6, 2), (18, 0))  # never kept
    assert len(calls) == 6
