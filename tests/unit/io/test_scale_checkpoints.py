"""The largest layouts as real checkpoints (issue 18: no ceiling below the largest runs).

405B (Llama-3.1 shapes) under TP8 x PP16 x DP16 on 2048 ranks: 117,200 stored slices in 2048
data files, built with the slice lists of ``benchmarks/scale.py`` shrunk to a few values per
slice (``benchmarks/scale_ops.py``), then loaded into a module, verified, inspected and merged,
bit-exact. The FSDP layout on 2048 ranks (2.07M slices) is run by the benchmark itself.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_405b_3d_layout_saves_loads_verifies_and_merges(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO))
    try:
        from benchmarks.scale_ops import build
    finally:
        sys.path.remove(str(REPO))
    from unickpt import GeneralCheckpointIO, merge_checkpoint, verify_checkpoint
    from unickpt.ckpt.reader import open_checkpoint
    from unickpt.tools.inspect import inspect_checkpoint

    ck = tmp_path / "ck"
    info = build(ck, "405b-tp8pp16dp16")
    assert info["slices"] == 117_200 and info["files"] == 2048
    # The whole model in one process: every stored slice read and placed.
    with open_checkpoint(ck) as r:
        shapes = {n: tuple(t.shape) for n, t in r.tensors.items()}
        expect = {}
        for n, t in r.tensors.items():
            full = torch.empty(shapes[n], dtype=torch.bfloat16)
            for s in t.slices:
                idx = tuple(slice(o, o + k) for o, k in zip(s.offsets, s.shape, strict=True))
                full[idx] = torch.frombuffer(
                    bytearray(r.read_key(s.file, s.key)), dtype=torch.bfloat16
                ).reshape(s.shape)
            expect[n] = full
    model = _Named(shapes)
    GeneralCheckpointIO().load_model(model, ck, verify=True)
    for n, p in model.named_parameters():
        assert torch.equal(p.detach().view(torch.int16), expect[n].view(torch.int16)), n
    assert not list(verify_checkpoint(ck))
    assert len(inspect_checkpoint(ck)["tensors"]) == len(shapes)
    merge_checkpoint(ck, tmp_path / "merged")
    with open_checkpoint(tmp_path / "merged") as m:
        for n, t in m.tensors.items():
            (s,) = t.slices
            got = torch.frombuffer(bytearray(m.read_key(s.file, s.key)), dtype=torch.bfloat16).reshape(
                t.shape
            )
            assert torch.equal(got.view(torch.int16), expect[n].view(torch.int16)), n


# Its own model: built from the names and shapes of the scale checkpoint it loads.
class _Named(torch.nn.Module):
    """Parameters under the checkpoint's dotted names (nested modules built on the fly)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        super().__init__()
        for n, shape in shapes.items():
            *path, leaf = n.split(".")
            mod: torch.nn.Module = self
            for part in path:
                if not hasattr(mod, part):
                    mod.add_module(part, torch.nn.Module())
                mod = getattr(mod, part)
            mod.register_parameter(leaf, torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16)))
