"""torchtitan's own ``Trainer.train()`` (torchtitan 0.3.0) with unickpt's checkpointer named by
its config (``checkpoint=unickpt.integrations.torchtitan.CheckpointManager.Config(...)``), on CPU:
4 steps on a 2-rank FSDP2 world (gloo) saving every 2, then what a run killed after step 2 leaves
(a copy of the folder holding step 2 alone) resumed by torchtitan's trainer on 1 rank: steps 3
and 4 take the losses of the uninterrupted run, to 1e-5 relative (FSDP's averaged gradients round
differently from one rank's). The reverse (1 rank -> 2) is ``-m slow``.

What the test process changes to run torchtitan's trainer on CPU (tests/dist/_titan_trainer_worker.py):
torchtitan picks its device at import (``tools.utils.device_type`` is "cuda" when no accelerator
is present), so that name and ``device_module`` are pointed at the CPU in the modules that
imported them (with a ``torch.cpu`` stand-in that answers the memory-monitor calls); the
trainer's ``set_pg_timeouts`` calls ``torch.distributed.set_timeout``, which torch 2.13 lacks
(``AttributeError``), and is skipped; the tokenizer and dataloader are small torchtitan
Configurables (torchtitan's need tokenizer files and a dataset download), built by the trainer
from its config like its own; flex attention (no backward on CPU) is swapped for torchtitan's
SDPA and 2 of the debug model's layers are kept, as in tests/dist/_titan_worker.py. The
dataloader cannot change degree (as in torchtitan): the resumed run excludes it from loading
and restarts the synthetic stream at the sample the checkpoint had reached."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from harness import WorldPool

pytest.importorskip(
    "torchtitan.trainer", reason="torchtitan and its runtime modules (make peers) not installed"
)

from _titan_worker import GLOBAL_BATCH, SEQ

from unickpt import verify_checkpoint
from unickpt.tools import inspect_checkpoint

pytestmark = pytest.mark.timeout(600)

STEPS = 4
SAVE: dict[str, Any] = {"interval": 2, "keep_latest_k": 0, "last_save_model_only": False}
RESUME: dict[str, Any] = {**SAVE, "exclude_from_loading": ["dataloader"]}


def _killed_after_step_2(src: Path, dst: Path) -> None:
    shutil.copytree(src / "checkpoint" / "step-2", dst / "checkpoint" / "step-2")


def _close(a: dict[int, float], b: dict[int, float]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert abs(a[k] - b[k]) <= 1e-5 * abs(b[k]), (k, a[k], b[k])


def _run(pool: WorldPool, n: int, folder: Path, skip: int, ckpt: dict[str, Any]) -> list[dict[str, Any]]:
    return pool.run(n, "_titan_trainer_worker:train", str(folder), STEPS, skip, ckpt, timeout=280)


def test_trainer_two_rank_fsdp_resumes_on_one_rank(tmp_path: Path, world_pool: WorldPool) -> None:
    two = _run(world_pool, 2, tmp_path / "two", 0, SAVE)
    for r in (0, 1):
        assert two[r]["checkpointer"] == "unickpt.integrations.torchtitan"
        assert two[r]["world"] == 2 and two[r]["fsdp"] and two[r]["dtensor"]
        assert sorted(two[r]["losses"]) == [1, 2, 3, 4]
    assert two[0]["losses"] == two[1]["losses"]
    step2 = tmp_path / "two" / "checkpoint" / "step-2"
    for part in ("model", "optimizer"):
        report = verify_checkpoint(str(step2 / part))
        assert list(report) == [] and report.hashed == report.slices > 0, (part, report)
        info = inspect_checkpoint(str(step2 / part))
        assert info["layout"]["world_size"] == 2 and info["layout"]["gathered"] is False, info["layout"]
    _killed_after_step_2(tmp_path / "two", tmp_path / "one")
    one = _run(world_pool, 1, tmp_path / "one", 2 * GLOBAL_BATCH, RESUME)[0]
    assert one["world"] == 1 and not one["fsdp"] and sorted(one["losses"]) == [3, 4]  # resumed at step 3
    # measured: 1.2e-7 relative at most (float32 rounding of the 2 ranks' summed gradients)
    _close(one["losses"], {k: two[0]["losses"][k] for k in (3, 4)})
    # the train state is per rank (torchtitan counts each rank's tokens): rank 0's, then 1 rank's
    assert one["step"] == STEPS
    assert one["ntokens_seen"] == 2 * (GLOBAL_BATCH // 2) * SEQ + 2 * GLOBAL_BATCH * SEQ


@pytest.mark.slow
def test_trainer_one_rank_resumes_on_two_rank_fsdp(tmp_path: Path, world_pool: WorldPool) -> None:
    one = _run(world_pool, 1, tmp_path / "one", 0, SAVE)[0]
    _killed_after_step_2(tmp_path / "one", tmp_path / "two")
    two = _run(world_pool, 2, tmp_path / "two", 2 * GLOBAL_BATCH, RESUME)
    for r in (0, 1):
        assert two[r]["world"] == 2 and two[r]["fsdp"] and sorted(two[r]["losses"]) == [3, 4]
        _close(two[r]["losses"], {k: one["losses"][k] for k in (3, 4)})
