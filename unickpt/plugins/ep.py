"""ExpertParallelPlugin: stacked MoE experts sharded over an ``ep`` mesh dimension, FSDP2 for the rest.

The world is a two-dimensional mesh ``(efsdp, ep)`` (``ep`` innermost, so an expert group is
``ep_size`` neighbouring ranks), laid out as torchtitan's expert parallelism does:

- every stacked-experts module (parameters ``[num_experts, ...]``, e.g. transformers 5's
  ``MixtralExperts`` with ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``) has each
  parameter distributed as a ``Shard(0)`` DTensor over ``mesh["ep"]``: rank ``r`` of an expert
  group holds experts ``r*E/ep .. (r+1)*E/ep - 1``. The module then gets its own ``fully_shard``
  over ``mesh["efsdp"]`` (``Shard(0)`` of the local experts, ``Shard(1)`` when
  ``efsdp * ep > E`` so that no rank holds an empty shard), with the gradient divide factor set to
  the world size (its gradients are sums over the expert group's tokens);
- every other parameter is sharded by ``fully_shard`` over all ranks (a one-dimensional ``dp``
  mesh), on the units :func:`unickpt.plugins.fsdp2.default_shard_units` picks, then the root.

Each rank consumes its own batches (``dp_size`` is the world size). The experts' forward
exchanges tokens within the expert group: each (token, top-k slot) row is sent with
``all_to_all_single`` to the rank holding its expert, that rank runs the module's own forward
on its local experts (the parameters' local shards, local expert ids, unit weights), and the
results come back with a second ``all_to_all_single`` and are weighted and summed per token.
Both exchanges are autograd-aware, so gradients reach the inputs and the local experts.

Checkpoints are generic: the CheckpointIO base saves and reshards the DTensors (the experts'
placements over ``(efsdp, ep)`` included), so a checkpoint saved at one ``ep_size`` loads at
another, under another plugin or into a plain model, and ``unickpt merge`` writes the full
stacked tensors. Tensors keep the model's own (fused) names.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.nn.functional import all_to_all_single as _a2a
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from unickpt._logging import get_logger
from unickpt.errors import UnsupportedError
from unickpt.io import CheckpointIO
from unickpt.plugins._shared import mesh as _mesh
from unickpt.plugins._shared.fsdp_units import default_shard_units, group_dtypes, modules_named
from unickpt.plugins.base import Plugin, check_optimizer, parameter_fqns, remap_optimizer_params
from unickpt.wrappers import ModelWrapper

__all__ = ["ExpertParallelCheckpointIO", "ExpertParallelPlugin", "find_expert_modules"]

ExpertSpec = Iterable[str | type[nn.Module]]
logger = get_logger(__name__)


class ExpertParallelCheckpointIO(CheckpointIO):
    """CheckpointIO for models set up by :class:`ExpertParallelPlugin` (the base class does all the work)."""

    plugin_name = "ep"


def _num_experts(mod: nn.Module) -> int | None:
    n = getattr(mod, "num_experts", None)
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def _expert_count(mod: nn.Module, fqn: str) -> int:
    """``num_experts`` of a module ``find_expert_modules`` chose (it has one by construction)."""
    n = _num_experts(mod)
    if n is None:
        raise UnsupportedError(f"experts module {fqn!r} has no positive integer num_experts")
    return n


def _stacked_problem(fqn: str, mod: nn.Module) -> str | None:
    """Why ``mod`` is not a stacked-experts module the plugin can shard, or ``None`` if it is."""
    n = _num_experts(mod)
    if n is None:
        return f"{fqn!r} ({type(mod).__name__}) has no positive integer attribute num_experts"
    if any(True for c in mod.children() if next(c.parameters(), None) is not None):
        return f"{fqn!r} ({type(mod).__name__}) has child modules with parameters"
    params = list(mod.named_parameters(recurse=False))
    if not params:
        return f"{fqn!r} ({type(mod).__name__}) has no parameters"
    wrong = [f"{name} {tuple(p.shape)}" for name, p in params if p.dim() < 2 or p.shape[0] != n]
    if wrong:
        return (
            f"{fqn!r} ({type(mod).__name__}): parameters {wrong} are not stacked over its "
            f"num_experts={n} experts (leading dimension {n} expected)"
        )
    try:
        arity = len(inspect.signature(mod.forward).parameters)
    except (TypeError, ValueError):
        arity = 3
    if arity < 3:
        return (
            f"{fqn!r} ({type(mod).__name__}): forward takes {arity} arguments; a stacked-experts "
            "module's forward is (hidden_states, top_k_index, top_k_weights)"
        )
    return None


def find_expert_modules(root: nn.Module, experts: ExpertSpec | None = None) -> list[str]:
    """FQNs of the stacked-experts modules of ``root`` that expert parallelism shards.

    A stacked-experts module has an integer attribute ``num_experts``, parameters of its own
    (no child module holds any) whose leading dimension is ``num_experts`` and at least one of
    them of three or more dimensions (a router's ``[E, H]`` weight alone is not one), and a
    ``forward(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]`` that
    sums ``top_k_weights[t, k] * expert_{top_k_index[t, k]}(hidden_states[t])`` over ``k``, as
    transformers 5's fused experts (``MixtralExperts``, Qwen MoE experts) do.

    ``experts=None`` finds every such module; otherwise FQNs and/or classes name them, and a
    named module that does not fit raises ``UnsupportedError`` saying why.
    """
    if experts is None:
        found = []
        for fqn, mod in root.named_modules():
            if not fqn or _stacked_problem(fqn, mod) is not None:
                continue
            if any(p.dim() >= 3 for p in mod.parameters(recurse=False)):
                found.append(fqn)
        return found
    chosen = modules_named(root, experts, "ExpertParallelPlugin(experts=...)")
    for fqn in chosen:
        problem = _stacked_problem(fqn, root.get_submodule(fqn))
        if problem is not None:
            raise UnsupportedError(f"ExpertParallelPlugin cannot shard experts of {problem}")
    return chosen


def _dispatch_forward(
    mod: nn.Module,
    original: Callable[..., torch.Tensor],
    names: list[str],
    num_experts: int,
    group: dist.ProcessGroup,
    ep_size: int,
) -> Callable[..., torch.Tensor]:
    """The forward installed on a stacked-experts module: exchange tokens, run the local experts."""
    local_n = num_experts // ep_size

    def forward(
        hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        width = hidden_states.shape[-1]
        top_k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1).to(torch.int64)
        order = torch.argsort(flat, stable=True)
        # An id outside 0..E-1 (transformers' models use E for "no expert") selects nothing,
        # as in the modules' own forward.
        order = order[(flat[order] >= 0) & (flat[order] < num_experts)]
        token_of = order // top_k
        send = hidden_states[token_of]
        counts = torch.bincount(flat[order], minlength=num_experts)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=group)
        send_splits = counts.view(ep_size, local_n).sum(1).tolist()
        recv_splits = recv_counts.view(ep_size, local_n).sum(1).tolist()
        rows = int(sum(recv_splits))
        received = _a2a(hidden_states.new_empty((rows, width)), send, recv_splits, send_splits, group=group)
        local_ids = torch.repeat_interleave(
            torch.arange(local_n, device=flat.device).repeat(ep_size), recv_counts.to(flat.device)
        )
        # Every token of the expert group reaches these experts, so their gradients are sums
        # over ep_size ranks' losses: scaled by 1/ep_size here, averaged over efsdp by FSDP, they
        # are the world's mean, as the other parameters' are. (torchtitan sets FSDP's gradient
        # divide factor instead; gloo has no PREMUL_SUM, and torch 2.13 divides twice on a
        # one-rank efsdp mesh.)
        locals_ = {n: _ScaleGrad.apply(_local(getattr(mod, n)), 1.0 / ep_size) for n in names}
        ones = torch.ones((rows, 1), dtype=top_k_weights.dtype, device=top_k_weights.device)
        computed = _with_parameters(mod, locals_, local_n, original, received, local_ids[:, None], ones)
        if rows == 0:
            # No token reached this rank's experts. Keep them and the received rows in the graph
            # (zero gradients): every rank must take part in the backward all-to-all of the
            # dispatch and in FSDP's reduction of the experts' gradients, or its peers wait forever.
            zero = received.sum() + sum(t.reshape(-1)[:1].sum() for t in locals_.values())
            computed = computed + zero * 0
        back = _a2a(
            computed.new_empty((order.numel(), width)),
            computed.contiguous(),
            send_splits,
            recv_splits,
            group=group,
        )
        weights = top_k_weights.reshape(-1)[order].unsqueeze(-1)
        out = torch.zeros_like(hidden_states)
        return out.index_add(0, token_of, (back * weights).to(out.dtype))

    return forward


class _ScaleGrad(torch.autograd.Function):
    """The identity, whose backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad * ctx.scale, None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _with_parameters(
    mod: nn.Module,
    local: dict[str, torch.Tensor],
    local_n: int,
    original: Callable[..., torch.Tensor],
    *args: torch.Tensor,
) -> torch.Tensor:
    """``original(*args)`` with ``mod``'s parameters replaced by ``local`` and ``num_experts`` by ``local_n``.

    The module's own forward then computes its local experts as it computes all of them
    unsharded; the parameters (FSDP's unsharded DTensors) are put back before it returns.
    """
    saved = {n: mod._parameters[n] for n in local}
    saved_n = mod.num_experts
    try:
        for n, t in local.items():
            mod._parameters[n] = t  # type: ignore[assignment]
        setattr(mod, "num_experts", local_n)  # noqa: B010 (typed as a tensor or module)
        return original(*args)
    finally:
        setattr(mod, "num_experts", saved_n)  # noqa: B010
        for n, p in saved.items():
            mod._parameters[n] = p


class ExpertParallelPlugin(Plugin):
    """Expert parallelism over ``ep_size`` ranks, combined with FSDP2 for everything else.

    Args:
        ep_size: ranks per expert group (the ``ep`` mesh dimension). It must divide the world
            size and every experts module's ``num_experts``. ``1``: no expert parallelism (plain
            FSDP2 over all ranks, the experts sharded with the rest).
        experts: FQNs and/or module classes of the stacked-experts modules; ``None`` finds them
            (see :func:`find_expert_modules`).
        reshard_after_forward, mp_policy: passed to every ``fully_shard`` call.
    """

    name = "ep"
    checkpoint_io_class = ExpertParallelCheckpointIO

    def __init__(
        self,
        ep_size: int,
        experts: ExpertSpec | None = None,
        reshard_after_forward: bool = True,
        mp_policy: MixedPrecisionPolicy | None = None,
    ) -> None:
        super().__init__()
        if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
            raise UnsupportedError(f"ExpertParallelPlugin(ep_size={ep_size!r}): a positive integer expected")
        self.ep_size = ep_size
        self.experts = None if experts is None else list(experts)
        self.reshard_after_forward = reshard_after_forward
        self.mp_policy = mp_policy
        self.expert_modules: list[str] = []
        self.units: list[str] = []
        self.dp_mesh: DeviceMesh | None = None

    def _parallelize(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> nn.Module:
        """Shard the experts over ``ep`` and FSDP over ``efsdp``, the rest FSDP over all ranks."""
        if isinstance(model, FSDPModule):
            raise UnsupportedError("the model is already sharded with fully_shard; pass the plain model")
        world = self.world_size
        if world % self.ep_size:
            raise UnsupportedError(
                f"ExpertParallelPlugin(ep_size={self.ep_size}): the world size {world} is not a multiple of it"
            )
        check_optimizer(optimizer, model)
        expert_fqns = find_expert_modules(model, self.experts)
        if self.experts is not None and not expert_fqns:
            raise UnsupportedError(
                f"ExpertParallelPlugin(experts={self.experts!r}) matches no module of the model"
            )
        if not expert_fqns and self.ep_size > 1:
            raise UnsupportedError(
                "ExpertParallelPlugin found no stacked-experts module in the model (a module with an "
                "integer num_experts and parameters [num_experts, ...]); name them with experts=..."
            )
        for fqn in expert_fqns:
            n = _expert_count(model.get_submodule(fqn), fqn)
            if n % self.ep_size:
                raise UnsupportedError(
                    f"experts module {fqn!r} has num_experts={n}, not divisible by ep_size={self.ep_size}"
                )
        sharded_experts = expert_fqns if self.ep_size > 1 else []
        units = [u for u in default_shard_units(model) if u not in sharded_experts]
        # Checked before anything is changed, so that a refusal leaves the model as it was.
        for unit in [*sharded_experts, *units, ""]:
            groups = group_dtypes(model, unit, [*units, *sharded_experts])
            if len(groups) > 1:
                detail = "; ".join(f"{dt}: {fqns[:3]}" for dt, fqns in groups.items())
                raise UnsupportedError(
                    f"fully_shard({unit or '<root>'!r}) would manage trainable parameters of several "
                    f"dtypes ({detail}); FSDP2 needs one dtype per group"
                )
        efsdp = world // self.ep_size
        self._mesh = _mesh.build_mesh((efsdp, self.ep_size), ("efsdp", "ep"))
        self.dp_mesh = _mesh.build_mesh((world,), ("dp",))
        model = model.to(self.device)
        old_fqns = parameter_fqns(model)
        kwargs: dict[str, Any] = {"reshard_after_forward": self.reshard_after_forward}
        if self.mp_policy is not None:
            kwargs["mp_policy"] = self.mp_policy
        for fqn in sharded_experts:
            self._shard_experts(model.get_submodule(fqn), fqn, self._mesh, kwargs)
        for unit in sorted(units, key=lambda u: u.count("."), reverse=True):
            fully_shard(model.get_submodule(unit), mesh=self.dp_mesh, **kwargs)
        fully_shard(model, mesh=self.dp_mesh, **kwargs)
        self.expert_modules = sharded_experts
        self.units = units
        logger.info(
            "expert parallelism over %d ranks (efsdp %d): experts %s; fully_shard units %s, then the root",
            self.ep_size,
            efsdp,
            self.expert_modules or "none",
            units or "none",
        )
        remap_optimizer_params(optimizer, old_fqns, model)
        return ModelWrapper(model)

    def _shard_experts(self, mod: nn.Module, fqn: str, mesh: DeviceMesh, kwargs: dict[str, Any]) -> None:
        """``Shard(0)`` over ``ep``, then ``fully_shard`` over ``efsdp``, then the dispatching forward."""
        ep_mesh, efsdp_mesh = mesh["ep"], mesh["efsdp"]
        n = _expert_count(mod, fqn)
        names = [name for name, _ in mod.named_parameters(recurse=False)]
        for name, p in list(mod.named_parameters(recurse=False)):
            # src_data_rank=None: every rank holds the same initial values (same seed), so each
            # keeps its own block without a broadcast, as parallelize_module does.
            shard = distribute_tensor(p.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
            mod.register_parameter(name, nn.Parameter(shard, requires_grad=p.requires_grad))
        placement = Shard(1) if efsdp_mesh.size() * self.ep_size > n else Shard(0)
        fully_shard(mod, mesh=efsdp_mesh, shard_placement_fn=lambda _p: placement, **kwargs)
        # An instance attribute: nn.Module.__call__ (and FSDP's hooks around it) call it in place
        # of the class's forward, which it calls on the local experts.
        mod.forward = _dispatch_forward(  # type: ignore[method-assign]
            mod, mod.forward, names, n, ep_mesh.get_group(), self.ep_size
        )

    @property
    def ep_rank(self) -> int:
        """This rank's index in its expert group."""
        return self._mesh.get_local_rank("ep") if self._mesh is not None else 0
