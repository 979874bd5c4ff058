"""Rank side of tests/dist/test_rank_divergence.py (one 2-rank gloo world, 20 s collective timeout).

Two families of cases, each returning per-rank observations to the parent:

* ranks that disagree: replicas that differ (warned, or refused with ``check_replicas="raise"``),
  a tensor only some DDP ranks hold (a parameter frozen on one rank), a gathered save whose
  ranks disagree on shapes, an optimizer of another class on one rank (save and load), a
  param group value JSON cannot hold on one rank, a scheduler that fails to load on one rank;
* parameters that never stepped (frozen but in the optimizer, and an unused "expert") under
  DDP, FSDP2, TP, ZeRO-2 and PP, sliced and gathered, and through the CheckpointManager:
  saved and loaded exactly, and training resumed from the checkpoint follows the
  uninterrupted run bit for bit.
"""

from __future__ import annotations

import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _pp_zero_hybrid_worker import SPLIT, batch, loss_fn, make_model, tp_plan
from torch import nn

from unickpt import Booster, CheckpointManager, OptimizerWrapper
from unickpt.ckpt.reader import open_checkpoint
from unickpt.errors import IncompleteCheckpointError
from unickpt.io.replicas import ReplicaMismatchWarning
from unickpt.plugins.ddp import DDPCheckpointIO

TINY_MB = 1e-4


def attempt(fn: Callable[[], Any]) -> dict[str, Any]:
    t0 = time.monotonic()
    obs: dict[str, Any] = {"raised": None, "warnings": []}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            obs["value"] = fn()
        obs["warnings"] = [
            {"category": w.category.__name__, "message": str(w.message)}
            for w in caught
            if issubclass(w.category, ReplicaMismatchWarning)
        ]
    except BaseException as e:  # reported to the parent whatever it is
        obs.update(
            raised=type(e).__name__,
            mro=[c.__name__ for c in type(e).__mro__],
            message=str(e)[:3000],
            traceback=traceback.format_exc()[-3000:],
        )
    obs["seconds"] = time.monotonic() - t0
    if not isinstance(obs.get("value"), (type(None), bool, int, float, str, list, dict)):
        obs["value"] = repr(obs["value"])
    return obs


class Tiny(nn.Module):
    def __init__(self, hidden: int = 10) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(4, hidden)
        self.down = nn.Linear(hidden, 3)


def committed(path: Path, kind: str) -> bool:
    try:
        open_checkpoint(path, kind).close()
    except IncompleteCheckpointError:
        return False
    return True


# --------------------------------------------------------------------------- ranks that disagree


def case_replicas_differ(d: Path) -> dict[str, Any]:
    rank = dist.get_rank()
    model = Tiny()
    if rank == 1:
        with torch.no_grad():
            model.up.weight[3, 1] += 1.0  # one element of one replica
    out: dict[str, Any] = {}
    for mode in ("warn", "raise", "off"):
        io = DDPCheckpointIO(check_replicas=mode)
        for layout, kw in (("sliced", {"gather_dtensor": False}), ("gathered", {})):
            target = d / f"{mode}-{layout}"
            obs = attempt(lambda io=io, target=target, kw=kw: io.save_model(model, target, shard=True, **kw))
            dist.barrier()
            obs["committed"] = committed(target, "model")
            out[f"{mode}/{layout}"] = obs
    same = Tiny()  # identical replicas: no warning
    out["identical"] = attempt(lambda: DDPCheckpointIO().save_model(same, d / "same", shard=True))
    return out


def case_tensor_missing_on_one_rank(d: Path) -> dict[str, Any]:
    """DDP: a parameter frozen on rank 1 only has optimizer state on rank 0 only."""
    model = Tiny()
    if dist.get_rank() == 1:
        model.up.bias.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model.down(model.up(torch.ones(2, 4))).sum().backward()
    opt.step()
    io = DDPCheckpointIO(check_replicas="raise")
    obs = attempt(lambda: io.save_optimizer(OptimizerWrapper(opt, model), d / "o", shard=True))
    dist.barrier()
    obs["committed"] = committed(d / "o", "optimizer")
    return obs


