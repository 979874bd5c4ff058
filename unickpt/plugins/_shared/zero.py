"""The ZeRO flat-buffer partition and its CheckpointIO (shared by the ZeRO and hybrid plugins).

The public names are re-exported by ``unickpt.plugins.zero``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from unickpt.errors import UnsupportedError
from unickpt.io import CheckpointIO, HookContext

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh
from unickpt.io.tensors import LocalSlice, st_dtype
from unickpt.spec.boxes import flat_range_to_boxes


@dataclass
class _Bucket:
    """One flat buffer: the parameters of one param group that share a dtype."""

    group_index: int
    params: list[nn.Parameter]
    fqns: list[str]
    offsets: list[int]  # flat start of each parameter in the buffer
    numel: int
    chunk: int  # elements per rank (the buffer is padded to chunk * dp_size)
    lo: int  # this rank's range [lo, hi) of the (padded) buffer
    hi: int
    shard: nn.Parameter = field(repr=False)


class ZeroPartition:
    """The flat-buffer partition of one optimizer over one data-parallel process group.

    Built by every rank of the group, with identical parameters (rank 0's are broadcast).
    ``names`` maps ``id(parameter)`` to the FQN its optimizer state is saved under.
    """

    def __init__(
        self,
        optim: torch.optim.Optimizer,
        names: dict[int, str],
        group: Any,
        stage: int,
        buffers: list[torch.Tensor] | None = None,
    ) -> None:
        if stage not in (1, 2):
            raise UnsupportedError(f"ZeRO stage must be 1 or 2, got {stage}")
        if any(len(s) for s in optim.state.values()):
            raise UnsupportedError(
                "the optimizer already holds state: pass a fresh optimizer to Booster.boost and load "
                "its state afterwards with booster.load_optimizer"
            )
        self.optim = optim
        self.group = group
        self.stage = stage
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.buckets: list[_Bucket] = []
        # Replicated buffers (BatchNorm statistics) follow data-parallel rank 0 after every step,
        # as DDP's broadcast_buffers does, so every replica saves the same values.
        self.buffers = list(buffers or [])
        src = dist.get_global_rank(group, 0) if self.size > 1 else 0
        for gi, g in enumerate(optim.param_groups):
            by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
            for p in g["params"]:
                if id(p) not in names:
                    raise UnsupportedError(
                        f"optimizer param group {gi} holds a tensor (shape {tuple(p.shape)}) that is not a "
                        "parameter of the model"
                    )
                by_dtype.setdefault(p.dtype, []).append(p)
            shards: list[nn.Parameter] = []
            for dtype, params in by_dtype.items():
                offsets, total = [], 0
                for p in params:
                    if self.size > 1:
                        with torch.no_grad():
                            dist.broadcast(p.data, src=src, group=group)
                    offsets.append(total)
                    total += p.numel()
                chunk = max(1, math.ceil(total / self.size))
                lo, hi = self.rank * chunk, (self.rank + 1) * chunk
                flat = torch.zeros(chunk * self.size, dtype=dtype, device=params[0].device)
                for p, off in zip(params, offsets, strict=True):
                    flat[off : off + p.numel()] = p.detach().reshape(-1)
                shard = nn.Parameter(flat[lo:hi].clone())
                self.buckets.append(
                    _Bucket(gi, params, [names[id(p)] for p in params], offsets, total, chunk, lo, hi, shard)
                )
                shards.append(shard)
            g["params"] = shards
            g.pop("param_names", None)  # flat shards have no FQN (the buckets keep the names)
        self._hooks = [
            optim.register_step_pre_hook(lambda *_: self.reduce_gradients()),
            optim.register_step_post_hook(lambda *_: self.gather_parameters()),
        ]

    # -- training --------------------------------------------------------------------------

    def reduce_gradients(self) -> None:
        """Average the replicas' gradients into each rank's shard gradient; free the full ones.

        Collective over the group. Stage 2 calls it after every backward; stage 1 when the
        optimizer steps. Gradients accumulate across calls until ``zero_grad``.
        """
        for b in self.buckets:
            if all(p.grad is None for p in b.params):
                continue
            flat = torch.zeros(b.chunk * self.size, dtype=b.shard.dtype, device=b.shard.device)
            for p, off in zip(b.params, b.offsets, strict=True):
                if p.grad is not None:
                    flat[off : off + p.numel()] = p.grad.reshape(-1)
                p.grad = None
            if self.size > 1:
                flat.div_(self.size)
                if self.stage == 2:
                    part = torch.empty(b.chunk, dtype=flat.dtype, device=flat.device)
                    dist.reduce_scatter_tensor(part, flat, group=self.group)
                else:
                    dist.all_reduce(flat, group=self.group)
                    part = flat[b.lo : b.hi]
            else:
                part = flat[b.lo : b.hi]
            if b.shard.grad is None:
                b.shard.grad = part.clone()
            else:
                b.shard.grad.add_(part)

    @torch.no_grad()
    def gather_parameters(self) -> None:
        """All-gather the updated shards into every replica's parameters (collective over the group)."""
        for b in self.buckets:
            if self.size > 1:
                flat = torch.empty(b.chunk * self.size, dtype=b.shard.dtype, device=b.shard.device)
                dist.all_gather_into_tensor(flat, b.shard.detach().contiguous(), group=self.group)
            else:
                flat = b.shard.detach()
            for p, off in zip(b.params, b.offsets, strict=True):
                if p.requires_grad:
                    p.copy_(flat[off : off + p.numel()].view_as(p))
                    continue
                # A frozen parameter shares its bucket's step (zero gradient), and decoupled
                # weight decay would still shrink it: it keeps its value, and its range of the
                # shard is reset to it.
                lo, hi = max(off, b.lo), min(off + p.numel(), b.hi)
                if hi > lo:
                    b.shard.data[lo - b.lo : hi - b.lo] = p.detach().reshape(-1)[lo - off : hi - off]
        if self.size > 1:
            src = dist.get_global_rank(self.group, 0)
            for buf in self.buffers:
                dist.broadcast(buf, src=src, group=self.group)

    @torch.no_grad()
    def refresh_shards(self) -> None:
        """Copy each rank's range of the parameters into its shard (after a model load; local)."""
        for b in self.buckets:
            for p, off in zip(b.params, b.offsets, strict=True):
                lo, hi = max(off, b.lo), min(off + p.numel(), b.hi)
                if hi > lo:
                    b.shard[lo - b.lo : hi - b.lo] = p.detach().reshape(-1)[lo - off : hi - off]

    def init_state(self) -> None:
        """Create the optimizer's state for every shard without changing any value.

        Collective over the group (the step hooks gather). Like torch's ``_init_optim_state``:
        one step with zero gradients at learning rate 0.
        """
        if all(len(self.optim.state.get(b.shard, {})) for b in self.buckets):
            return
        # Shards that have state keep it untouched: no gradient, so the optimizer skips them
        # (a zero-gradient step would still advance their step count and decay their moments).
        for b in self.buckets:
            b.shard.grad = None if self.optim.state.get(b.shard) else torch.zeros_like(b.shard)
        lrs = [g["lr"] for g in self.optim.param_groups]
        for g in self.optim.param_groups:
            g["lr"] = 0.0 if not isinstance(g["lr"], torch.Tensor) else torch.zeros_like(g["lr"])
        try:
            self.optim.step()
        finally:
            for g, lr in zip(self.optim.param_groups, lrs, strict=True):
                g["lr"] = lr
            self.optim.zero_grad(set_to_none=True)

    # -- checkpoint views --------------------------------------------------------------------

    def state_pieces(self) -> list[tuple[_Bucket, str, int, int, int]]:
        """``(bucket, fqn, param index, flat start, flat stop)`` of each parameter piece this rank owns.

        Start and stop are offsets inside the parameter's own flattened elements.
        """
        out = []
        for b in self.buckets:
            for i, (fqn, off) in enumerate(zip(b.fqns, b.offsets, strict=True)):
                n = b.params[i].numel()
                a, z = max(off, b.lo), min(off + n, b.hi)
                if z > a or (n == 0 and b.lo <= off < b.hi):
                    out.append((b, fqn, i, a - off, z - off))
        return out


class ZeroCheckpointIO(CheckpointIO):
    """CheckpointIO for :class:`ZeroPlugin`: optimizer state as flat ranges of parameter-shaped tensors.

    Every save writes each rank's flat ranges from the rank that owns them, with no gather:
    ``gather_dtensor=False`` as slices, ``gather_dtensor=True`` straight into their place in the
    Hugging Face files (``io/hf_save.py``; a flat range is one contiguous run of bytes).
    A model load refreshes the optimizer's shards from the loaded weights; an optimizer load
    copies the state straight into the shards.
    """

    plugin_name = "zero"

    def __init__(
        self,
        mesh: DeviceMesh | None = None,
        group: ProcessGroup | None = None,
        *,
        partition: ZeroPartition | None = None,
        **options: Any,
    ) -> None:
        super().__init__(mesh, group, **options)
        self.partition = partition

    def _after_load(self, ctx: HookContext) -> None:
        if ctx.kind == "model" and self.partition is not None:
            self.partition.refresh_shards()

    def _part(self) -> ZeroPartition:
        if self.partition is None:
            raise UnsupportedError("ZeroCheckpointIO has no partition: get it from ZeroPlugin after boost()")
        return self.partition

    def _optimizer_state(self, ctx: HookContext) -> dict[str, Any]:
        """FQN-keyed state: this rank's flat ranges (noted in ``ctx`` for :meth:`_local_slices`), or full tensors.

        Each flat range is listed under a key tensor: the range's view itself when saving, a
        parameter-shaped meta tensor when loading (the loader matches shapes). ``ctx.notes``
        maps ``id(key)`` to ``(key, view, global shape, flat start, stop)``.
        """
        part, optim = self._part(), ctx.optim
        groups: list[dict[str, Any]] = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in optim.param_groups
        ]
        for b in part.buckets:
            groups[b.group_index]["params"].extend(b.fqns)
        part.init_state()
        state: dict[str, dict[str, Any]] = {}
        # Every rank names every parameter's state, with an empty range where it owns none:
        # the index entry (and its ``param`` field) is built from rank 0's names.
        pieces = {(id(b), i): (start, stop) for b, _, i, start, stop in part.state_pieces()}
        for b, fqn, i in [(bk, f, i) for bk in part.buckets for i, f in enumerate(bk.fqns)]:
            start, stop = pieces.get((id(b), i), (0, 0))
            p = b.params[i]
            st = optim.state[b.shard]
            # A gathered save lists state keys sorted, the order its files have always had.
            for k, v in sorted(st.items()) if ctx.gather else st.items():
                if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == b.chunk:
                    base = max(0, b.offsets[i] + start - b.lo)
                    view = v[base : base + (stop - start)]
                    key = view if ctx.saving else torch.empty(p.shape, dtype=v.dtype, device="meta")
                    ctx.notes[id(key)] = (key, view, tuple(p.shape), start, stop)
                    state.setdefault(fqn, {})[k] = key
                else:
                    state.setdefault(fqn, {})[k] = v
        return {"state": state, "param_groups": groups}

    def _state_parameters(self, model: nn.Module) -> list[tuple[str, torch.Tensor]]:
        # The optimizer's state lives on the shards, not on the model's parameters: report each
        # parameter FQN with the shard that holds its state (the base drops state that never stepped).
        return [(fqn, b.shard) for b in self._part().buckets for fqn in b.fqns]

    def _local_slices(self, name: str, tensor: torch.Tensor, ctx: HookContext) -> list[LocalSlice]:
        """Local slices of a noted flat range (one per box, each a contiguous run of the view), else the default."""
        hit = ctx.notes.get(id(tensor))
        if hit is None or hit[0] is not tensor:
            return super()._local_slices(name, tensor, ctx)
        _, view, gshape, start, stop = hit
        dtype = st_dtype(tensor.dtype, name)
        out = []
        for (off, shp), fs in flat_range_to_boxes(gshape, start, stop):
            n = math.prod(shp)
            out.append(LocalSlice(name, dtype, gshape, off, shp, view[fs - start : fs - start + n]))
        return out

    def _set_optimizer_state(self, ctx: HookContext, osd: dict[str, Any]) -> None:
        """Tensor state was loaded in place; copy hyperparameters and scalar (non-tensor) state."""
        part, optim = self._part(), ctx.optim
        for g, saved in zip(optim.param_groups, osd["param_groups"], strict=True):
            for k, v in saved.items():
                if k != "params":
                    g[k] = v
        for b in part.buckets:
            st = optim.state[b.shard]
            for fqn in b.fqns:
                for k, v in osd["state"].get(fqn, {}).items():
                    if not isinstance(v, torch.Tensor):
                        st[k] = v
