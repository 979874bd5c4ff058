"""Train the tiny Llama with tensor parallelism (torch ``parallelize_module``); save and resume.

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 2 examples/train_tp.py \\
        --steps 4 --resume-from /tmp/unickpt-demo/ckpt

Attention q/k/v and MLP gate/up are column-parallel, o and down row-parallel
(:func:`_common.tp_plan`); every rank sees the whole batch. ``--resume-from`` accepts a
checkpoint saved under any plugin and world size, e.g. FSDP2 on 4 ranks.
"""

from __future__ import annotations

from _common import run, tp_plan


def make_plugin():  # type: ignore[no-untyped-def]
    from unickpt.plugins import TPPlugin

    return TPPlugin(tp_plan())


if __name__ == "__main__":
    run(make_plugin, "Train a tiny Llama with tensor parallelism and save/resume with unickpt.")
