"""torchtitan's own training components (llama3 debug model, ``OptimizersContainer``,
``LRSchedulersContainer``, ``ParallelAwareDataloader``) checkpointed by
``unickpt.integrations.torchtitan.CheckpointManager``, built as torchtitan's ``Trainer`` builds
and calls it. Run in-process (tests/unit/integrations/test_torchtitan_integration.py) or per rank of a gloo
world (tests/dist/test_torchtitan_dist.py); with 2 ranks each layer and the root are
``fully_shard``-ed (FSDP2 on CPU).

torchtitan's flex attention has no backward on CPU: the model config's ``FlexAttention`` is
swapped for torchtitan's ``ScaledDotProductAttention`` (causal) through ``Config.traverse``,
and 2 of the debug model's 6 layers are kept (2.75M parameters)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset

VOCAB, SEQ, GLOBAL_BATCH = 2048, 16, 4


class TokenStream(IterableDataset[Any]):
    """A stateful synthetic token stream, split over data-parallel ranks as torchtitan's
    datasets are: rank ``r`` of ``w`` takes global samples ``r, r + w, ...`` (sample ``i`` is
    a fixed function of ``i``), so a global batch holds the same samples at any degree."""

    def __init__(self, dp_rank: int, dp_world: int) -> None:
        self.dp_rank, self.dp_world, self.sample_idx = dp_rank, dp_world, 0

    def __iter__(self) -> Any:
        while True:
            g = self.sample_idx * self.dp_world + self.dp_rank
            self.sample_idx += 1
            gen = torch.Generator().manual_seed(1000 + g)
            tok = torch.randint(0, VOCAB, (SEQ + 1,), generator=gen)
            yield {"input": tok[:-1]}, tok[1:]

    def state_dict(self) -> dict[str, Any]:
        return {"sample_idx": self.sample_idx}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sample_idx = int(state["sample_idx"])


class TrainState:
    """The trainer's own state (``Trainer.state_dict``: step and tokens seen)."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


def build(folder: str, steps: int, torchtitan_dcp: bool = False, **ckpt: Any) -> dict[str, Any]:
    """The trainer's components and the checkpointer, built with the trainer's keyword arguments
    (``torchtitan_dcp``: torchtitan's own DCP ``CheckpointManager`` instead of unickpt's)."""
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry

    if torchtitan_dcp:
        from torchtitan.components.checkpoint import CheckpointManager
    else:
        from unickpt.integrations.torchtitan import CheckpointManager  # type: ignore[assignment]

    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    spec = model_registry("debugmodel", attn_backend="flex")
    cfg = spec.model
    for _, _, parent, attr in list(cfg.traverse(FlexAttention.Config)):
        if isinstance(parent, list):
            parent[attr] = ScaledDotProductAttention.Config()
        else:
            setattr(parent, attr, ScaledDotProductAttention.Config())
    cfg.layers = cfg.layers[:2]
    torch.manual_seed(0)
    model = cfg.build()
    model.init_states()
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizers = default_adamw(lr=8e-4).build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(
        warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0
    ).build(optimizers=optimizers, training_steps=steps)
    dataloader = ParallelAwareDataloader(
        TokenStream(rank, world), dp_rank=rank, dp_world_size=world, batch_size=GLOBAL_BATCH // world
    )
    train_state = TrainState()
    checkpointer = CheckpointManager.Config(enable=True, **ckpt).build(
        dataloader=dataloader,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=lr_schedulers,
        states={"train_state": train_state},
        sd_adapter=spec.state_dict_adapter(cfg, None) if spec.state_dict_adapter else None,
        base_folder=folder,
    )
    return {
        "model": model,
        "optimizers": optimizers,
        "lr_schedulers": lr_schedulers,
        "dataloader": dataloader,
        "train_state": train_state,
        "checkpointer": checkpointer,
    }


def train(
    folder: str,
    steps: int,
    stop_after: int | None = None,
    skip_batches: int = 0,
    load_step: int = -1,
    **ckpt: Any,
) -> dict[str, Any]:
    """torchtitan's loop: ``load(step=-1)``, then per step forward/backward,
    ``maybe_wait_for_staging``, optimizer and scheduler steps, ``save(step, last_step)``;
    ``close()`` at the end. Returns the global loss of every step run (and the parts).

    ``stop_after``: stop (as a killed job would, without a last save) after that step.
    ``skip_batches``: batches to skip after loading (a dataloader excluded from loading is
    fast-forwarded to the resumed step)."""
    parts = build(folder, steps, **ckpt)
    model, optimizers, sched, ts, ck = (
        parts["model"],
        parts["optimizers"],
        parts["lr_schedulers"],
        parts["train_state"],
        parts["checkpointer"],
    )
    loaded = ck.load(step=load_step)
    it = iter(parts["dataloader"])
    for _ in range(skip_batches):
        next(it)
    losses: dict[int, float] = {}
    pos = torch.arange(SEQ).unsqueeze(0)
    while ts.step < steps:
        ts.step += 1
        inputs, labels = next(it)
        tokens = inputs["input"]
        ts.ntokens_seen += labels.numel()
        out = model(tokens, pos.expand(tokens.shape[0], SEQ))
        # sum of token losses / global tokens: the gradient FSDP averages is the global mean's
        loss = torch.nn.functional.cross_entropy(
            out.flatten(0, 1).float(), labels.flatten(), reduction="sum"
        ) / (GLOBAL_BATCH * SEQ / (dist.get_world_size() if dist.is_initialized() else 1))
        loss.backward()
        ck.maybe_wait_for_staging()
        optimizers.step()
        sched.step()
        optimizers.zero_grad()
        g = loss.detach() / (dist.get_world_size() if dist.is_initialized() else 1)
        if dist.is_initialized():
            dist.all_reduce(g)
        losses[ts.step] = float(g)
        if stop_after is not None and ts.step == stop_after:
            ck.save(ts.step, last_step=False)
            break
        ck.save(ts.step, last_step=ts.step == steps)
    ck.close()
    return {"loaded": loaded, "losses": losses, "parts": parts, "ntokens_seen": ts.ntokens_seen}


def train_remote(folder: str, steps: int, kw: dict[str, Any]) -> dict[str, Any]:
    """``train`` for a world's ranks (keyword arguments as a dict): the plain values only."""
    out = train(folder, steps, **kw)
    return {
        "loaded": out["loaded"],
        "losses": out["losses"],
        "ntokens_seen": out["ntokens_seen"],
        "step": out["parts"]["train_state"].step,
    }
