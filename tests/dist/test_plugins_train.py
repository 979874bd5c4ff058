"""Training through the Booster under DDP, FSDP2 and TP in real gloo worlds.

One world per size (2 and 4) runs every case; each case trains the tiny ``Net`` a few steps
and checks, on every rank, that the losses and final weights match a single-process run
of the same global batches, that the parameters are DTensors with the expected placements
and uneven local shapes, that the optimizer updates the parallelised parameters, and that
the tied weights stay tied. The parent test only reports each case's verdict.

By hand: ``OMP_NUM_THREADS=1 PYTHONPATH=.:tests/dist .venv/bin/torchrun --nproc_per_node 2
tests/dist/harness.py test_plugins_train:train_worker 2``
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import pytest
from harness import CaseResult, WorldError, WorldPool, WorldTimeout, run_cases, run_world

STEPS = 4
WORLD_TIMEOUT_S = 240.0

# -- worker side (runs inside the ranks) -------------------------------------------------------


def _all_equal_across_ranks(t: Any) -> bool:
    import torch
    import torch.distributed as dist

    flat = t.contiguous().reshape(-1)
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(g.view(torch.uint8), gathered[0].view(torch.uint8)) for g in gathered)


def _chunk_sizes(n: int, parts: int) -> list[int]:
    """Local sizes torch uses for Shard(dim) over ``parts`` ranks (torch.chunk semantics)."""
    import torch

    sizes = [c.shape[0] for c in torch.arange(n).chunk(parts)]
    return sizes + [0] * (parts - len(sizes))


def train_case(kind: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from conftest import (
        batch,
        full_model_state,
        local_batch,
        loss_fn,
        make_model,
        make_optimizer,
        make_plugin,
        reference_step,
    )
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from unickpt.booster import Booster
    from unickpt.wrappers import ModelWrapper, OptimizerWrapper

    world = dist.get_world_size()
    rank = dist.get_rank()
    plugin = make_plugin(kind)
    booster = Booster(plugin)
    model = make_model(0)
    optim = make_optimizer(model)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0 / (1 + s))
    m, o, crit, dl, s = booster.boost(model, optim, criterion=loss_fn, lr_scheduler=sched)
    assert isinstance(m, ModelWrapper) and isinstance(o, OptimizerWrapper)
    assert o.optim is optim and s is sched and crit is loss_fn and dl is None
    inner = m.unwrap()
    assert inner is model, "unwrap() must return the user's module"
    assert inner.head.weight is inner.emb.weight, "tied weights were untied by the plugin"

    # The optimizer must now point at the parallelised parameters, group by group.
    current = dict(inner.named_parameters())
    by_id = {id(p): n for n, p in current.items()}
    group_fqns = [[by_id[id(p)] for p in g["params"]] for g in o.param_groups]
    assert sorted(group_fqns[0] + group_fqns[1]) == sorted(current)
    assert all(current[n].ndim >= 2 for n in group_fqns[0])
    assert [g["weight_decay"] for g in o.param_groups] == [0.1, 0.0]

    layout = plugin.layout()
    assert layout["plugin"] == kind and layout["world_size"] == world
    mesh_name = {"ddp": "dp", "fsdp2": "dp", "tp": "tp"}[kind]
    assert layout["mesh"] == {mesh_name: world}
    assert layout["dp_size"] == (1 if kind == "tp" else world)

    # Placements and (uneven) local shapes.
    if kind == "fsdp2":
        assert set(plugin.units) == {"blocks.0", "blocks.1", "bn", "scale", "norm", "proj"}, plugin.units
        for name, p in current.items():
            assert isinstance(p, DTensor), name
            assert p.placements == (Shard(0),), (name, p.placements)
            assert p.to_local().shape[0] == _chunk_sizes(p.shape[0], world)[rank], name
        assert current["scale.weight"].dtype == torch.bfloat16
        if world == 4:
            assert [_chunk_sizes(33, 4)[r] for r in range(4)] == [9, 9, 9, 6]
    elif kind == "tp":
        expect = {
            "attn.q.weight": (Shard(0),),
            "attn.q.bias": (Shard(0),),
            "attn.o.weight": (Shard(1),),
            "attn.o.bias": (Replicate(),),
            "up.weight": (Shard(0),),
            "up.bias": (Shard(0),),
            "down.weight": (Shard(1),),
            "down.bias": (Replicate(),),
            "proj.weight": (Shard(0),),
            "proj.bias": (Shard(0),),
        }
        for name, p in current.items():
            suffix = name.split(".", 2)[-1] if name.startswith("blocks.") else name
            if suffix in expect:
                assert isinstance(p, DTensor) and p.placements == expect[suffix], (name, p)
            elif name.startswith("blocks.") and "ln" not in name:
                assert isinstance(p, DTensor), name
            else:
                assert not isinstance(p, DTensor), f"{name} should stay a plain replicated tensor"
        assert current["blocks.0.up.weight"].to_local().shape == (36 // world, 16)
        assert current["blocks.0.down.weight"].to_local().shape == (16, 36 // world)
        assert current["proj.weight"].to_local().shape == (_chunk_sizes(33, world)[rank], 16)
    else:
        assert not any(isinstance(p, DTensor) for p in current.values())
        assert isinstance(m.module, torch.nn.parallel.DistributedDataParallel)

    ref = make_model(0)
    ref_optim = make_optimizer(ref)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_optim, lambda s: 1.0 / (1 + s))
    losses, ref_losses = [], []
    for step in range(STEPS):
        x, y = local_batch(plugin, *batch(step))
        loss = crit(m(x), y)
        booster.backward(loss, o)
        o.step()
        o.zero_grad()
        s.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
        ref_losses.append(reference_step(ref, ref_optim, step, plugin.dp_size))
        ref_sched.step()
    assert o.param_groups[0]["lr"] == pytest.approx(1e-2 / (1 + STEPS))

    # Every parameter has optimizer state, held on the parallelised parameter itself.
    assert {id(p) for p in o.state} == {id(p) for p in current.values()}
    for p, st in o.state.items():
        assert isinstance(st["exp_avg"], DTensor) == isinstance(p, DTensor)

    assert losses == pytest.approx(ref_losses, rel=2e-3, abs=2e-3), (losses, ref_losses)
    assert losses[-1] < losses[0], f"training did not reduce the loss: {losses}"
    full = full_model_state(m)
    ref_state = ref.state_dict()
    for name, value in full.items():
        if name.startswith("bn.running") or name == "bn.num_batches_tracked":
            continue  # per-rank batch statistics: compared across ranks below for DDP/TP
        r = ref_state[name]
        assert value.dtype == r.dtype and value.shape == r.shape, name
        tol = 2e-2 if value.dtype == torch.bfloat16 else 2e-3
        assert torch.allclose(value.float(), r.float(), rtol=tol, atol=tol), (
            name,
            (value.float() - r.float()).abs().max(),
        )
    if kind in ("ddp", "tp"):
        # Replicated parameters must be bit-identical on every rank. (DDP broadcasts rank 0's
        # buffers at the start of each forward, so BatchNorm statistics differ after it.)
        for name, value in full.items():
            if kind == "ddp" and name.startswith("bn.") and name not in current:
                continue
            assert _all_equal_across_ranks(value), f"{name} differs across ranks"
    _check_dataloader(kind)
    return {"losses": losses, "ref_losses": ref_losses}


def _check_dataloader(kind: str) -> None:
    """boost() hands dataloaders to unickpt.data with the plugin's data-parallel rank and size."""
    import torch
    import torch.distributed as dist
    from conftest import make_plugin
    from torch.utils.data import DataLoader, TensorDataset

    from unickpt.booster import Booster

    booster = Booster(make_plugin(kind))
    loader = DataLoader(TensorDataset(torch.arange(16)), batch_size=2)
    _, _, _, dl, _ = booster.boost(torch.nn.Linear(2, 2), dataloader=loader)
    seen = [int(i) for (b,) in dl for i in b]
    everyone: list[list[int]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, seen)
    if kind == "tp":  # one data-parallel replica: every rank reads the same batches
        assert all(s == list(range(16)) for s in everyone), everyone
    else:
        flat = sorted(i for s in everyone for i in s)
        assert flat == list(range(16)), f"ranks' samples must partition the dataset: {everyone}"