def case_gathered_shapes_differ(d: Path) -> dict[str, Any]:
    model = Tiny(hidden=10 if dist.get_rank() == 0 else 12)
    out = {}
    for name, kw in (("sharded", {"shard": True}), ("single", {})):
        target = d / name
        obs = attempt(lambda target=target, kw=kw: DDPCheckpointIO().save_model(model, target, **kw))
        dist.barrier()
        obs["committed"] = committed(target, "model")
        out[name] = obs
    return out


def _stepped(model: nn.Module, opt: torch.optim.Optimizer) -> OptimizerWrapper:
    model.down(model.up(torch.ones(2, 4))).sum().backward()
    opt.step()
    return OptimizerWrapper(opt, model)


def case_optimizer_class_differs(d: Path) -> dict[str, Any]:
    model = Tiny()
    good = _stepped(model, torch.optim.AdamW(model.parameters(), lr=0.1))
    io = DDPCheckpointIO()
    io.save_optimizer(good, d / "good", shard=True)
    other = Tiny()
    cls = torch.optim.AdamW if dist.get_rank() == 0 else torch.optim.SGD
    odd = _stepped(other, cls(other.parameters(), lr=0.1))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    save = attempt(lambda: io.save_optimizer(odd, d / "new", shard=True))
    dist.barrier()
    save["committed"] = committed(d / "new", "optimizer")
    load = attempt(lambda: io.load_optimizer(odd, d / "good"))
    load["model_unchanged"] = all(torch.equal(v, before[k]) for k, v in other.state_dict().items())
    return {"save": save, "load": load}


def case_unsupported_group_value_on_one_rank(d: Path) -> dict[str, Any]:
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    if dist.get_rank() == 1:
        opt.param_groups[0]["hook"] = lambda: None  # JSON cannot hold it; never pickled
    else:
        opt.param_groups[0]["hook"] = None
    obs = attempt(lambda: DDPCheckpointIO().save_optimizer(_stepped(model, opt), d / "o", shard=True))
    dist.barrier()
    obs["committed"] = committed(d / "o", "optimizer")
    return obs


class _Picky(torch.optim.lr_scheduler.StepLR):
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if dist.get_rank() == 1:
            raise KeyError("rank 1's scheduler refuses this state")
        super().load_state_dict(state_dict)


def case_scheduler_fails_on_one_rank(d: Path) -> dict[str, Any]:
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    io = DDPCheckpointIO()
    path = io.save_lr_scheduler(torch.optim.lr_scheduler.StepLR(opt, 2), d)
    return attempt(lambda: io.load_lr_scheduler(_Picky(opt, 3), path))


def case_boost_inputs_differ(d: Path) -> dict[str, Any]:
    """Booster.boost with an optimizer of another class, or a frozen parameter, on rank 1 only."""
    del d
    from unickpt.plugins import DDPPlugin, FSDP2Plugin

    rank = dist.get_rank()
    out = {}
    for plugin_cls in (DDPPlugin, FSDP2Plugin):
        model = Tiny()
        cls = torch.optim.AdamW if rank == 0 else torch.optim.SGD
        out[f"class/{plugin_cls.name}"] = attempt(
            lambda model=model, cls=cls, plugin_cls=plugin_cls: Booster(plugin_cls()).boost(
                model, cls(model.parameters(), lr=0.1)
            )
        )
        frozen = Tiny()
        if rank == 1:
            frozen.up.bias.requires_grad_(False)
        out[f"frozen/{plugin_cls.name}"] = attempt(
            lambda frozen=frozen, plugin_cls=plugin_cls: Booster(plugin_cls()).boost(
                frozen, torch.optim.AdamW(frozen.parameters(), lr=0.1)
            )
        )
    return out


