"""Choosing FSDP2 shard units (shared by the FSDP2 and hybrid plugins).

The public names are re-exported by ``unickpt.plugins.fsdp2``."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from unickpt.errors import UnsupportedError

ShardSpec = Iterable[str | type[nn.Module]]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _within(fqn: str, unit: str) -> bool:
    return unit == "" or fqn == unit or fqn.startswith(unit + ".")


def _param_owners(root: nn.Module) -> dict[int, set[str]]:
    """``id(parameter)`` -> FQNs of every module that holds it directly (tied params have several)."""
    owners: dict[int, set[str]] = {}
    for mfqn, mod in root.named_modules(remove_duplicate=False):
        for p in mod._parameters.values():
            if p is not None:
                owners.setdefault(id(p), set()).add(mfqn)
    return owners


def _shared_outside(unit: str, mod: nn.Module, owners: dict[int, set[str]]) -> list[str]:
    """FQNs of modules outside ``unit`` holding one of its parameters (tied weights)."""
    out: set[str] = set()
    for p in mod.parameters():
        out.update(o for o in owners.get(id(p), ()) if not _within(o, unit))
    return sorted(out)


def group_dtypes(root: nn.Module, unit: str, units: Iterable[str]) -> dict[torch.dtype, list[str]]:
    """Dtypes of the trainable parameters ``fully_shard(unit)`` would manage, with their FQNs."""
    inner = [u for u in units if u != unit and _within(u, unit)]
    found: dict[torch.dtype, list[str]] = {}
    mod = root.get_submodule(unit)
    for name, p in mod.named_parameters():
        fqn = _join(unit, name)
        if p.requires_grad and not any(_within(fqn, u) for u in inner):
            found.setdefault(p.dtype, []).append(fqn)
    return found


def no_split_classes(root: nn.Module) -> set[str]:
    """Class names the model declares as units that must stay whole (``_no_split_modules``).

    Hugging Face models list their decoder layer there (``LlamaDecoderLayer``, ``GPT2Block``),
    and accelerate's and transformers' FSDP auto-wrap policies wrap exactly those; a wrapper
    (a ``PeftModel`` around a Hugging Face model) is searched through.
    """
    names: set[str] = set()
    for mod in root.modules():
        declared = getattr(mod, "_no_split_modules", None)
        if isinstance(declared, (list, tuple, set)):
            names.update(n for n in declared if isinstance(n, str))
    return names


def default_shard_units(root: nn.Module) -> list[str]:
    """The FQNs ``fully_shard`` is applied to before the root, when ``shard_modules`` is None.

    A model that names its repeated layers (``_no_split_modules``, as Hugging Face models do)
    gets one unit per such layer, wherever it sits (``model.layers.3``, ``transformer.h.0``,
    ``base_model.model.model.layers.0`` under PEFT), and the root keeps the rest (embeddings,
    final norm, head), as accelerate's and transformers' FSDP wrapping does. Other models get
    each item of a ``ModuleList``/``ModuleDict`` child and each other direct child that holds
    parameters. Either way a candidate whose parameters are tied to a module outside it is left
    to the root (sharding it alone would untie the weights), and one whose trainable parameters
    mix dtypes is split into its own children (FSDP2 needs one dtype per group).
    """
    owners = _param_owners(root)
    units: list[str] = []

    def mixed(mod: nn.Module) -> bool:
        return len({p.dtype for p in mod.parameters() if p.requires_grad}) > 1

    def consider(fqn: str, mod: nn.Module) -> None:
        if next(mod.parameters(), None) is None or _shared_outside(fqn, mod, owners):
            return
        if mixed(mod):
            for cname, child in mod.named_children():
                consider(_join(fqn, cname), child)
            return
        units.append(fqn)

    layer_classes = no_split_classes(root)
    if layer_classes:

        def visit(fqn: str, mod: nn.Module) -> None:
            if fqn and type(mod).__name__ in layer_classes:
                consider(fqn, mod)
                return
            for cname, child in mod.named_children():
                visit(_join(fqn, cname), child)

        visit("", root)
        if units:
            return units
    for name, child in root.named_children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            for cname, item in child.named_children():
                consider(_join(name, cname), item)
        else:
            consider(name, child)
    return units


def modules_named(root: nn.Module, spec: Iterable[str | type[nn.Module]], option: str) -> list[str]:
    """FQNs of ``root``'s modules (the root itself excluded) that ``spec`` names by FQN or by
    class, in module order; a named FQN the model lacks raises ``UnsupportedError`` naming
    ``option`` and every such name."""
    spec = list(spec)
    names = {s for s in spec if isinstance(s, str)}
    kinds = tuple(s for s in spec if isinstance(s, type))
    unknown = sorted(names - {fqn for fqn, _ in root.named_modules()})
    if unknown:
        raise UnsupportedError(f"{option} names modules the model does not have: {unknown}")
    return [
        fqn
        for fqn, mod in root.named_modules()
        if fqn and (fqn in names or (kinds and isinstance(mod, kinds)))
    ]


def resolve_units(root: nn.Module, shard_modules: ShardSpec | None) -> list[str]:
    if shard_modules is None:
        return default_shard_units(root)
    units = set(modules_named(root, shard_modules, "FSDP2Plugin(shard_modules=...)"))
    owners = _param_owners(root)
    for unit in sorted(units):
        shared = _shared_outside(unit, root.get_submodule(unit), owners)
        if shared:
            raise UnsupportedError(
                f"cannot fully_shard {unit!r} on its own: its parameters are tied to {shared}, "
                "which lie outside it; shard a module that contains both, or leave them to the root"
            )
    return sorted(units)