def mixed_precision_case() -> dict[str, Any]:
    """FSDP2 with a bf16 compute policy: trains, and the sharded parameters keep their own dtype."""
    import torch
    import torch.distributed as dist
    from conftest import batch, local_batch, loss_fn, make_model, make_optimizer, reference_step
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor

    from unickpt.booster import Booster
    from unickpt.plugins import FSDP2Plugin

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    plugin = FSDP2Plugin(mp_policy=policy, reshard_after_forward=False)
    booster = Booster(plugin)
    m, o, *_ = booster.boost(make_model(0), make_optimizer(make_model(0)))
    ref = make_model(0)
    ref_optim = make_optimizer(ref)
    losses, ref_losses = [], []
    for step in range(STEPS):
        x, y = local_batch(plugin, *batch(step))
        logits = m(x)
        assert logits.dtype == torch.bfloat16, logits.dtype
        loss = loss_fn(logits.float(), y)
        booster.backward(loss, o)
        o.step()
        o.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / dist.get_world_size())
        ref_losses.append(reference_step(ref, ref_optim, step, plugin.dp_size))
    for name, p in m.unwrap().named_parameters():
        assert isinstance(p, DTensor), name
        expected = torch.bfloat16 if name == "scale.weight" else torch.float32
        assert p.dtype == expected, (name, p.dtype)
    assert losses == pytest.approx(ref_losses, rel=5e-2), (losses, ref_losses)
    assert losses[-1] < losses[0], losses
    return {"losses": losses}


