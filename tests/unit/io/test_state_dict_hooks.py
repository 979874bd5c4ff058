"""A module whose ``state_dict`` hooks build fresh tensors (a fused weight saved as two, as
torchtitan's ``FusedQKVLinear`` saves ``wqkv`` as ``wq``/``wk``/``wv``) loads through
``CheckpointIO.load_model``: what was read into those tensors reaches the parameters through
the module's ``load_state_dict`` hooks, instead of being dropped silently."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from unickpt.io import GeneralCheckpointIO


# Its own model: its state-dict hooks (one fused parameter saved as two) are what it checks.
class Fused(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.wab = torch.nn.Parameter(torch.randn(6, 3, generator=g))
        self.other = torch.nn.Parameter(torch.randn(2, generator=g))
        self.register_state_dict_post_hook(self._split)
        self.register_load_state_dict_pre_hook(self._fuse)

    @staticmethod
    def _split(module: Any, sd: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        w = sd.pop(f"{prefix}wab")
        sd[f"{prefix}wa"], sd[f"{prefix}wb"] = (t.clone() for t in w.detach().split([4, 2]))

    @staticmethod
    def _fuse(module: Any, sd: dict[str, Any], prefix: str, *args: Any) -> None:
        if f"{prefix}wa" in sd:
            sd[f"{prefix}wab"] = torch.cat([sd.pop(f"{prefix}wa"), sd.pop(f"{prefix}wb")])


def test_hook_made_tensors_load_into_the_parameters(tmp_path: Path) -> None:
    io = GeneralCheckpointIO()
    src, dst = Fused(0), Fused(1)
    io.save_model(src, tmp_path / "ckpt", shard=True)
    assert not torch.equal(src.wab, dst.wab)
    io.load_model(dst, tmp_path / "ckpt")
    assert torch.equal(dst.wab, src.wab)  # was left at its own values before
    assert torch.equal(dst.other, src.other)


def test_a_module_without_such_hooks_is_not_reloaded(tmp_path: Path) -> None:
    io = GeneralCheckpointIO()
    src, dst = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    io.save_model(src, tmp_path / "ckpt", shard=True)
    calls = []
    dst.register_load_state_dict_pre_hook(lambda *a: calls.append(1))
    io.load_model(dst, tmp_path / "ckpt")
    assert torch.equal(dst.weight, src.weight) and calls == []  # loaded in place, no second pass
