"""Saves to ``s3://`` (moto's S3 server) from real gloo worlds: a 4-rank FSDP2 save, and the
manager killed with SIGKILL mid-save on the store, resumed bit for bit."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

from unickpt.ckpt.reader import open_checkpoint
from unickpt.manager import CheckpointManager

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.timeout(600)


def fsdp2_save_worker(url: str, options: dict[str, Any]) -> dict[str, Any]:
    """Each rank: FSDP2 over the world, one optimizer step, sliced model and optimizer saved to ``url``."""
    import torch.distributed as dist
    from conftest import batch, full_model_state, loss_fn, make_model

    import unickpt
    from unickpt.plugins.fsdp2 import FSDP2Plugin

    rank = dist.get_rank()
    net = make_model(0)
    booster = unickpt.Booster(FSDP2Plugin(), storage_options=options)
    model, opt, *_ = booster.boost(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    model.eval()  # BatchNorm's running stats stay replicated (each rank sees its own batch)
    x, y = batch(rank)
    loss_fn(model(x), y).backward()
    opt.step()
    booster.save_model(model, f"{url}/model", shard=True, gather_dtensor=False)
    booster.save_optimizer(opt, f"{url}/optim", shard=True, gather_dtensor=False)
    full = full_model_state(model)
    return {"full": full if rank == 0 else None}


def test_four_rank_fsdp2_save_to_s3_is_bit_exact(world_pool: Any, s3: Any, tmp_path: Path) -> None:
    url = f"s3://{s3.bucket}/fsdp2"
    opts = s3.storage_options()
    results = world_pool.run(4, "test_storage_write_dist:fsdp2_save_worker", url, opts, timeout=400)
    fs = fsspec.filesystem("s3", **s3.storage_options("check"))
    fs.invalidate_cache()
    names = sorted(str(p).rsplit("/", 1)[1] for p in fs.find(f"{s3.bucket}/fsdp2/model"))
    data = [n for n in names if n.endswith(".safetensors")]
    assert len(data) == 4 and "model.safetensors.index.json" in names  # one file per rank
    fs.get(f"{s3.bucket}/fsdp2/", str(tmp_path / "dl") + "/", recursive=True)
    stored = sum(p.stat().st_size for p in (tmp_path / "dl").rglob("*") if p.is_file())
    # Every rank uploaded its own files once, rank 0 the indexes: nothing twice.
    assert s3.received("PUT") + s3.received("POST") == stored
    from conftest import make_model

    from unickpt.io import GeneralCheckpointIO

    net = make_model(1)
    GeneralCheckpointIO().load_model(net, tmp_path / "dl" / "model", verify=True)
    full = results[0]["full"]
    sd = net.state_dict()
    for k, v in full.items():
        assert torch.equal(sd[k], v), k
    with open_checkpoint(tmp_path / "dl" / "optim", "optimizer") as r:
        assert r.verify() == []


# ------------------------------------------------------------------ manager on S3, killed
def _committed_on_store(url: str, tmp: Path) -> int | None:
    steps = CheckpointManager(url).all_steps()
    fs, root = fsspec.core.url_to_fs(url)
    for step in steps:
        d = tmp / f"check-{step}-{random.randrange(1 << 30)}"
        fs.invalidate_cache()
        fs.get(f"{root}/step-{step}/", str(d) + "/", recursive=True)
        for kind in ("model", "optimizer"):
            with open_checkpoint(d / kind, kind) as r:
                r.validate_structure()
                assert r.verify() == [], (step, kind)
    return steps[-1] if steps else None


@pytest.mark.slow
def test_manager_on_s3_killed_mid_save_resumes_exactly(s3: Any, tmp_path: Path) -> None:
    from test_manager_dist import TOTAL, _finish, _kill, _launch, _losses, _step_lines, _wait_for_steps

    ref_log = tmp_path / "ref"
    _finish(_launch(tmp_path / "ref_ckpt", False, ref_log), ref_log)  # type: ignore[arg-type]
    ref = _losses(ref_log)
    url = f"s3://{s3.bucket}/run"
    log = tmp_path / "run"
    rng = random.Random(17)
    kills = 0
    for _ in range(2):
        before = _step_lines(log)
        procs = _launch(url, True, log)  # type: ignore[arg-type]
        _wait_for_steps(log, before + rng.randint(2, 5), procs)
        time.sleep(rng.uniform(0.0, 0.5))
        if all(p.poll() is not None for p in procs):
            break
        _kill(procs)
        kills += 1
        _committed_on_store(url, tmp_path)  # every committed step verifies
    _finish(_launch(url, True, log), log)  # type: ignore[arg-type]
    assert kills >= 1
    assert _committed_on_store(url, tmp_path) == TOTAL
    assert _losses(log) == ref  # every step's loss on every rank, bit for bit
    fs, root = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    tops = {str(p)[len(root) + 1 :].split("/")[0] for p in fs.find(root)}
    assert tops == {"latest", f"step-{TOTAL - 2}", f"step-{TOTAL}"}  # keep_last=2, nothing left over
