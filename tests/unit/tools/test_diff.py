"""unickpt diff: layout-invariant comparison from index files alone."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from unickpt import GeneralCheckpointIO, diff_checkpoints, merge_checkpoint
from unickpt.cli.main import main
from unickpt.errors import IncompleteCheckpointError, IndexFileError
from unickpt.spec.boxes import flat_range_to_boxes
from unickpt.tools._write import SliceData, TensorData, write_checkpoint

RNG = np.random.default_rng(7)


def _weights() -> dict[str, np.ndarray]:
    return {
        "a.weight": RNG.standard_normal((12, 10)).astype(np.float32),
        "a.bias": RNG.standard_normal(10).astype(np.float32),
        "b.weight": RNG.standard_normal((5, 7, 3)).astype(np.float32),
        "scalar": np.array(3.5, dtype=np.float32),
    }


def _layout(w: dict[str, np.ndarray], how: str) -> dict[str, TensorData]:
    out = {}
    for n, a in w.items():
        if how == "whole" or a.ndim == 0:
            boxes = [((0,) * a.ndim, a.shape)]
        elif how == "rows":
            cut = a.shape[0] // 3 + 1
            boxes = [
                ((0,) + (0,) * (a.ndim - 1), (cut, *a.shape[1:])),
                ((cut,) + (0,) * (a.ndim - 1), (a.shape[0] - cut, *a.shape[1:])),
            ]
        elif how == "cols":
            c = a.shape[-1] // 2
            boxes = [
                ((0,) * a.ndim, (*a.shape[:-1], c)),
                ((0,) * (a.ndim - 1) + (c,), (*a.shape[:-1], a.shape[-1] - c)),
            ]
        else:  # zero-style flat ranges over 3 ranks
            total = a.size
            step = -(-total // 3)
            boxes = [
                b
                for p in range(3)
                for b, _ in flat_range_to_boxes(a.shape, min(total, p * step), min(total, (p + 1) * step))
            ]
        sl = [
            SliceData(
                o, s, np.ascontiguousarray(a[tuple(slice(x, x + k) for x, k in zip(o, s, strict=True))])
            )
            for o, s in boxes
        ]
        out[n] = TensorData("F32", a.shape, sl)
    return out


def _drop_data(d: Path) -> None:
    for f in os.listdir(d):
        if f.endswith(".safetensors"):
            os.unlink(d / f)


@pytest.mark.parametrize("la,lb", [("rows", "cols"), ("flat", "whole"), ("cols", "flat")])
def test_same_weights_two_layouts_identical_from_index_only(tmp_path: Path, la: str, lb: str) -> None:
    w = _weights()
    a, b = tmp_path / "a", tmp_path / "b"
    write_checkpoint(str(a), _layout(w, la), sliced=True, files=2)
    write_checkpoint(str(b), _layout(w, lb), sliced=lb != "whole", files=3)
    _drop_data(a)
    _drop_data(b)
    rep = diff_checkpoints(a, b)
    assert rep.identical and rep.exit_code == 0
    assert sorted(rep.same) == sorted(w)


def test_one_changed_element_pinpointed(tmp_path: Path) -> None:
    w = _weights()
    w2 = {k: v.copy() for k, v in w.items()}
    w2["b.weight"][3, 5, 1] = np.nextafter(w2["b.weight"][3, 5, 1], np.float32(np.inf))
    a, b = tmp_path / "a", tmp_path / "b"
    write_checkpoint(str(a), _layout(w, "rows"))
    write_checkpoint(str(b), _layout(w2, "flat"))
    _drop_data(a)
    _drop_data(b)
    rep = diff_checkpoints(a, b)
    assert rep.changed == ["b.weight"]
    assert sorted(rep.same) == ["a.bias", "a.weight", "scalar"]
    assert not rep.identical and rep.exit_code == 1


def test_only_in_and_dtype_shape_changes(tmp_path: Path) -> None:
    w = _weights()
    wa = dict(w, extra_a=np.zeros(3, np.float32))
    wb = {k: v for k, v in w.items() if k != "a.bias"}
    wb["a.weight"] = w["a.weight"][:11]
    wb["extra_b"] = np.ones(2, np.float32)
    a, b = tmp_path / "a", tmp_path / "b"
    write_checkpoint(str(a), _layout(wa, "whole"))
    write_checkpoint(str(b), _layout(wb, "whole"))
    rep = diff_checkpoints(a, b)
    assert rep.only_in_a == ["a.bias", "extra_a"]
    assert rep.only_in_b == ["extra_b"]
    assert [c.name for c in rep.dtype_or_shape_changed] == ["a.weight"]
    assert rep.dtype_or_shape_changed[0].b_shape == [11, 10]
    assert rep.exit_code == 1
    assert "only in A" in rep.format()


def test_generalio_sliced_gathered_and_merged_agree(tmp_path: Path) -> None:
    torch.manual_seed(3)
    m = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 2))
    io = GeneralCheckpointIO()
    io.save_model(m, tmp_path / "sliced", shard=True, gather_dtensor=False)
    io.save_model(m, tmp_path / "single.safetensors")
    merge_checkpoint(tmp_path / "sliced", tmp_path / "merged")
    assert diff_checkpoints(tmp_path / "sliced", tmp_path / "single.safetensors").identical
    assert diff_checkpoints(tmp_path / "merged", tmp_path / "sliced").identical
    _drop_data(tmp_path / "sliced")
    with torch.no_grad():
        m[2].bias[1] += 1
    io.save_model(m, tmp_path / "changed", shard=True, gather_dtensor=True)
    _drop_data(tmp_path / "changed")
    rep = diff_checkpoints(tmp_path / "sliced", tmp_path / "changed")
    assert rep.changed == ["2.bias"]


def test_plain_hf_fingerprinted_from_its_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    w = _weights()
    os.mkdir(tmp_path / "hf")
    save_file({k: torch.from_numpy(v) for k, v in w.items()}, tmp_path / "hf" / "model.safetensors")
    write_checkpoint(str(tmp_path / "u"), _layout(w, "cols"))
    # The plain side records no fingerprint: it is computed from its data, and compared.
    rep = diff_checkpoints(tmp_path / "hf", tmp_path / "u")
    assert rep.exit_code == 0 and rep.identical and sorted(rep.same) == sorted(w), rep.format()
    only = diff_checkpoints(tmp_path / "hf", tmp_path / "u", index_only=True)
    assert only.exit_code == 2 and sorted(only.unverifiable) == sorted(w) and not only.identical
    deep = diff_checkpoints(tmp_path / "hf", tmp_path / "u", deep=True)
    assert deep.identical, deep.format()
    # One element of one tensor changed in the plain file: exactly that tensor is reported.
    name = sorted(w)[0]
    changed = {k: v.copy() for k, v in w.items()}
    changed[name].reshape(-1)[-1] += 1
    os.mkdir(tmp_path / "hf2")
    save_file({k: torch.from_numpy(v) for k, v in changed.items()}, tmp_path / "hf2" / "model.safetensors")
    rep = diff_checkpoints(tmp_path / "u", tmp_path / "hf2")
    assert rep.changed == [name] and sorted(rep.same) == sorted(set(w) - {name}) and rep.exit_code == 1
    # Both sides plain: both computed.
    assert diff_checkpoints(tmp_path / "hf", tmp_path / "hf2").changed == [name]
    # The CLI: a progress bar on stderr unless -q, the same verdict.
    assert main(["diff", "-q", str(tmp_path / "hf"), str(tmp_path / "u")]) == 0
    assert capsys.readouterr().err == ""
    assert main(["diff", "--index-only", str(tmp_path / "hf"), str(tmp_path / "u")]) == 2


def test_deep_finds_corrupt_data(tmp_path: Path) -> None:
    w = _weights()
    write_checkpoint(str(tmp_path / "a"), _layout(w, "rows"))
    write_checkpoint(str(tmp_path / "b"), _layout(w, "flat"))
    f = tmp_path / "b" / "model-00001-of-00001.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 0x40
    f.write_bytes(bytes(raw))
    assert diff_checkpoints(tmp_path / "a", tmp_path / "b").identical  # the index alone cannot tell
    deep = diff_checkpoints(tmp_path / "a", tmp_path / "b", deep=True)
    assert deep.exit_code == 1
    assert deep.changed and deep.integrity_failures
    assert any("fingerprint" in x for x in deep.integrity_failures)


def test_unusable_inputs_raise(tmp_path: Path) -> None:
    write_checkpoint(str(tmp_path / "a"), _layout(_weights(), "rows"))
    with pytest.raises(IncompleteCheckpointError):
        diff_checkpoints(tmp_path / "a", tmp_path / "nope")
    os.mkdir(tmp_path / "bad")
    (tmp_path / "bad" / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(IndexFileError):
        diff_checkpoints(tmp_path / "a", tmp_path / "bad")


def test_tied_names_resolved(tmp_path: Path) -> None:
    w = _weights()
    t = _layout(w, "rows")
    write_checkpoint(str(tmp_path / "a"), t, aliases={"head.weight": "a.weight"})
    t2 = _layout(w, "cols")
    write_checkpoint(str(tmp_path / "b"), t2, aliases={"head.weight": "a.weight"})
    rep = diff_checkpoints(tmp_path / "a", tmp_path / "b")
    assert "head.weight" in rep.same and rep.identical
