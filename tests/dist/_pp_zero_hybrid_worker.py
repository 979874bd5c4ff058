"""Worker side of test_pp_zero_hybrid: layouts PP, ZeRO-1/2 and hybrid, saved and loaded across each other.

Every layout trains the same ``PipeNet`` (odd sizes, tied embedding/head across pipeline stages,
a bf16 parameter, a buffer) two steps on the same global batches, then saves its model and
optimizer (sliced, ``gather_dtensor=False``, and gathered) together with the full expected state
(``expected.safetensors``, written by rank 0 from full tensors). A load case builds a fresh model
of a layout, loads a checkpoint of another, and compares every full tensor bit for bit.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, FF, SEQ, BATCH = 33, 16, 34, 5, 8  # FF 34: 17 (odd) rows per TP rank


class Block(nn.Module):
    def __init__(self, ff: int = FF) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, ff)
        self.down = nn.Linear(ff, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.ln(x))))


class Bf16Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, DIM).to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight.to(x.dtype)


class PipeNet(nn.Module):
    """A model whose forward skips pruned (None) modules, as PPPlugin requires."""

    def __init__(self, ff: int = FF) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(ff) for _ in range(3)])
        self.norm = nn.LayerNorm(DIM)
        self.scale = Bf16Scale()  # a bf16 parameter
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.norm.register_buffer("shift", torch.linspace(-0.1, 0.1, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) if self.emb is not None else x
        for b in self.blocks:
            if b is not None:
                h = b(h)
        if self.norm is not None:
            h = self.norm(h) + self.norm.shift
        if self.scale is not None:
            h = self.scale(h)
        return self.head(h) if self.head is not None else h


SPLIT = ["blocks.2"]  # stage 0: emb, blocks 0-1; stage 1: blocks.2, norm, scale, head


def make_model(seed: int = 0) -> PipeNet:
    torch.manual_seed(seed)
    return PipeNet()


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [
            {"params": decay, "lr": 1e-2, "weight_decay": 0.1},
            {"params": rest, "lr": 5e-3, "weight_decay": 0.0},
        ],
        foreach=False,
    )


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return x, (x * 5 + 1) % VOCAB


def tp_plan() -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"blocks.*.up": ColwiseParallel(), "blocks.*.down": RowwiseParallel()}


# layout name -> world size
LAYOUTS = {
    "single": 1,
    "fsdp2x2": 2,
    "pp2": 2,
    "zero2x2": 2,
    "zero1x4": 4,
    "fsdp2x4": 4,
    "hyb_fsdp_dp2tp2": 4,
    "hyb_ddp_dp2tp2": 4,
    "hyb_pp2tp2": 4,
    "hyb_3d": 8,
}


def make_plugin(layout: str) -> Any:
    from unickpt.plugins import FSDP2Plugin
    from unickpt.plugins.hybrid import HybridParallelPlugin
    from unickpt.plugins.pp import PPPlugin
    from unickpt.plugins.zero import ZeroPlugin

    if layout == "single":
        return None
    if layout.startswith("fsdp2"):
        return FSDP2Plugin()
    if layout == "pp2":
        return PPPlugin(2, SPLIT, num_microbatches=2)
    if layout == "zero2x2":
        return ZeroPlugin(stage=2)
    if layout == "zero1x4":
        return ZeroPlugin(stage=1)
    if layout == "hyb_fsdp_dp2tp2":
        return HybridParallelPlugin(tp_size=2, dp="fsdp2", tp_plan=tp_plan())
    if layout == "hyb_ddp_dp2tp2":
        return HybridParallelPlugin(tp_size=2, dp="ddp", tp_plan=tp_plan())
    if layout == "hyb_pp2tp2":
        return HybridParallelPlugin(tp_size=2, pp_size=2, tp_plan=tp_plan(), split_points=SPLIT)
    if layout == "hyb_3d":
        return HybridParallelPlugin(tp_size=2, pp_size=2, dp="fsdp2", tp_plan=tp_plan(), split_points=SPLIT)
    raise ValueError(layout)


class Setup:
    """A layout's boosted objects on this rank (``active`` is False on ranks outside the layout)."""

    def __init__(self, layout: str, seed: int = 0) -> None:
        from unickpt.booster import Booster

        self.layout = layout
        self.plugin = make_plugin(layout)
        self.booster = Booster(self.plugin)
        model = make_model(seed)
        optim = make_optimizer(model)
        self.model, self.optim, *_ = self.booster.boost(model, optim, criterion=loss_fn)

    @property
    def dp(self) -> tuple[int, int]:
        p = self.plugin
        return (1, 0) if p is None else (p.dp_size, p.dp_rank)

    def train_step(self, step: int) -> float | None:
        x, y = batch(step)
        dp_size, dp_rank = self.dp
        n = BATCH // dp_size
        x, y = x[dp_rank * n : (dp_rank + 1) * n], y[dp_rank * n : (dp_rank + 1) * n]
        if getattr(self.plugin, "runtime", None) is not None:
            loss = self.booster.execute_pipeline(iter([(x, y)]), self.model, loss_fn, self.optim)
        else:
            loss = loss_fn(self.model(x), y)
            self.booster.backward(loss, self.optim)
        self.optim.step()
        self.optim.zero_grad()
        return None if loss is None else float(loss.detach())

    def expected(self) -> dict[str, torch.Tensor]:
        """Full model and optimizer tensors as ``model/<fqn>`` and ``optim/<fqn>/<key>`` (collective)."""
        return full_state(self)


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().cpu().clone()


