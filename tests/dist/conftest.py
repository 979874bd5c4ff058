"""Shared pieces for tests/dist: the tiny models, data, and layouts the worker ranks build.

The worker functions in the test modules import this file as ``conftest`` inside ranks
started by ``harness`` (``tests/dist`` is on their path); the only fixture, ``world_pool``,
is for the parent process. Everything else is deterministic given a seed.

The model (``Net``, about 20 KB) has what resharding must survive: odd sizes (vocab 33:
the tied embedding and an extra output projection split unevenly over 2 and 4 ranks under
FSDP2 and TP), an embedding tied to the output
head, biases, a BatchNorm (running-stat buffers), a bf16 parameter, LayerNorms and two
small transformer blocks whose attention and MLP can be tensor-parallel.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn


@pytest.fixture(scope="session")
def world_pool() -> Iterator[Any]:
    """Persistent worlds of each size, shared by every test module of tests/dist."""
    from harness import WorldPool

    pool = WorldPool()
    try:
        yield pool
    finally:
        pool.close()


VOCAB = 33
DIM = 16
HEADS = 4
FF = 36
SEQ = 6
GLOBAL_BATCH = 8


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds only its own heads.
        q, k, v = (m(x).view(b, t, -1, self.head_dim).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, ff: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, ff)
        self.down = nn.Linear(ff, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class Bf16Scale(nn.Module):
    """A per-channel scale stored in bfloat16 (a parameter whose dtype differs from the rest)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, dim).to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight.to(x.dtype)


class Net(nn.Module):
    def __init__(self, n_blocks: int = 2, vocab: int = VOCAB) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, DIM)
        self.blocks = nn.ModuleList([Block(DIM, HEADS, FF) for _ in range(n_blocks)])
        self.bn = nn.BatchNorm1d(DIM)
        self.scale = Bf16Scale(DIM)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied
        # An untied second output: its 33 rows split unevenly under tensor parallelism too.
        self.proj = nn.Linear(DIM, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for block in self.blocks:
            h = block(h)
        b, t, d = h.shape
        h = self.bn(h.reshape(b * t, d)).reshape(b, t, d)
        h = self.norm(self.scale(h))
        return self.head(h) + self.proj(h)


def make_model(seed: int = 0, **kwargs: Any) -> Net:
    """``Net(**kwargs)`` initialised from ``seed`` (identically on every rank)."""
    torch.manual_seed(seed)
    model = Net(**kwargs)
    # Non-trivial LayerNorm/BatchNorm affine values and buffers, so a load that skips them shows.
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 1000)
        for name, p in model.named_parameters():
            if name.endswith(("ln1.weight", "ln2.weight", "norm.weight", "bn.weight")):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
        model.bn.running_mean.copy_(0.1 * torch.randn(DIM, generator=g))
        model.bn.running_var.copy_(1.0 + 0.1 * torch.rand(DIM, generator=g))
    return model


def make_optimizer(model: nn.Module, kind: str = "adamw") -> torch.optim.Optimizer:
    """Two param groups with their own lr and weight decay (matrices vs the rest)."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    rest = [p for n, p in model.named_parameters() if p.ndim < 2]
    groups: list[dict[str, Any]] = [
        {"params": decay, "lr": 1e-2, "weight_decay": 0.1},
        {"params": rest, "lr": 5e-3, "weight_decay": 0.0},
    ]
    if kind == "adamw":
        # foreach=False: one code path for DTensor and plain parameters alike.
        # eps=1e-6: some gradients here are zero in exact arithmetic (attention key biases,
        # the bias feeding BatchNorm) and reduction-order noise must not be amplified to lr.
        return torch.optim.AdamW(groups, betas=(0.9, 0.99), eps=1e-6, foreach=False)
    if kind == "sgd":
        return torch.optim.SGD(groups, momentum=0.9, foreach=False)
    raise ValueError(kind)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of step ``step``: tokens and next-token-ish targets."""
    g = torch.Generator().manual_seed(10_000 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    targets = (tokens * 7 + 3) % VOCAB
    return tokens, targets


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def tp_plan() -> dict[str, Any]:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "blocks.*.attn.q": ColwiseParallel(),
        "blocks.*.attn.k": ColwiseParallel(),
        "blocks.*.attn.v": ColwiseParallel(),
        "blocks.*.attn.o": RowwiseParallel(),
        "blocks.*.up": ColwiseParallel(),
        "blocks.*.down": RowwiseParallel(),
        "proj": ColwiseParallel(output_layouts=Replicate()),
    }


LAYOUTS: dict[str, tuple[str, int]] = {
    # name -> (plugin, world size)
    "single": ("none", 1),
    "ddp2": ("ddp", 2),
    "ddp4": ("ddp", 4),
    "fsdp2x2": ("fsdp2", 2),
    "fsdp2x4": ("fsdp2", 4),
    "tp2": ("tp", 2),
    "tp4": ("tp", 4),
}


def make_plugin(kind: str) -> Any:
    from unickpt.plugins import DDPPlugin, FSDP2Plugin, TPPlugin

    if kind == "none":
        return None
    if kind == "ddp":
        return DDPPlugin()
    if kind == "fsdp2":
        return FSDP2Plugin()
    if kind == "tp":
        return TPPlugin(tp_plan())
    raise ValueError(kind)