def error_cases() -> dict[str, Any]:
    """Plugin misuse must raise clear unickpt errors on every rank (no hang)."""
    import torch
    from conftest import make_model, make_optimizer, tp_plan
    from torch.distributed.fsdp import FSDPModule

    from unickpt.errors import UnsupportedError
    from unickpt.plugins import FSDP2Plugin, TPPlugin

    out: dict[str, str] = {}
    with pytest.raises(UnsupportedError, match="tied"):
        FSDP2Plugin(shard_modules=["emb"]).configure(make_model())
    with pytest.raises(UnsupportedError, match="does not have"):
        FSDP2Plugin(shard_modules=["nope"]).configure(make_model())
    model = make_model()
    with pytest.raises(UnsupportedError, match="several dtypes"):
        # Sharding only the blocks leaves the bf16 scale in the root group with fp32 params.
        FSDP2Plugin(shard_modules=["blocks.0", "blocks.1"]).configure(model)
    model = make_model()
    optim = make_optimizer(model)
    model(torch.zeros(2, 3, dtype=torch.long)).sum().backward()
    optim.step()
    with pytest.raises(UnsupportedError, match="already holds state"):
        FSDP2Plugin().configure(model, optim)
    assert not isinstance(model, FSDPModule), "a refused configure must leave the model unsharded"
    with pytest.raises(UnsupportedError, match="not a parameter of the model"):
        TPPlugin(tp_plan()).configure(make_model(), torch.optim.SGD(torch.nn.Linear(2, 2).parameters()))
    with pytest.raises(UnsupportedError, match="ParallelStyle"):
        TPPlugin({"blocks.0.up": "colwise"})  # type: ignore[dict-item]
    # shard_modules by class and by name; nested units are sharded deepest first.
    from conftest import Bf16Scale, Block

    plugin = FSDP2Plugin(shard_modules=[Block, Bf16Scale, "blocks.0.attn"])
    m, *_ = plugin.configure(make_model())
    assert plugin.units == ["blocks.0", "blocks.0.attn", "blocks.1", "scale"], plugin.units
    inner = m.unwrap()
    assert all(isinstance(inner.get_submodule(u), FSDPModule) for u in plugin.units)
    assert not isinstance(inner.bn, FSDPModule) and isinstance(inner, FSDPModule)
    out["ok"] = "yes"
    return out