def _zero_full_state(part: Any) -> dict[str, dict[str, Any]]:
    """Every parameter's optimizer state of a ZeRO partition as full tensors (collective over its group)."""
    part.init_state()
    out: dict[str, dict[str, Any]] = {}
    for b in part.buckets:
        st = part.optim.state[b.shard]
        for k in sorted(st):
            v = st[k]
            if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == b.chunk:
                flat = v
                if part.size > 1:
                    flat = torch.empty(b.chunk * part.size, dtype=v.dtype, device=v.device)
                    dist.all_gather_into_tensor(flat, v.contiguous(), group=part.group)
                for p, fqn, off in zip(b.params, b.fqns, b.offsets, strict=True):
                    out.setdefault(fqn, {})[k] = flat[off : off + p.numel()].view(p.shape).clone()
            else:
                for fqn in b.fqns:
                    out.setdefault(fqn, {})[k] = v.clone() if isinstance(v, torch.Tensor) else v
    return out


def full_state(s: Setup) -> dict[str, torch.Tensor]:
    """Every full tensor of model and optimizer, merged over pipeline stages (collective)."""
    from unickpt.plugins.zero import ZeroPlugin

    inner = s.model.unwrap()
    out: dict[str, torch.Tensor] = {}
    for k, v in inner.state_dict().items():
        out[f"model/{k}"] = _full(v)
    canonical: dict[str, str] = getattr(s.plugin, "canonical", {}) or {}
    if isinstance(s.plugin, ZeroPlugin) or getattr(s.plugin, "partition", None) is not None:
        for fqn, st in _zero_full_state(s.plugin.partition).items():
            for k, v in st.items():
                out[f"optim/{fqn}/{k}"] = _full(v)
    else:
        fqn_of = {id(p): canonical.get(n, n) for n, p in inner.named_parameters()}
        for p, st in s.optim.optim.state.items():
            for k, v in st.items():
                out[f"optim/{fqn_of[id(p)]}/{k}"] = _full(v)
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, out)
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            for k, v in part.items():
                merged.setdefault(k, v)
        out = merged
    # The head shares the embedding: a single-process state_dict lists both names.
    if "model/emb.weight" in out:
        out["model/head.weight"] = out["model/emb.weight"].clone()
    return dict(sorted(out.items()))


def assert_bits(exp: dict[str, torch.Tensor], got: dict[str, torch.Tensor], where: str) -> None:
    missing = sorted(set(exp) ^ set(got))
    assert not missing, f"{where}: names differ: {missing}"
    for k, a in exp.items():
        b = got[k]
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{where} {k}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        )
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), (
            f"{where} {k}: values differ"
        )


def save_case(layout: str, root: str) -> list[float]:
    from safetensors.torch import save_file

    s = Setup(layout)
    losses = [_gather_loss(s, s.train_step(i)) for i in range(STEPS_BEFORE)]
    d = os.path.join(root, layout)
    s.booster.save_model(s.model, os.path.join(d, "model"), shard=True, gather_dtensor=False)
    s.booster.save_optimizer(s.optim, os.path.join(d, "optim"), shard=True, gather_dtensor=False)
    s.booster.save_model(s.model, os.path.join(d, "model_g"), shard=True, gather_dtensor=True)
    s.booster.save_optimizer(s.optim, os.path.join(d, "optim_g"), shard=True, gather_dtensor=True)
    exp = s.expected()
    if not dist.is_initialized() or dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in exp.items()}, os.path.join(d, "expected.safetensors"))
        with open(os.path.join(d, "losses.json"), "w") as f:
            json.dump(losses, f)
    if dist.is_initialized():
        dist.barrier()
    return losses


def load_case(layout: str, src: str, root: str, gathered: bool) -> None:
    from safetensors.torch import load_file

    s = Setup(layout, seed=7)
    d = os.path.join(root, src)
    sfx = "_g" if gathered else ""
    s.booster.load_model(s.model, os.path.join(d, "model" + sfx))
    s.booster.load_optimizer(s.optim, os.path.join(d, "optim" + sfx))
    got = s.expected()
    exp = load_file(os.path.join(d, "expected.safetensors"))
    assert_bits(exp, got, f"{src}{sfx} -> {layout}")


STEPS_BEFORE, STEPS_AFTER = 2, 2  # continuity: steps trained before the save, and after the load
LOSS_RTOL = 1e-4  # layouts reduce gradients in other orders: fp32 rounding only
_REFERENCE: list[float] = []


