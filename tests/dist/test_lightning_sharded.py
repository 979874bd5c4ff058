"""Lightning's sharded strategies saving and resuming through unickpt (2 processes, gloo, CPU):
``UnickptModelParallelStrategy`` (FSDP2 applied in ``configure_model``: every rank writes its own
DTensor slices) and ``UnickptFSDPStrategy`` (torch's FSDP1: full state dicts, rank 0 writes).
4 epochs straight against 2 saved + 2 resumed from epoch 1's checkpoint: every loss, weight and
optimizer state bit for bit, the scheduler where it was; no DCP or pickle file in the checkpoint.

torch 2.13's FSDP1 refuses CPU unless given ``device_id=cpu`` ("FSDP needs a non-CPU accelerator
device, but no accelerator device is detected"), which Lightning's FSDPStrategy never passes: the
FSDP1 case wraps the module itself in ``configure_model`` (the strategy takes it as wrapped)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from harness import WorldPool

pytest.importorskip("lightning", reason="lightning is not installed (make peers)")

from unickpt import verify_checkpoint
from unickpt.integrations.lightning import STATE_FILE
from unickpt.tools import inspect_checkpoint

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("kind", ["fsdp2", "fsdp1"])
def test_sharded_strategy_resumes_bit_exact(tmp_path: Path, world_pool: WorldPool, kind: str) -> None:
    results = world_pool.run(
        2, "_lightning_sharded_worker:train_and_resume", str(tmp_path), kind, timeout=240
    )
    for r in (0, 1):
        res = results[r]
        assert res["world"] == 2
        # 4 epochs of 4 steps per rank: the resumed run took epochs 2 and 3 only, the same losses
        assert len(res["full"]) == 16 and res["resumed"] == res["full"], res
        assert res["same_weights"] and res["same_optimizer"], res
        assert res["lr"] == pytest.approx(1e-2 * 0.7**4, rel=1e-12)
        assert res["ckpt"] == [STATE_FILE, "model", "optimizer_0", "state"]
        # a save over that checkpoint failing on rank 0 alone (a callback state JSON cannot hold):
        # both ranks raise at once, the committed checkpoint and the directory stay as they were
        failed = res["failed_save"]
        assert failed["unchanged"] and failed["listing_same"], failed
    kind0, msg0 = results[0]["failed_save"]["raised"]
    assert kind0 == "UnsupportedError" and "fn" in msg0 and "function" in msg0, msg0
    kind1, msg1 = results[1]["failed_save"]["raised"]
    assert kind1 == "DistributedError", (kind1, msg1)
    assert (
        "rank 0 failed writing the checkpoint (UnsupportedError:" in msg1 and "epoch=1-step=8.ckpt" in msg1
    ), msg1
    assert results[0]["full"] != results[1]["full"]  # each rank saw its own half of the data
    ck = tmp_path / "ck" / "epoch=1-step=8.ckpt"
    meta = json.loads((ck / STATE_FILE).read_text())
    assert meta["parts"] == {"layout": "sliced" if kind == "fsdp2" else "full", "optimizers": 1}
    assert meta["checkpoint"]["epoch"] == 1 and meta["checkpoint"]["global_step"] == 8
    for part in ("model", "optimizer_0"):
        report = verify_checkpoint(str(ck / part))
        assert list(report) == [] and report.hashed == report.slices > 0, (part, report)
    info = inspect_checkpoint(str(ck / "model"))
    assert sorted(info["tensors"]) == ["net.0.bias", "net.0.weight", "net.2.bias", "net.2.weight"]
    # FSDP2: each of the 4 tensors in 2 row slices, one per rank; FSDP1: gathered, one slice each
    assert info["totals"]["slices"] == info["totals"]["hashed_slices"] == (8 if kind == "fsdp2" else 4), info
    assert info["layout"]["gathered"] is (kind == "fsdp1") and info["layout"]["world_size"] == (
        2 if kind == "fsdp2" else 1
    )
    names = [f for _, _, files in os.walk(ck) for f in files]
    assert not [f for f in names if f.endswith((".pt", ".bin", ".distcp")) or f == ".metadata"], names


def test_sliced_strategy_saves_to_and_resumes_from_a_store(s3: object, world_pool: WorldPool) -> None:
    """``UnickptModelParallelStrategy`` with ``ModelCheckpoint(dirpath="s3://...")`` (moto's S3):
    both ranks write their slices to the store, the resume is bit-exact; a save over the
    checkpoint failing on rank 0 alone raises on both ranks and leaves nothing of it."""
    url = f"s3://{s3.bucket}/ck"  # type: ignore[attr-defined]
    env = s3.env()  # type: ignore[attr-defined]
    results = world_pool.run(
        2, "_lightning_sharded_worker:train_and_resume_on_a_store", url, env, "fsdp2", timeout=240
    )
    for r in (0, 1):
        res = results[r]
        assert len(res["full"]) == 16 and res["resumed"] == res["full"], res
        assert res["same_weights"], res
        assert res["ckpt"] == [STATE_FILE, "model", "optimizer_0", "state"], res
        assert res["left"] == [], res["left"]
    assert results[0]["raised"][0] == "UnsupportedError", results[0]["raised"]
    assert results[1]["raised"][0] == "DistributedError", results[1]["raised"]
