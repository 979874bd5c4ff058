"""Rank side of tests/dist/test_arg_divergence.py: ranks that pass different arguments.

Every collective public method of ``CheckpointIO`` and ``CheckpointManager`` is called with one
argument that differs on the last rank. Each case returns this rank's observation (error
type, message, seconds), whether anything was committed, and whether the world is still in
step afterwards (one ``all_gather_object`` of the case name).
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from unickpt import Booster, CheckpointManager
from unickpt.ckpt.reader import open_checkpoint
from unickpt.plugins.ddp import DDPPlugin


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(4, 6)
        self.down = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.up(x))


def attempt(fn: Callable[[], Any]) -> dict[str, Any]:
    t0 = time.monotonic()
    obs: dict[str, Any] = {"raised": None}
    try:
        fn()
    except BaseException as e:  # reported to the parent whatever it is
        obs.update(
            raised=type(e).__name__,
            mro=[c.__name__ for c in type(e).__mro__],
            message=str(e)[:3000],
            traceback=traceback.format_exc()[-3000:],
        )
    obs["seconds"] = time.monotonic() - t0
    return obs


def committed(path: Path, kind: str) -> bool:
    try:
        with open_checkpoint(path, kind):
            return True
    except Exception:
        return False


def _last(a: Any, b: Any) -> Any:
    """``a`` on every rank but the last, ``b`` there."""
    return b if dist.get_rank() == dist.get_world_size() - 1 else a


def arg_divergence_cases(root: str) -> dict[str, Any]:
    base = Path(root)
    booster = Booster(DDPPlugin())
    net = Tiny()
    opt = torch.optim.AdamW(list(net.named_parameters()), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3)
    model, optim, *_ = booster.boost(net, opt)
    model(torch.ones(2, 4)).sum().backward()
    optim.step()
    io = booster.checkpoint_io
    good = base / "good"
    io.save_model(model, good / "model", shard=True)
    io.save_optimizer(optim, good / "optim", shard=True)
    io.save_lr_scheduler(sched, good / "sched.json")
    io.save_model(model, good / "pre", shard=True, prefix="p")
    mgr = CheckpointManager(base / "run", booster, save_steps=2)
    mgr.save(2, model, optim, sched)

    cases: list[tuple[str, str, Callable[[Path], Any], str]] = []  # (name, argument, call, kind)

    def save_model_case(arg: str, **kw: Any) -> None:
        def call(d: Path) -> Any:
            args = {"shard": True, **{k: _last(*v) for k, v in kw.items()}}
            target = args.pop("checkpoint", d)
            out = io.save_model(model, target, **args)
            io.wait()
            return out

        cases.append((f"save_model.{arg}", next(iter(kw)), call, "model"))

    save_model_case("shard", shard=(True, False))
    save_model_case("gather_dtensor", gather_dtensor=(True, False))
    save_model_case("prefix", prefix=(None, "x"))
    save_model_case("size_per_shard", size_per_shard=(1024, 1))
    save_model_case("size_per_shard_bad", size_per_shard=(1024, -1))
    save_model_case("use_safetensors", use_safetensors=(True, None))
    save_model_case("use_async", use_async=(False, True))

    def save_model_path(d: Path) -> Any:
        return io.save_model(model, _last(d / "a", d / "b"), shard=True)

    cases.append(("save_model.checkpoint", "checkpoint", save_model_path, "model"))

    def save_optim_case(arg: str, **kw: Any) -> None:
        def call(d: Path) -> Any:
            args = {"shard": True, **{k: _last(*v) for k, v in kw.items()}}
            out = io.save_optimizer(optim, d, **args)
            io.wait()
            return out

        cases.append((f"save_optimizer.{arg}", arg, call, "optimizer"))

    save_optim_case("shard", shard=(True, False))
    save_optim_case("gather_dtensor", gather_dtensor=(False, True))
    save_optim_case("prefix", prefix=("y", None))
    save_optim_case("size_per_shard", size_per_shard=(1, 2))
    save_optim_case("use_async", use_async=(True, False))

    def load_model_case(arg: str, **kw: Any) -> None:
        def call(d: Path) -> Any:
            args = {k: _last(*v) for k, v in kw.items()}
            target = args.pop("checkpoint", good / "model")
            return io.load_model(model, target, **args)

        cases.append((f"load_model.{arg}", arg, call, ""))

    load_model_case("checkpoint", checkpoint=(good / "model", good / "pre"))
    load_model_case("strict", strict=(True, False))
    load_model_case("verify", verify=(False, True))
    load_model_case("prefix", prefix=(None, "p"))
    load_model_case("allow_dtype_cast", allow_dtype_cast=(False, True))

    def load_optim_case(arg: str, **kw: Any) -> None:
        def call(d: Path) -> Any:
            args = {k: _last(*v) for k, v in kw.items()}
            target = args.pop("checkpoint", good / "optim")
            return io.load_optimizer(optim, target, **args)

        cases.append((f"load_optimizer.{arg}", arg, call, ""))

    load_optim_case("checkpoint", checkpoint=(good / "optim", good / "model"))
    load_optim_case("verify", verify=(True, False))
    load_optim_case("prefix", prefix=(None, "z"))

    cases.append(
        (
            "save_lr_scheduler.checkpoint",
            "checkpoint",
            lambda d: io.save_lr_scheduler(sched, _last(d / "s.json", d / "t.json")),
            "",
        )
    )
    cases.append(
        (
            "load_lr_scheduler.checkpoint",
            "checkpoint",
            lambda d: io.load_lr_scheduler(sched, _last(good / "sched.json", d / "missing.json")),
            "",
        )
    )

    def mgr_save(d: Path, **kw: Any) -> Any:
        m = CheckpointManager(d / "run", booster, save_steps=2)
        args: dict[str, Any] = {"step": 4, "model": model, "optimizer": optim}
        args.update({k: _last(*v) for k, v in kw.items()})
        return m.save(**args)

    cases.append(("manager.save.step", "step", lambda d: mgr_save(d, step=(4, 6)), "run"))
    cases.append(("manager.save.force", "force", lambda d: mgr_save(d, force=(False, True)), "run"))
    cases.append(
        ("manager.save.optimizer", "optimizer", lambda d: mgr_save(d, optimizer=(optim, None)), "run")
    )
    cases.append(
        (
            "manager.save.lr_scheduler",
            "lr_scheduler",
            lambda d: mgr_save(d, lr_scheduler=(None, sched)),
            "run",
        )
    )
    cases.append(
        (
            "manager.load.resume_from_checkpoint",
            "resume_from_checkpoint",
            lambda d: mgr.load(model, optim, resume_from_checkpoint=_last("latest", 2)),
            "",
        )
    )
    cases.append(
        (
            "manager.load.resume_none",
            "resume_from_checkpoint",
            lambda d: mgr.load(model, optim, resume_from_checkpoint=_last("latest", None)),
            "",
        )
    )
    cases.append(("manager.load.optimizer", "optimizer", lambda d: mgr.load(model, _last(optim, None)), ""))

    cases.append(
        (
            "manager.init.save_steps",
            "save_steps",
            lambda d: CheckpointManager(d / "run", booster, save_steps=_last(2, 3)),
            "",
        )
    )
    cases.append(
        (
            "manager.init.async_save",
            "async_save",
            lambda d: CheckpointManager(d / "run", booster, async_save=_last(False, True)),
            "",
        )
    )

    out: dict[str, Any] = {}
    for name, arg, call, kind in cases:
        d = base / name
        if dist.get_rank() == 0:
            d.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        try:
            obs = attempt(lambda: call(d))  # noqa: B023
            obs["argument"] = arg
            dist.barrier()
            if kind == "run":
                obs["committed"] = (d / "run").is_dir() and any(
                    p.name.startswith("step-") for p in (d / "run").iterdir()
                )
            elif kind:
                obs["committed"] = any(committed(p, kind) for p in [d, d / "a", d / "b"])
            # Still in step: every rank reaches the same collective next.
            obs["in_step"] = dist_all_same(name)
            out[name] = obs
        except Exception:
            out[name] = {"case_error": traceback.format_exc()[-4000:]}
    return out


def dist_all_same(name: str) -> bool:
    got: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(got, name)
    return all(g == name for g in got)
