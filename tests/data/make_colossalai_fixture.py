"""Regenerate tests/data/colossalai_sharded/: a model checkpoint written by real Colossal-AI.

    .venv/bin/pip install --no-deps colossalai psutil peft accelerate
    .venv/bin/python tests/data/make_colossalai_fixture.py

Colossal-AI 0.5.0 wrote the committed files: five shards (size_per_shard=0 puts one tensor in
each) and an index whose ``metadata.total_size`` is a float in MB (0.000324249267578125).
"""

from __future__ import annotations

import os
import shutil
import warnings

import torch


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    m.register_buffer("steps", torch.arange(5, dtype=torch.int64))
    return m


def main() -> None:
    warnings.simplefilter("ignore")
    from colossalai.checkpoint_io import GeneralCheckpointIO

    out = os.path.join(os.path.dirname(__file__), "colossalai_sharded")
    shutil.rmtree(out, ignore_errors=True)
    GeneralCheckpointIO().save_model(model(), out, shard=True, use_safetensors=True, size_per_shard=0)


if __name__ == "__main__":
    main()
