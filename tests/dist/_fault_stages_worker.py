"""Rank side of tests/dist/test_fault_stages.py: a failure on one rank at every stage of save and load.

For each plugin (DDP, FSDP2, TP, ZeRO-2, PP) the ranks boost a tiny model, train two steps and save good
checkpoints (model, optimizer, scheduler, a manager step). Then, for every operation (model,
optimizer and scheduler save/load, gathered, sliced and single-file, the manager's save and
load), the ranks first run it once while tracing the fault stages it reaches
(``unickpt._faults.tracing``), then once per reached stage with that stage failing on one
rank (rank 1 where it reaches the stage, else rank 0). Each rank reports what it raised and
how long it took, and whether every committed checkpoint is still intact (same bytes, and
the failed save's own directory either not committed or committed whole: it verifies).
"""

from __future__ import annotations

import hashlib
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from unickpt import Booster, CheckpointManager, verify_checkpoint
from unickpt._faults import InjectedFault, injected, tracing
from unickpt.ckpt.reader import open_checkpoint
from unickpt.errors import IncompleteCheckpointError

TINY_MB = 1e-4  # about 100 bytes per shard file: several files per save


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(4, 10)
        self.down = nn.Linear(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


def tree_digest(path: Path) -> dict[str, str]:
    """sha256 of every file under ``path`` (relative names), to prove nothing was touched."""
    if not path.exists():
        return {}
    if path.is_file():
        return {path.name: hashlib.sha256(path.read_bytes()).hexdigest()}
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


class Env:
    """One plugin's boosted objects, its good checkpoints and the operations under test."""

    def __init__(self, kind: str, root: Path) -> None:
        from _pp_zero_hybrid_worker import SPLIT, batch, loss_fn, make_model
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        from unickpt.plugins import DDPPlugin, FSDP2Plugin, TPPlugin
        from unickpt.plugins.pp import PPPlugin
        from unickpt.plugins.zero import ZeroPlugin

        self.kind = kind
        self.root = root
        if dist.get_rank() == 0:
            root.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        plugin = {
            "ddp": DDPPlugin,
            "fsdp2": FSDP2Plugin,
            "tp": lambda: TPPlugin({"up": ColwiseParallel(), "down": RowwiseParallel()}),
            "zero2": lambda: ZeroPlugin(stage=2),
            "pp2": lambda: PPPlugin(2, SPLIT, num_microbatches=2),
        }[kind]()
        net: nn.Module = make_model(0) if kind == "pp2" else Tiny()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        self.booster = Booster(plugin)
        self.model, self.optim, _, _, self.sched = self.booster.boost(
            net, opt, criterion=loss_fn, lr_scheduler=sched
        )
        for step in range(2):
            self.optim.zero_grad()
            if kind == "pp2":  # every stage runs the same global batch through the pipeline
                self.booster.execute_pipeline(iter([batch(step)]), self.model, loss_fn, self.optim)
            else:
                x = torch.randn(4, 4, generator=torch.Generator().manual_seed(step * 10 + dist.get_rank()))
                self.booster.backward(self.model(x).square().mean(), self.optim)
            self.optim.step()
            self.sched.step()
        self.io = plugin.get_checkpoint_io()
        self.good = {
            "model": Path(
                self.io.save_model(self.model, root / "good-model", shard=True, size_per_shard=TINY_MB)
            ),
            "optimizer": Path(
                self.io.save_optimizer(self.optim, root / "good-optim", shard=True, size_per_shard=TINY_MB)
            ),
            "scheduler": Path(self.io.save_lr_scheduler(self.sched, root / "good-sched")),
        }
        self.mgr = CheckpointManager(
            root / "manager", self.booster, save_steps=1, keep_last=None, save_hf=True
        )
        self.mgr.save(1, self.model, self.optim, self.sched)
        # Async: the write runs on a background thread and group; its error comes from wait().
        self.amgr = CheckpointManager(
            root / "async", self.booster, save_steps=1, keep_last=None, async_save=True
        )
        self.next_step = 2
        dist.barrier()
        self.digests = self._digests()

    def _digests(self) -> dict[str, dict[str, str]]:
        out = {k: tree_digest(p) for k, p in self.good.items()}
        out["manager step 1"] = tree_digest(self.root / "manager" / "step-1")
        return out

    def ops(self) -> list[tuple[str, str, Callable[[Path], Any]]]:
        """(name, kind of output: checkpoint kind or "" , fn(target))."""
        io, m, o, s = self.io, self.model, self.optim, self.sched

        def mgr_save(t: Path) -> None:
            del t
            step, self.next_step = self.next_step, self.next_step + 1
            self.mgr.save(step, m, o, s, force=True)

        def async_save(t: Path) -> None:
            del t
            step, self.next_step = self.next_step, self.next_step + 1
            try:
                self.amgr.save(step, m, o, s, force=True)
            finally:
                self.amgr.wait()

        return [
            (
                "save_model_gathered",
                "model",
                lambda t: io.save_model(m, t, shard=True, size_per_shard=TINY_MB),
            ),
            (
                "save_model_sliced",
                "model",
                lambda t: io.save_model(m, t, shard=True, gather_dtensor=False, size_per_shard=TINY_MB),
            ),
            ("save_model_single_file", "model", lambda t: io.save_model(m, t)),
            ("load_model", "", lambda t: io.load_model(m, self.good["model"], verify=True)),
            (
                "save_optimizer_gathered",
                "optimizer",
                lambda t: io.save_optimizer(o, t, shard=True, size_per_shard=TINY_MB),
            ),
            (
                "save_optimizer_sliced",
                "optimizer",
                lambda t: io.save_optimizer(o, t, shard=True, gather_dtensor=False, size_per_shard=TINY_MB),
            ),
            ("load_optimizer", "", lambda t: io.load_optimizer(o, self.good["optimizer"])),
            ("save_lr_scheduler", "", lambda t: io.save_lr_scheduler(s, t)),
            ("load_lr_scheduler", "", lambda t: io.load_lr_scheduler(s, self.good["scheduler"])),
            ("manager_save", "", mgr_save),
            ("manager_save_async", "", async_save),
            ("manager_load", "", lambda t: self.mgr.load(m, o, s, resume_from_checkpoint=1)),
        ]

    def intact(self, target: Path, kind: str) -> dict[str, Any]:
        """Every committed checkpoint unchanged; the failed save's directory not committed, or whole."""
        out: dict[str, Any] = {"good_intact": self._digests() == self.digests}
        steps = self.mgr.all_steps()
        out["manager_steps"] = steps
        out["target"] = "none"
        if kind and target.exists():
            try:
                open_checkpoint(target, kind).close()
            except IncompleteCheckpointError:
                out["target"] = "not committed"
            else:
                verify_checkpoint(target)  # raises if a committed checkpoint is damaged
                out["target"] = "committed and verified"
        return out


def _attempt(fn: Callable[[], Any]) -> dict[str, Any]:
    t0 = time.monotonic()
    obs: dict[str, Any] = {"raised": None}
    try:
        fn()
    except BaseException as e:  # every outcome is reported to the parent
        obs.update(
            raised=type(e).__name__,
            mro=[c.__name__ for c in type(e).__mro__],
            message=str(e)[:2000],
            stage=getattr(e, "stage", None),
            traceback=traceback.format_exc()[-2000:],
        )
    obs["seconds"] = time.monotonic() - t0
    return obs


def stage_cases(root: str, kinds: tuple[str, ...] = ("ddp", "fsdp2")) -> dict[str, Any]:
    rank = dist.get_rank()
    runs: list[dict[str, Any]] = []
    traced: dict[str, list[list[str]]] = {}
    final: dict[str, Any] = {}
    for kind in kinds:
        env = Env(kind, Path(root) / kind)
        for k, (op, out_kind, fn) in enumerate(env.ops()):
            base = Path(root) / kind / "runs"
            target = base / f"{op}-traced"
            with tracing() as reached:
                fn(target)
            per_rank: list[list[str]] = [[] for _ in range(dist.get_world_size())]
            dist.all_gather_object(per_rank, sorted(set(reached)))
            traced[f"{kind}/{op}"] = per_rank
            stages = sorted(set().union(*map(set, per_rank)))
            for stage in stages:
                fail_rank = 1 if stage in per_rank[1] else 0
                target = base / f"{op}-{stage}"
                with open(Path(root) / f"progress-rank{rank}.txt", "a") as log:
                    log.write(f"{kind}/{op} @ {stage} on rank {fail_rank}\n")
                with injected(stage, fail_rank):
                    obs = _attempt(lambda fn=fn, target=target: fn(target))  # type: ignore[misc]
                dist.barrier()  # a rank returning normally would be left waiting here
                obs.update(kind=kind, op=op, stage=stage, fail_rank=fail_rank, rank=rank, k=k)
                try:
                    obs.update(env.intact(target, out_kind))
                except Exception:
                    obs["intact_error"] = traceback.format_exc()[-2000:]
                runs.append(obs)
        # After every failure: the world still works, and the live state is the good one.
        probe = _attempt(lambda env=env: env.io.load_model(env.model, env.good["model"], verify=True))
        final[kind] = {"reload": probe, "good_intact": env._digests() == env.digests}
    return {"runs": runs, "traced": traced, "final": final, "InjectedFault": InjectedFault.__name__}