def _gather_loss(s: Setup, loss: float | None) -> float:
    """The global batch's loss: the mean over dp replicas of their loss (collective).

    Within a replica the loss is on the last pipeline stage (every rank without pipeline).
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        assert loss is not None
        return loss
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (s.dp, loss))
    per_replica: dict[int, float] = {}
    dp_size = s.dp[0]
    for (_, dp_rank), x in parts:
        if x is not None:
            per_replica.setdefault(dp_rank, float(x))
    assert sorted(per_replica) == list(range(dp_size)), f"losses of replicas {sorted(per_replica)} only"
    return sum(per_replica.values()) / dp_size


def reference_losses() -> list[float]:
    """Losses of an uninterrupted single-process run (each rank computes it locally, once)."""
    if not _REFERENCE:
        s = Setup("single")
        _REFERENCE.extend(float(s.train_step(i) or 0.0) for i in range(STEPS_BEFORE + STEPS_AFTER))
    return list(_REFERENCE)


def _assert_close(got: list[float], want: list[float], where: str) -> None:
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert abs(a - b) <= LOSS_RTOL * abs(b), f"{where}: step {i} loss {a!r}, uninterrupted run {b!r}"


def continuity_case(src: str, dst: str, root: str) -> list[float]:
    """``src`` trained ``STEPS_BEFORE`` steps and saved (``save_case``); ``dst`` loads it and trains on.

    Every loss (``src``'s before the save, ``dst``'s after the load) must match an uninterrupted
    single-process run of the same batches.
    """
    ref = reference_losses()
    d = os.path.join(root, src)
    with open(os.path.join(d, "losses.json")) as f:
        before = [float(x) for x in json.load(f)]
    _assert_close(before, ref[:STEPS_BEFORE], f"{src} before the save")
    s = Setup(dst, seed=3)
    s.booster.load_model(s.model, os.path.join(d, "model"))
    s.booster.load_optimizer(s.optim, os.path.join(d, "optim"))
    after = [_gather_loss(s, s.train_step(i)) for i in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER)]
    _assert_close(after, ref[STEPS_BEFORE:], f"{src} -> {dst} after the load")
    return before + after


def uneven_tp_case() -> None:
    """TP over a width not divisible by tp_size is refused when the plugin configures the model."""
    from unickpt.booster import Booster
    from unickpt.errors import UnsupportedError
    from unickpt.plugins.hybrid import HybridParallelPlugin

    torch.manual_seed(0)
    model = PipeNet(ff=FF - 1)  # 33 rows: 17 + 16 over two tp ranks
    plugin = HybridParallelPlugin(tp_size=dist.get_world_size(), dp="fsdp2", tp_plan=tp_plan())
    try:
        Booster(plugin).boost(model, make_optimizer(model), criterion=loss_fn)
    except UnsupportedError as e:
        assert "divisible" in str(e) and "blocks.0.up.weight" in str(e), str(e)
    else:
        raise AssertionError("HybridParallelPlugin accepted an uneven tensor-parallel split")


def merge_case(src: str, root: str) -> None:
    """``unickpt.merge_checkpoint`` of ``src``'s sliced model equals the saver's full tensors (one process)."""
    import glob
    import tempfile

    from safetensors.torch import load_file

    from unickpt import merge_checkpoint

    d = os.path.join(root, src)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        out = merge_checkpoint(os.path.join(d, "model"), os.path.join(tmp, "merged"))
        merged: dict[str, torch.Tensor] = {}
        for f in sorted(glob.glob(os.path.join(out, "*.safetensors"))):
            merged.update(load_file(f))
    exp = {
        k: v for k, v in load_file(os.path.join(d, "expected.safetensors")).items() if k.startswith("model/")
    }
    got = {f"model/{k}": v for k, v in merged.items()}
    if "model/head.weight" not in got:  # stored once with the embedding (tied), as Hugging Face does
        got["model/head.weight"] = got["model/emb.weight"]
    assert_bits(exp, got, f"merge {src}")


def world_worker(
    root: str,
    saves: list[str],
    loads: list[tuple[str, ...]],
    conts: list[tuple[str, str]],
    checks: list[str] | None = None,
) -> Any:
    """Run in one world: the saves, the loads, the continuity runs, then the named checks.

    A load is ``(dst layout, src layout)`` (sliced and gathered checkpoints) or ``(dst, src,
    modes)`` with ``modes`` among ``"s"`` (sliced) and ``"g"`` (gathered).
    """
    from harness import run_cases

    cases: list[tuple[str, Any]] = []
    for layout in saves:
        cases.append((f"save {layout}", lambda layout=layout: save_case(layout, root)))
    for dst, src, *rest in loads:
        modes = rest[0] if rest else "sg"
        for g in [m == "g" for m in modes]:
            cases.append(
                (
                    f"load {src}{'_g' if g else ''} -> {dst}",
                    lambda d=dst, s=src, g=g: load_case(d, s, root, g),
                )
            )
    for src, dst in conts:
        cases.append((f"continue {src} -> {dst}", lambda s=src, d=dst: continuity_case(s, d, root)))
    for check in checks or []:
        if check.startswith("merge:"):
            cases.append((check, lambda src=check[6:]: merge_case(src, root)))
        elif check == "uneven_tp":
            cases.append((check, uneven_tp_case))
        else:
            raise ValueError(check)
    return run_cases(cases)