def train_worker(world_size: int | str) -> dict[str, CaseResult]:
    ws = int(world_size)
    kinds = ["ddp", "fsdp2", "tp"]
    cases: list[tuple[str, Any]] = [(f"{k}x{ws}", functools.partial(train_case, k)) for k in kinds]
    if ws == 2:
        cases.append(("fsdp2-bf16-compute", mixed_precision_case))
        cases.append(("errors", error_cases))
    return run_cases(cases)


NO_TORCHRUN_SCRIPT = """
import os, sys
import torch
from unickpt.booster import Booster
from unickpt.errors import DistributedError
from unickpt.plugins import DDPPlugin
model = torch.nn.Linear(3, 2)
optim = torch.optim.SGD(model.parameters(), lr=0.1)
plugin = DDPPlugin()
m, o, *_ = Booster(plugin).boost(model, optim)
m(torch.ones(4, 3)).sum().backward()
o.step()
assert plugin.layout() == {"plugin": "ddp", "world_size": 1, "mesh": {"dp": 1}, "dp_size": 1}, plugin.layout()
import torch.distributed as dist
dist.destroy_process_group()
os.environ["RANK"] = "0"  # a partial torchrun environment must be refused, not guessed
try:
    DDPPlugin().configure(torch.nn.Linear(3, 2))
except DistributedError as e:
    assert "WORLD_SIZE" in str(e), e
else:
    sys.exit("partial environment accepted")
print("OK")
"""


def test_plugin_without_torchrun_runs_one_process_world() -> None:
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHONPATH"] = str(repo)
    proc = subprocess.run(
        [sys.executable, "-c", NO_TORCHRUN_SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]


def hang_worker() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(600)
    dist.barrier()


def fail_worker() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise RuntimeError("rank one fails on purpose")
    dist.barrier()


# -- parent side -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def worlds(world_pool: WorldPool) -> dict[Any, Any]:
    return {"pool": world_pool}


def _world(worlds: dict[Any, Any], ws: int) -> dict[str, CaseResult]:
    if ws not in worlds:
        try:
            worlds[ws] = worlds["pool"].run(
                ws, "test_plugins_train:train_worker", ws, timeout=WORLD_TIMEOUT_S
            )[0]
        except WorldError as e:
            worlds[ws] = e
    result = worlds[ws]
    if isinstance(result, Exception):
        raise result
    return result  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    "ws,case",
    [(2, "ddpx2"), (2, "fsdp2x2"), (2, "tpx2"), (2, "errors"), (4, "ddpx4"), (4, "fsdp2x4"), (4, "tpx4")],
)
def test_train_matches_single_process(worlds: dict[int, Any], ws: int, case: str) -> None:
    results = _world(worlds, ws)
    res = results[case]
    if not res.ok:
        pytest.fail(f"case {case} failed in the world of {ws}:\n{res.error}", pytrace=False)
    if case != "errors":
        assert len(res.value["losses"]) == STEPS


def test_harness_kills_a_hung_world() -> None:
    t0 = time.monotonic()
    with pytest.raises(WorldTimeout, match="exceeded"):
        run_world(2, "test_plugins_train:hang_worker", timeout=6)
    assert time.monotonic() - t0 < 30


def test_harness_reports_rank_tracebacks() -> None:
    with pytest.raises(WorldError) as info:
        run_world(2, "test_plugins_train:fail_worker", timeout=120, fail_grace_s=2)
    assert "rank one fails on purpose" in info.value.rank_errors[1]
    assert "after a peer failed" in info.value.rank_errors[0]  # blocked in the barrier, killed
    assert "RuntimeError" in str(info.value)