# --------------------------------------------------------------------------- never-stepped parameters

LAYOUTS = ["ddp", "fsdp2", "tp", "zero2", "pp2"]


def make_plugin(layout: str) -> Any:
    from unickpt.plugins import DDPPlugin, FSDP2Plugin, TPPlugin
    from unickpt.plugins.hybrid import HybridParallelPlugin
    from unickpt.plugins.pp import PPPlugin
    from unickpt.plugins.zero import ZeroPlugin

    return {
        "ddp": lambda: DDPPlugin(find_unused_parameters=True),
        "fsdp2": lambda: FSDP2Plugin(),
        "tp": lambda: TPPlugin(tp_plan()),
        "zero2": lambda: ZeroPlugin(stage=2),
        "pp2": lambda: PPPlugin(2, SPLIT, num_microbatches=2),
        "hyb_fsdp_dp2tp2": lambda: HybridParallelPlugin(tp_size=2, dp="fsdp2", tp_plan=tp_plan()),
        "hyb_pp2tp2": lambda: HybridParallelPlugin(
            tp_size=2, pp_size=2, tp_plan=tp_plan(), split_points=SPLIT
        ),
    }[layout]()


FROZEN = "blocks.0.ln.weight"  # in the optimizer, requires_grad=False
UNUSED = "blocks.2.expert"  # a module forward never calls: its parameters never get a gradient


class Run:
    """A boosted PipeNet with a frozen parameter and an unused expert, trained ``steps`` steps."""

    def __init__(self, layout: str) -> None:
        model = make_model(0)
        model.blocks[2].expert = nn.Linear(4, 6)  # type: ignore[index]
        model.get_parameter(FROZEN).requires_grad_(False)
        opt = torch.optim.AdamW(
            [
                {"params": [p for n, p in model.named_parameters() if "expert" not in n], "lr": 1e-2},
                # a whole group that never steps
                {"params": list(model.blocks[2].expert.parameters()), "lr": 3e-3},  # type: ignore[index]
            ],
            foreach=False,
            weight_decay=0.05,
        )
        self.plugin = make_plugin(layout)
        self.booster = Booster(self.plugin)
        self.model, self.optim, *_ = self.booster.boost(model, opt, criterion=loss_fn)

    def step(self, step: int) -> None:
        x, y = batch(step)
        dp_size, dp_rank = self.plugin.dp_size, self.plugin.dp_rank
        n = x.shape[0] // dp_size
        x, y = x[dp_rank * n : (dp_rank + 1) * n], y[dp_rank * n : (dp_rank + 1) * n]
        if getattr(self.plugin, "runtime", None) is not None:
            self.booster.execute_pipeline(iter([(x, y)]), self.model, loss_fn, self.optim)
        else:
            self.booster.backward(loss_fn(self.model(x), y), self.optim)
        self.optim.step()
        self.optim.zero_grad()


def _state_summary(run: Run) -> dict[str, Any]:
    """Full model and optimizer tensors and which parameters have state (collective)."""
    from _pp_zero_hybrid_worker import Setup, full_state

    fake = Setup.__new__(Setup)
    fake.plugin, fake.model, fake.optim = run.plugin, run.model, run.optim
    full = full_state(fake)
    with_state = sorted({k.split("/")[1] for k in full if k.startswith("optim/")})
    return {"full": full, "with_state": with_state}


def _bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    bad = sorted(set(a) ^ set(b))
    for k in set(a) & set(b):
        x, y = a[k], b[k]
        if (
            x.dtype != y.dtype
            or x.shape != y.shape
            or not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
        ):
            bad.append(k)
    return sorted(bad)