def local_batch(
    plugin: Any, tokens: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of a global batch: contiguous rows per data-parallel rank."""
    if plugin is None or plugin.dp_size == 1:
        return tokens, targets
    n = tokens.shape[0] // plugin.dp_size
    r = plugin.dp_rank
    return tokens[r * n : (r + 1) * n], targets[r * n : (r + 1) * n]


def reference_step(model: nn.Module, optim: torch.optim.Optimizer, step: int, dp_size: int) -> float:
    """One single-process step equal to a data-parallel step over ``dp_size`` ranks.

    Each rank's rows go through the model on their own (BatchNorm normalises per rank),
    and the loss is the mean of the rank losses, as DDP/FSDP average gradients.
    """
    tokens, targets = batch(step)
    n = tokens.shape[0] // dp_size
    losses = [
        loss_fn(model(tokens[i * n : (i + 1) * n]), targets[i * n : (i + 1) * n]) for i in range(dp_size)
    ]
    loss = torch.stack(losses).mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return float(loss.detach())


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The global value of a (DTensor or plain) tensor, detached, on CPU (collective for DTensors)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().cpu().clone()


def unwrap(model: nn.Module) -> nn.Module:
    inner = model
    while hasattr(inner, "unwrap") or hasattr(inner, "module"):
        inner = inner.unwrap() if hasattr(inner, "unwrap") else inner.module  # type: ignore[operator]
    return inner


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of the user's model as full tensors (collective)."""
    inner = unwrap(model)
    return {k: full_tensor(v) for k, v in inner.state_dict().items()}


def full_optim_state(model: nn.Module, optim: Any) -> dict[str, Any]:
    """Optimizer state keyed by parameter FQN with full tensors, plus param_groups (collective)."""
    inner = unwrap(model)
    torch_optim = getattr(optim, "optim", optim)
    fqn_of = {id(p): n for n, p in inner.named_parameters()}
    state: dict[str, dict[str, torch.Tensor]] = {}
    for p, s in torch_optim.state.items():
        state[fqn_of[id(p)]] = {k: full_tensor(v) if torch.is_tensor(v) else v for k, v in s.items()}
    groups = []
    for g in torch_optim.param_groups:
        hyper = {k: v for k, v in g.items() if k != "params"}
        hyper["params"] = [fqn_of[id(p)] for p in g["params"]]
        groups.append(hyper)
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor (so -0.0 vs 0.0 and NaN payloads count as differences)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same_tensors(a: dict[str, Any], b: dict[str, Any], where: str = "") -> None:
    """Bit-exact equality of nested dicts of tensors (dtype, shape and every bit)."""
    assert a.keys() == b.keys(), f"{where}: keys differ: {sorted(set(a) ^ set(b))}"
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, dict):
            assert_same_tensors(x, y, f"{where}.{k}")
        elif torch.is_tensor(x):
            assert torch.is_tensor(y), f"{where}.{k}: tensor vs {type(y)}"
            assert x.dtype == y.dtype and x.shape == y.shape, (
                f"{where}.{k}: {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}"
            )
            assert torch.equal(_bits(x), _bits(y)), (
                f"{where}.{k}: values differ (max abs diff "
                f"{(x.double() - y.double()).abs().max().item() if x.numel() else 0})"
            )
        else:
            assert x == y, f"{where}.{k}: {x!r} != {y!r}"


def local_expected(live: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """The part of the global tensor ``full`` this rank should hold in ``live`` (no communication)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(live, DTensor):
        return full
    # src_data_rank=None: every rank chunks its own copy, so no collective is needed.
    return distribute_tensor(full, live.device_mesh, live.placements, src_data_rank=None).to_local()


def assert_local_state_matches(live: dict[str, Any], full: dict[str, Any], where: str = "") -> None:
    """Bit-exact check of what this rank holds against a full reference, without collectives.

    Every rank checks its own blocks (DTensor shards, or whole replicated tensors); together
    the ranks cover every element. Global shapes and dtypes are checked too.
    """
    assert live.keys() == full.keys(), f"{where}: keys differ: {sorted(set(live) ^ set(full))}"
    for k, v in live.items():
        ref = full[k]
        if isinstance(v, dict):
            assert_local_state_matches(v, ref, f"{where}.{k}")
        elif torch.is_tensor(v):
            assert v.dtype == ref.dtype and v.shape == ref.shape, (
                f"{where}.{k}: {v.dtype}{tuple(v.shape)} vs {ref.dtype}{tuple(ref.shape)}"
            )
            mine = v.to_local() if hasattr(v, "to_local") else v
            expected = local_expected(v, ref)
            assert mine.shape == expected.shape, (
                f"{where}.{k}: local {tuple(mine.shape)} vs {tuple(expected.shape)}"
            )
            assert torch.equal(_bits(mine), _bits(expected)), (
                f"{where}.{k}: values differ on this rank's block"
            )
        else:
            assert v == ref, f"{where}.{k}: {v!r} != {ref!r}"


def live_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in unwrap(model).state_dict().items()}


def live_optim_state(model: nn.Module, optim: Any) -> dict[str, Any]:
    """Like :func:`full_optim_state` but with the tensors as held (DTensors stay DTensors)."""
    inner = unwrap(model)
    torch_optim = getattr(optim, "optim", optim)
    fqn_of = {id(p): n for n, p in inner.named_parameters()}
    state = {fqn_of[id(p)]: dict(s) for p, s in torch_optim.state.items()}
    groups = []
    for g in torch_optim.param_groups:
        hyper = {k: v for k, v in g.items() if k != "params"}
        hyper["params"] = [fqn_of[id(p)] for p in g["params"]]
        groups.append(hyper)
    return {"state": dict(sorted(state.items())), "param_groups": groups}
