"""Rank side of tests/dist/test_world_of_one.py: a 1-rank gloo world saves and loads through the
Booster (FSDP2) while every ``torch.distributed`` collective is counted (``_save_collectives_worker``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _save_collectives_worker import counting

from unickpt import Booster
from unickpt._dist import agree, agree_gather, all_gather_object, barrier, broadcast_object
from unickpt.plugins import FSDP2Plugin


def world_of_one(root: str) -> dict[str, Any]:
    assert dist.get_world_size() == 1
    torch.manual_seed(0)
    booster = Booster(plugin=FSDP2Plugin())
    model, *_ = booster.boost(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)))
    expected = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    obs: dict[str, Any] = {}
    for name, gather in (("sliced", False), ("gathered", True)):
        path = str(Path(root) / name)
        with counting() as calls:
            booster.save_model(model, path, shard=True, gather_dtensor=gather)
        obs[f"save_{name}"] = dict(calls)
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        with counting() as calls:
            booster.load_model(model, path, verify=True)
        obs[f"load_{name}"] = dict(calls)
        got = {k: v.full_tensor() for k, v in model.state_dict().items()}
        obs[f"exact_{name}"] = got.keys() == expected.keys() and all(
            torch.equal(got[k], expected[k]) for k in expected
        )
    with counting() as calls:
        obs["gathered_object"] = all_gather_object({"x": 1})
        obs["broadcast_object"] = broadcast_object("b")
        barrier()
        agree(None, "nothing")
        obs["agree_gather"] = agree_gather(None, 7, "seven")
        try:
            agree(ValueError("only rank"), "failing")
        except ValueError as e:
            obs["raised"] = str(e)
    obs["helpers"] = dict(calls)
    return obs