def case_never_stepped(d: Path, layout: str) -> dict[str, Any]:
    ref = Run(layout)  # the uninterrupted run: 4 steps
    for s in range(4):
        ref.step(s)
    ref_state = _state_summary(ref)
    initial = make_model(0).get_parameter(FROZEN).detach()
    out: dict[str, Any] = {
        "ref_with_state": ref_state["with_state"],
        # a frozen parameter never changes, whatever the optimizer does with its state
        "frozen_unchanged": torch.equal(ref_state["full"][f"model/{FROZEN}"], initial),
    }
    for mode, gather in (("sliced", False), ("gathered", True)):
        run = Run(layout)
        for s in range(2):
            run.step(s)
        saved = _state_summary(run)
        io = run.plugin.get_checkpoint_io()
        io.save_model(run.model, d / f"{layout}-{mode}-m", shard=True, gather_dtensor=gather)
        io.save_optimizer(run.optim, d / f"{layout}-{mode}-o", shard=True, gather_dtensor=gather)
        after_save = _state_summary(run)
        fresh = Run(layout)
        fio = fresh.plugin.get_checkpoint_io()
        fio.load_model(fresh.model, d / f"{layout}-{mode}-m")
        fio.load_optimizer(fresh.optim, d / f"{layout}-{mode}-o")
        loaded = _state_summary(fresh)
        for s in range(2, 4):
            fresh.step(s)
        resumed = _state_summary(fresh)
        out[mode] = {
            "saved_with_state": saved["with_state"],
            "save_changed": _bits_equal(saved["full"], after_save["full"]),
            "load_differs": _bits_equal(saved["full"], loaded["full"]),
            "resume_differs": _bits_equal(ref_state["full"], resumed["full"]),
        }
    return out


def case_never_stepped_manager(d: Path) -> dict[str, Any]:
    ref = Run("fsdp2")
    for s in range(4):
        ref.step(s)
    ref_state = _state_summary(ref)
    run = Run("fsdp2")
    for s in range(2):
        run.step(s)
    mgr = CheckpointManager(d / "mgr", run.booster, save_steps=1, keep_last=None)
    mgr.save(2, run.model, run.optim)
    fresh = Run("fsdp2")
    step = CheckpointManager(d / "mgr", fresh.booster).load(fresh.model, fresh.optim)
    for s in range(step, 4):
        fresh.step(s)
    return {"step": step, "resume_differs": _bits_equal(ref_state["full"], _state_summary(fresh)["full"])}


CASES: list[tuple[str, Callable[[Path], Any]]] = [
    ("replicas_differ", case_replicas_differ),
    ("tensor_missing_on_one_rank", case_tensor_missing_on_one_rank),
    ("gathered_shapes_differ", case_gathered_shapes_differ),
    ("optimizer_class_differs", case_optimizer_class_differs),
    ("unsupported_group_value_on_one_rank", case_unsupported_group_value_on_one_rank),
    ("scheduler_fails_on_one_rank", case_scheduler_fails_on_one_rank),
    ("boost_inputs_differ", case_boost_inputs_differ),
    *[(f"never_stepped_{lay}", lambda d, lay=lay: case_never_stepped(d, lay)) for lay in LAYOUTS],
    ("never_stepped_manager", case_never_stepped_manager),
]


def never_stepped_cases(root: str, layouts: list[str]) -> dict[str, Any]:
    """The never-stepped round trip for layouts that need another world size (hybrid on 4 ranks)."""
    out: dict[str, Any] = {}
    for lay in layouts:
        d = Path(root) / f"never_stepped_{lay}"
        if dist.get_rank() == 0:
            d.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        try:
            out[f"never_stepped_{lay}"] = case_never_stepped(d, lay)
        except Exception:
            out[f"never_stepped_{lay}"] = {"case_error": traceback.format_exc()[-4000:]}
    return out


def divergence_cases(root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, fn in CASES:
        d = Path(root) / name
        if dist.get_rank() == 0:
            d.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        t0 = time.monotonic()
        try:
            out[name] = fn(d)
        except Exception:
            out[name] = {"case_error": traceback.format_exc()[-4000:]}
        out[name + ".seconds"] = time.monotonic() - t0
    return out
