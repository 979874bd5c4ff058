"""Ranks of tests/dist/test_migrate_dist.py: DCP / torchtitan / HF-distributed checkpoints of a
2-rank FSDP2 run, imported into unickpt and exported back to DCP, checked bit-exact."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from conftest import (
    assert_same_tensors,
    batch,
    full_model_state,
    full_optim_state,
    local_batch,
    loss_fn,
    make_model,
    make_optimizer,
    make_plugin,
)
from harness import run_cases

warnings.filterwarnings("ignore", category=UserWarning)
warnings.filterwarnings("ignore", category=FutureWarning)


def _boosted(seed: int = 0, steps: int = 0) -> tuple[Any, Any, Any, Any]:
    from unickpt.booster import Booster

    plugin = make_plugin("fsdp2")
    booster = Booster(plugin)
    model = make_model(seed)
    optim = make_optimizer(model)
    m, o, *_ = booster.boost(model, optim)
    for step in range(steps):
        tokens, targets = local_batch(plugin, *batch(step))
        loss_fn(m(tokens), targets).backward()
        o.step()
        o.zero_grad()
    return booster, m, o, plugin


def _on_rank0(fn: Any) -> None:
    err = None
    if dist.get_rank() == 0:
        try:
            fn()
        except Exception as e:  # tell the other rank instead of leaving it in the barrier
            err = e
    flag = [err is not None]
    dist.broadcast_object_list(flag, 0)
    if err is not None:
        raise err
    if flag[0]:
        raise RuntimeError("rank 0 failed")


def migrate_cases(root: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from unickpt.tools.convert import convert_checkpoint

    _, m, o, _ = _boosted(steps=2)
    # BatchNorm running stats are per rank (plain tensors, not sharded) and DCP keeps the copy
    # of one rank of its choosing: make them equal on every rank first.
    with torch.no_grad():
        for buf in m.unwrap().buffers():
            dist.broadcast(buf, 0)
    ref_model = full_model_state(m)
    ref_optim = full_optim_state(m, o)
    inner = m.unwrap()
    src = os.path.join(root, "dcp")
    msd, osd = get_state_dict(inner, o.optim)
    dcp.save({"model": msd, "optim": osd, "train_state": {"step": 2}}, checkpoint_id=src)
    dist.barrier()

    def dcp_in_fsdp2_out() -> dict[str, int]:
        """a real 2-rank DCP training checkpoint -> unickpt -> a fresh FSDP2 model and optimizer"""
        out = os.path.join(root, "u")
        _on_rank0(lambda: convert_checkpoint(src, out, source="dcp"))
        booster, m2, o2, _ = _boosted(seed=7)
        booster.load_model(m2, out, verify=True)
        booster.load_optimizer(o2, out, verify=True)
        got_model, got_optim = full_model_state(m2), full_optim_state(m2, o2)  # collectives first
        assert_same_tensors(got_model, ref_model, "model")
        assert_same_tensors(got_optim, ref_optim, "optim")
        return {"files": len(os.listdir(src))}

    def unickpt_out_dcp_into_fsdp2() -> None:
        """unickpt -> --to dcp -> torch's dcp.load into a fresh 2-rank FSDP2 model + optimizer"""
        back = os.path.join(root, "back")
        _on_rank0(lambda: convert_checkpoint(os.path.join(root, "u"), back, source="unickpt", target="dcp"))
        _, m3, o3, _ = _boosted(seed=9, steps=1)
        inner3 = m3.unwrap()
        msd3, osd3 = get_state_dict(inner3, o3.optim)
        dcp.load({"model": msd3, "optim": osd3}, checkpoint_id=back)
        set_state_dict(inner3, o3.optim, model_state_dict=msd3, optim_state_dict=osd3)
        got_model, got_optim = full_model_state(m3), full_optim_state(m3, o3)
        assert_same_tensors(got_model, ref_model, "model")
        assert_same_tensors(got_optim, ref_optim, "optim")

    def hf_distributed_save_loads() -> None:
        """HuggingFaceStorageWriter(save_distributed=True) of the FSDP2 model: load_model reads it"""
        hf = os.path.join(root, "hf")
        # safetensors refuses tensors sharing memory: the tied head is saved once, as emb.weight
        sd = {k: v for k, v in inner.state_dict().items() if k != "head.weight"}
        dcp.save(sd, storage_writer=HuggingFaceStorageWriter(hf, save_distributed=True))
        dist.barrier()
        names = sorted(os.listdir(hf))
        assert names == [
            "shard-00001-model-00001-of-00001.safetensors",
            "shard-00002-model-00001-of-00001.safetensors",
        ], names
        booster, m4, _, _ = _boosted(seed=5)
        booster.load_model(m4, hf)
        got_model = full_model_state(m4)
        assert_same_tensors(got_model, ref_model, "model")
        merged = os.path.join(root, "hf_u")
        _on_rank0(lambda: convert_checkpoint(hf, merged, source="dcp"))
        from unickpt import GeneralCheckpointIO

        plain = make_model(3)  # a plain module on every rank (GeneralCheckpointIO agrees over the world)
        GeneralCheckpointIO().load_model(plain, merged, verify=True)
        assert_same_tensors({k: v.clone() for k, v in plain.state_dict().items()}, ref_model, "merged")

    return {
        name: r.__dict__
        for name, r in run_cases(
            [
                ("dcp_in_fsdp2_out", dcp_in_fsdp2_out),
                ("unickpt_out_dcp_into_fsdp2", unickpt_out_dcp_into_fsdp2),
                ("hf_distributed_save_loads", hf_distributed_save_loads),
            ]
        ).items()
    }
