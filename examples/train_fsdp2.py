"""Train the tiny Llama with FSDP2 (torch ``fully_shard``), save a sliced checkpoint, resume from any.

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 4 examples/train_fsdp2.py \\
        --steps 6 --save-dir /tmp/unickpt-demo/ckpt

Each decoder layer gets its own ``fully_shard`` group, then the root (which holds the tied
embedding/head). Parameters become ``Shard(0)`` DTensors; with 4 ranks the 37-row embedding
splits 10/10/10/7. ``--resume-from`` accepts a checkpoint saved under any plugin and world size.
"""

from __future__ import annotations

from _common import decoder_layer_class, run


def make_plugin():  # type: ignore[no-untyped-def]
    from unickpt.plugins import FSDP2Plugin

    return FSDP2Plugin(shard_modules=[decoder_layer_class()])


if __name__ == "__main__":
    run(make_plugin, "Train a tiny Llama with FSDP2 and save/resume with unickpt.")
