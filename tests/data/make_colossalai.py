"""Regenerate tests/data/colossalai/ with real Colossal-AI (0.5.0 was used).

    .venv/bin/pip install --no-deps colossalai psutil peft accelerate   # beside torch, never upgrading it
    .venv/bin/python tests/data/make_colossalai.py

Writes, for a tiny model (Linear(4, 3), LayerNorm(3), Linear(3, 2)) trained 2 AdamW steps:
- ``one_group/``: the optimizer built on ``model.parameters()``;
- ``two_groups/``: two param groups (different lr and weight decay) that list the parameters
  in another order than the model (ids then differ from the model's parameter order);
each with ``model/`` and ``optimizer/`` as ``GeneralCheckpointIO().save_model/save_optimizer(...,
shard=True)`` write them, and ``expected.safetensors`` + ``expected.json`` (the model, the
optimizer's ``state_dict()`` tensors as ``state.<id>.<key>``, and its ``param_groups``).
"""

from __future__ import annotations

import json
import os
import shutil
import warnings

import torch
from safetensors.torch import save_file
from torch import nn

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "colossalai")


def build(two_groups: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Linear(3, 2))
    if two_groups:
        groups = [
            {"params": [m[0].weight, m[0].bias, m[2].weight], "lr": 1e-3},
            {"params": [m[1].weight, m[1].bias, m[2].bias], "lr": 5e-4, "weight_decay": 0.0},
        ]
        opt = torch.optim.AdamW(groups, betas=(0.8, 0.95))
    else:
        opt = torch.optim.AdamW(m.parameters(), lr=2e-3, betas=(0.85, 0.9))
    return m, opt


def main() -> None:
    warnings.simplefilter("ignore")
    from colossalai.checkpoint_io import GeneralCheckpointIO
    from colossalai.interface import OptimizerWrapper

    for name, two in (("one_group", False), ("two_groups", True)):
        d = os.path.join(HERE, name)
        shutil.rmtree(d, ignore_errors=True)
        m, opt = build(two)
        for _ in range(2):
            m(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        io = GeneralCheckpointIO()
        io.save_model(m, os.path.join(d, "model"), shard=True, size_per_shard=1)
        io.save_optimizer(OptimizerWrapper(opt), os.path.join(d, "optimizer"), shard=True, size_per_shard=1)
        osd = opt.state_dict()
        tensors = {f"model.{k}": v.contiguous() for k, v in m.state_dict().items()}
        for pid, st in osd["state"].items():
            for k, v in st.items():
                tensors[f"state.{pid}.{k}"] = v.contiguous()
        save_file(tensors, os.path.join(d, "expected.safetensors"))
        groups = [
            {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in osd["param_groups"]
        ]
        with open(os.path.join(d, "expected.json"), "w") as f:
            json.dump({"param_groups": groups}, f, indent=1)


if __name__ == "__main__":
    main()
