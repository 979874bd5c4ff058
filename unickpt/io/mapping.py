"""Stored tensors and live tensors related by a mapping: renames and tensor ops.

A Hugging Face Hub checkpoint keeps one tensor per expert (Mixtral's
``model.layers.0.block_sparse_moe.experts.3.w1.weight``), while transformers 5 holds the
experts of a layer fused in memory (``model.layers.0.mlp.experts.gate_up_proj`` of shape
``[E, 2I, H]``). transformers describes the relation as a list of ``WeightRenaming`` (a name
rewritten) and ``WeightConverter`` (several stored tensors turned into one live tensor by
``MergeModulelist``, ``Concatenate``, ``Chunk``, ``Split``, ``Transpose``, ``Interleave`` and
their reverses) in ``transformers.conversion_mapping``. This module takes those objects as they
are (transformers' own tables for a transformers model, or a list the user passes for any
other model) and turns them into a *plan*: for every live tensor, a tree of nodes (``Stack``,
``Cat``, ``Narrow``, ``Select``, ``Swap``, ``Interleave``) over whole stored tensors.

A tree is never evaluated on whole tensors unless it must be: asked for a box (offsets,
shape) of the live tensor, it names the boxes of the stored tensors that make it up
(:meth:`Node.leaves`) and assembles the box from exactly those (:meth:`Node.build`), so an
FSDP rank holding experts 2..3 of ``gate_up_proj`` reads the bytes of those experts' ``w1``
and ``w3`` and nothing else. Only ``Interleave`` needs its whole dimension.

The same trees run the other way for writing (:func:`plan_save`): each Hub tensor is a node
over live tensors (a ``Select`` of an expert, a ``Narrow`` of its gate or up half), read
box-wise from a unickpt checkpoint by ``merge`` or from the model by a gathered save.

Names follow transformers' rules exactly: the renamings and the one converter a name may
match are applied by transformers' own ``apply_renamings`` and ``rename_source_key``, and the
keys an op returns are expanded into full names as ``WeightConverter.convert`` does.
"""

from __future__ import annotations

import copy
import itertools
import math
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

from unickpt._logging import get_logger
from unickpt.errors import CheckpointFormatError, ConfigError, UnsupportedError
from unickpt.spec.naming import MAX_INDEX_DIGITS, shown

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = get_logger(__name__)

__all__ = [
    "Node",
    "Leaf",
    "Misfit",
    "LoadPlan",
    "is_transformers_model",
    "resolve_mapping",
    "mapping_from_config",
    "plan_load",
    "plan_save",
    "is_identity",
    "map_payload",
]

Shape = tuple[int, ...]
#: (stored name, offsets, shape) -> that box of the stored tensor
Fetch = Callable[[str, Shape, Shape], torch.Tensor]


# ---------------------------------------------------------------------------- the trees
class Node:
    """A live (or Hub) tensor as a function of whole stored tensors."""

    shape: Shape
    dtype: str  # safetensors dtype of the stored tensors it is made of

    def leaves(self, off: Shape, shp: Shape) -> Iterator[tuple[str, Shape, Shape]]:
        """The boxes of stored tensors that the box (off, shp) of this tensor is made of."""
        raise NotImplementedError

    def build(self, off: Shape, shp: Shape, fetch: Fetch) -> torch.Tensor:
        """The box (off, shp) of this tensor, from the stored boxes ``fetch`` reads."""
        raise NotImplementedError

    def pieces(
        self, leaf: str, off: Shape, shp: Shape, t: torch.Tensor
    ) -> Iterator[tuple[Shape, Shape, torch.Tensor]]:
        """Where the box (off, shp) of the stored tensor ``leaf``, whose data is ``t``, lands in
        this tensor: (offsets, shape, a view of ``t``) for each part of it that this tensor holds."""
        raise NotImplementedError

    def sources(self) -> list[str]:
        """Every stored tensor this one is made of, in order."""
        return [n for n, _, _ in self.leaves((0,) * len(self.shape), self.shape)] if self.shape else []

    def _empty(self, shp: Shape) -> torch.Tensor:
        from unickpt.io.tensors import torch_dtype

        return torch.empty(shp, dtype=torch_dtype(self.dtype))


@dataclass
class Leaf(Node):
    name: str
    shape: Shape
    dtype: str

    def leaves(self, off: Shape, shp: Shape) -> Iterator[tuple[str, Shape, Shape]]:
        if math.prod(shp) or not shp:
            yield self.name, tuple(off), tuple(shp)

    def build(self, off: Shape, shp: Shape, fetch: Fetch) -> torch.Tensor:
        if shp and not math.prod(shp):
            return self._empty(shp)
        return fetch(self.name, tuple(off), tuple(shp))

    def sources(self) -> list[str]:
        return [self.name]

    def pieces(
        self, leaf: str, off: Shape, shp: Shape, t: torch.Tensor
    ) -> Iterator[tuple[Shape, Shape, torch.Tensor]]:
        if leaf == self.name:
            yield tuple(off), tuple(shp), t


def _drop(t: Shape, d: int) -> Shape:
    return t[:d] + t[d + 1 :]


def _put(t: Shape, d: int, v: int) -> Shape:
    return (*t[:d], v, *t[d + 1 :])


class Misfit(ValueError):
    """Stored tensors that a mapping cannot combine (shapes that differ)."""


def _same_shapes(parts: list[Node], dim: int | None, how: str) -> None:
    def key(p: Node) -> Shape:
        return p.shape if dim is None or dim >= len(p.shape) else _drop(p.shape, dim)

    first = parts[0]
    for p in parts[1:]:
        if len(p.shape) != len(first.shape) or key(p) != key(first):
            a, b = first.sources(), p.sources()
            raise Misfit(
                f"the stored tensors {shown(a[0])} of shape {list(first.shape)} and {shown(b[0])} of shape "
                f"{list(p.shape)} cannot be {how}"
            )


class Stack(Node):
    """``torch.stack(parts, dim)``: ``MergeModulelist``."""

    def __init__(self, dim: int, parts: list[Node]) -> None:
        self.dim, self.parts = dim, parts
        first = parts[0].shape
        _same_shapes(parts, None, "stacked")
        self.shape = (*first[:dim], len(parts), *first[dim:])
        self.dtype = parts[0].dtype

    def leaves(self, off: Shape, shp: Shape) -> Iterator[tuple[str, Shape, Shape]]:
        d = self.dim
        for i in range(off[d], off[d] + shp[d]):
            yield from self.parts[i].leaves(_drop(off, d), _drop(shp, d))

    def build(self, off: Shape, shp: Shape, fetch: Fetch) -> torch.Tensor:
        d = self.dim
        if not shp[d]:
            return self._empty(shp)
        rows = [
            self.parts[i].build(_drop(off, d), _drop(shp, d), fetch) for i in range(off[d], off[d] + shp[d])
        ]
        return torch.stack(rows, d)

    def pieces(
        self, leaf: str, off: Shape, shp: Shape, t: torch.Tensor
    ) -> Iterator[tuple[Shape, Shape, torch.Tensor]]:
        d = self.dim
        for i, p in enumerate(self.parts):
            for o, n, x in p.pieces(leaf, off, shp, t):
                yield (*o[:d], i, *o[d:]), (*n[:d], 1, *n[d:]), x.unsqueeze(d)


class Cat(Node):
    """``torch.cat(parts, dim)``: ``Concatenate``."""

    def __init__(self, dim: int, parts: list[Node]) -> None:
        self.dim, self.parts = dim, parts
        _same_shapes(parts, dim, f"concatenated along dim {dim}")
        self.shape = _put(parts[0].shape, dim, sum(p.shape[dim] for p in parts))
        self.dtype = parts[0].dtype

    def _pieces(self, off: Shape, shp: Shape) -> Iterator[tuple[Node, Shape, Shape]]:
        d, at = self.dim, 0
        for p in self.parts:
            n = p.shape[d]
            lo, hi = max(off[d], at), min(off[d] + shp[d], at + n)
            if lo < hi:
                yield p, _put(off, d, lo - at), _put(shp, d, hi - lo)
            at += n

    def leaves(self, off: Shape, shp: Shape) -> Iterator[tuple[str, Shape, Shape]]:
        for p, o, s in self._pieces(off, shp):
            yield from p.leaves(o, s)

    def build(self, off: Shape, shp: Shape, fetch: Fetch) -> torch.Tensor:
        pieces = [p.build(o, s, fetch) for p, o, s in self._pieces(off, shp)]
        return torch.cat(pieces, self.dim) if pieces else self._empty(shp)

    def pieces(
        self, leaf: str, off: Shape, shp: Shape, t: torch.Tensor
    ) -> Iterator[tuple[Shape, Shape, torch.Tensor]]:
        d, at = self.dim, 0
        for p in self.parts:
            for o, n, x in p.pieces(leaf, off, shp, t):
                yield _put(o, d, o[d] + at), n, x
            at += p.shape[d]


class Narrow(Node):
    """``part.narrow(dim, start, length)``: one piece of ``Chunk`` or ``Split``."""

    def __init__(self, dim: int, start: int, length: int, part: Node) -> None:
        self.dim, self.start, self.part = dim, start, part
        self.shape = _put(part.shape, dim, length)
        self.dtype = part.dtype

    def leaves(self, off: Shape, shp: Shape) -> Iterator[tuple[str, Shape, Shape]]:
        yield from self.part.leaves(_put(off, self.dim, off[self.dim] + self.start), shp)

    def build(self, off: Shape, shp: Shape, fetch: Fetch) -> torch.Tensor:
        return self.part.build(_put(off, self.dim, off[self.dim] + self.start), shp, fetch)

    def pieces(
        self, leaf: str, off: Shape, shp: Shape, t: torch.Tensor
    ) -> Iterator[tuple[Shape, Shape, torch.Tensor]]:
        d, a, b = self.dim, self.start, self.start + self.shape[self.dim]
        for o, n, x in self.part.pieces(leaf, off, shp, t):
            lo, hi = max(o[d], a), min(o[d] + n[d], b)
            if lo < hi:
                yield _put(o, d, lo - a), _put(n, d, hi - lo), x.narrow(d, lo - o[d], hi - lo)


class Select(Node):
    """``part.select(dim, index)``: one entry of ``SplitModulelist``."""

    def __init__(self, dim: int, index: int, part: Node) -> None:
        self.dim, self.index, self.part = dim, index, part
        self.shape = _drop(part.shape, dim)
        self.dtype = part.dtype

    def _box(self, off: Shape, shp: Shape) -> tuple[Shape, Shape]:
        d = self.dim
        return (*off[:d], self.index, *off[d:]), (*shp[:d], 1, *shp[d:])

    def leaves(self, off: Shape, shp: Shape) -> Iterator[tuple[str, Shape, Shape]]:
        yield from self.part.leaves(*self._box(off, shp))

    def build(self, off: Shape, shp: Shape, fetch: Fetch) -> torch.Tensor:
        return self.part.build(*self._box(off, shp), fetch).squeeze(self.dim)

    def pieces(
        self, leaf: str, off: Shape, shp: Shape, t: torch.Tensor
    ) -> Iterator[tuple[Shape, Shape, torch.Tensor]]:
        d, i = self.dim, self.index
        for o, n, x in self.part.pieces(leaf, off, shp, t):
            if o[d] <= i < o[d] + n[d]:
                yield _drop(o, d), _drop(n, d), x.select(d, i - o[d])


class Swap(Node):
    """``part.transpose(d0, d1)``: ``Transpose``."""

    def __init__(self, d0: int, d1: int, part: Node) -> None:
        self.d0, self.d1, self.part = d0, d1, part
        self.shape = self._swap(part.shape)
        self.dtype = part.dtype

    def _swap(self, t: Shape) -> Shape:
        lst = list(t)
        lst[self.d0], lst[self.d1] = lst[self.d1], lst[self.d0]
        return tuple(lst)

    def leaves(self, off: Shape, shp: Shape) -> Iterator[tuple[str, Shape, Shape]]:
        yield from self.part.leaves(self._swap(off), self._swap(shp))

    def build(self, off: Shape, shp: Shape, fetch: Fetch) -> torch.Tensor:
        return self.part.build(self._swap(off), self._swap(shp), fetch).transpose(self.d0, self.d1)

    def pieces(
        self, leaf: str, off: Shape, shp: Shape, t: torch.Tensor
    ) -> Iterator[tuple[Shape, Shape, torch.Tensor]]:
        for o, n, x in self.part.pieces(leaf, off, shp, t):
            yield self._swap(o), self._swap(n), x.transpose(self.d0, self.d1)


class Interleave(Node):
    """transformers' ``Interleave``: its dimension read whole, then reordered and cut."""

    def __init__(self, dim: int, inverse: bool, part: Node) -> None:
        self.dim, self.inverse, self.part = dim, inverse, part
        self.shape, self.dtype = part.shape, part.dtype

    def _whole(self, off: Shape, shp: Shape) -> tuple[Shape, Shape]:
        return _put(off, self.dim, 0), _put(shp, self.dim, self.shape[self.dim])

    def leaves(self, off: Shape, shp: Shape) -> Iterator[tuple[str, Shape, Shape]]:
        yield from self.part.leaves(*self._whole(off, shp))

    def build(self, off: Shape, shp: Shape, fetch: Fetch) -> torch.Tensor:
        t = self.part.build(*self._whole(off, shp), fetch)
        d, shape = self.dim, list(t.shape)
        shape[d : d + 1] = [2, shape[d] // 2] if self.inverse else [shape[d] // 2, 2]
        t = t.reshape(shape).transpose(d, d + 1).reshape(t.shape)
        return t.narrow(d, off[d], shp[d])

    def pieces(
        self, leaf: str, off: Shape, shp: Shape, t: torch.Tensor
    ) -> Iterator[tuple[Shape, Shape, torch.Tensor]]:
        for o, n, x in self.part.pieces(leaf, off, shp, t):
            if o[self.dim] != 0 or n[self.dim] != self.shape[self.dim]:
                raise UnsupportedError(
                    f"Interleave of {shown(leaf)} along dim {self.dim}: a rank holds part of that dim; "
                    "save sliced (gather_dtensor=False) and merge"
                )
            d, shape = self.dim, list(x.shape)
            shape[d : d + 1] = [2, shape[d] // 2] if self.inverse else [shape[d] // 2, 2]
            yield o, n, x.reshape(shape).transpose(d, d + 1).reshape(x.shape)


def is_identity(plan: dict[str, Node]) -> bool:
    """True when every tensor of ``plan`` is a stored tensor of the same name."""
    return all(isinstance(n, Leaf) and n.name == k for k, n in plan.items())


# ---------------------------------------------------------------------------- transformers' objects
def _tf() -> Any:
    try:
        from transformers import core_model_loading
    except ImportError as e:  # pragma: no cover - only reached with a mapping, which needs transformers
        raise UnsupportedError(f"a weight mapping needs transformers ({e})") from None
    return core_model_loading


def _split(transforms: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    tf = _tf()
    renamings, converters = [], []
    for t in transforms:
        if isinstance(t, tf.WeightConverter):
            converters.append(t)
        elif isinstance(t, tf.WeightRenaming):
            renamings.append(t)
        else:
            raise ConfigError(
                f"mapping: {shown(t)} is not a transformers WeightRenaming or WeightConverter "
                "(transformers.core_model_loading)"
            )
    return renamings, converters


def is_transformers_model(model: torch.nn.Module) -> TypeGuard[PreTrainedModel]:
    """Whether ``model`` is a transformers ``PreTrainedModel``, asked without importing
    transformers: an instance of one has that class in its type's MRO, so transformers is loaded
    already. (Importing it to learn that a plain module is not one costs a save or a load of any
    other model about 1.5 s and 180 MB of resident memory.)"""
    return any(
        c.__name__ == "PreTrainedModel" and c.__module__ == "transformers.modeling_utils"
        for c in type(model).__mro__
    )


def resolve_mapping(model: torch.nn.Module, mapping: Any, *, saving: bool) -> list[Any] | None:
    """The transforms to use for ``model``: ``mapping`` itself when it is a list, none for
    ``False`` or ``[]``, and for ``None`` (the default) transformers' own conversion mapping of a
    transformers model (``get_model_conversion_mapping``; for saving, the one transformers'
    ``save_pretrained`` reverses: the one the model was loaded with, else the default one without
    the legacy renamings and prefix changes). None when nothing is to be mapped."""
    if mapping is False:
        return None
    if mapping is not None and mapping is not True:
        if not isinstance(mapping, (list, tuple)):
            raise ConfigError(
                f"mapping must be None, False or a list of transformers WeightRenaming/WeightConverter, "
                f"got {type(mapping).__name__}"
            )
        _split(mapping)  # refuses anything else, before any collective goes further
        return [copy.deepcopy(t) for t in mapping] or None
    if not is_transformers_model(model):
        if mapping is True:
            raise ConfigError(
                f"mapping=True asks for transformers' conversion mapping, but the model is a "
                f"{type(model).__name__}, not a transformers PreTrainedModel: pass the list of transforms"
            )
        return None
    from transformers.conversion_mapping import get_model_conversion_mapping

    if saving:
        loaded = getattr(model, "_weight_conversions", None)
        if loaded is not None:
            return [copy.deepcopy(t) for t in loaded] or None
        got = get_model_conversion_mapping(model, add_legacy=False)
        got = [t for t in got if not isinstance(t, _tf().PrefixChange)]
        return got or None
    return list(get_model_conversion_mapping(model)) or None


#: The most submodules a ``config.json``'s architecture may register while it is built on the meta
#: device for its names and mapping: its sizes are the file's claim (a layer count of 10^5 built
#: for over a minute). Llama 3.1 405B registers 1,644, DeepSeek-V3 1,214, Switch Transformers with
#: 2,048 experts per layer 62,108.
MAX_META_MODULES = 1 << 17


class _TooManyModules(Exception):
    """Raised inside the registration hook of :func:`meta_model` (never leaves it)."""


def meta_model(config_json: bytes) -> tuple[str, Any] | None:
    """``(architecture, model)``: the transformers model ``config.json``'s first architecture names,
    built on the meta device (no memory, no weights); None when the config names none, when
    transformers is not installed or the architecture cannot be built from this config here.
    An architecture that registers more than ``MAX_META_MODULES`` submodules while it is built is
    a ``CheckpointFormatError``: the build stops there, in bounded time and memory."""
    import json
    import threading

    try:
        cfg = json.loads(config_json)
        arch = cfg["architectures"][0]
        model_type = cfg["model_type"]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    try:
        import transformers
        from transformers import AutoConfig
    except ImportError:
        return None
    cls = getattr(transformers, str(arch), None)
    if cls is None:
        return None
    builder, count = threading.get_ident(), 0

    def counted(module: Any, name: str, submodule: Any) -> None:
        nonlocal count
        if threading.get_ident() == builder:  # modules other threads build are theirs
            count += 1
            if count > MAX_META_MODULES:
                raise _TooManyModules

    hook = torch.nn.modules.module.register_module_module_registration_hook(counted)
    try:
        config = AutoConfig.for_model(model_type, **{k: v for k, v in cfg.items() if k != "model_type"})
        with torch.device("meta"):
            return str(arch), cls(config)
    except _TooManyModules:
        raise CheckpointFormatError(
            f"config.json: its architecture {shown(str(arch))} registered more than {MAX_META_MODULES} "
            "modules while built on the meta device for its weight names (a size in the config, such as "
            "num_hidden_layers, far beyond a real model's); refused: correct the config, or remove it"
        ) from None
    except Exception as e:  # an architecture that cannot be built from this config
        logger.debug("cannot build %s from config.json: %s", shown(str(arch)), e)
        return None
    finally:
        hook.remove()


def mapping_from_config(config_json: bytes, *, saving: bool = True) -> list[Any] | None:
    """transformers' conversion mapping of the architecture a ``config.json`` names
    (:func:`meta_model`); None when there is none or the model cannot be built here."""
    built = meta_model(config_json)
    return None if built is None else resolve_mapping(built[1], None, saving=saving)


# ---------------------------------------------------------------------------- the ops, on trees
State = dict[str, Any]  # key -> Node or list of Node
#: The most tensors one tensor is split into: the experts of a layer (hundreds in today's models,
#: 2,048 in the largest published ones).
MAX_SPLIT_PARTS = 1 << 12


def _one(v: Any) -> Node:
    node: Node = v[0] if isinstance(v, list) else v
    return node


def _run_op(op: Any, state: State, conv: Any, shape_of: Callable[[str], Shape | None], where: str) -> State:
    """``op.convert`` of transformers, on trees instead of tensors (same keys out)."""
    tf = _tf()
    src, tgt = conv.source_patterns, conv.target_patterns
    name = type(op).__name__
    if isinstance(op, tf.MergeModulelist):
        out: State = {}
        for k, v in state.items():
            key = tgt[0] if len(state) == 1 else k
            out[key] = v if isinstance(v, Node) else Stack(op.dim, list(v))
        return out
    if isinstance(op, tf.SplitModulelist):
        out = {}
        for k, v in state.items():
            node = _one(v)
            pat = tgt[0] if len(state) == 1 and len(tgt) == 1 else k
            count = node.shape[op.dim]  # from the checkpoint: bounded before anything is built per part
            if count > MAX_SPLIT_PARTS:
                raise UnsupportedError(
                    f"{where}: splitting a tensor of shape {shown(list(node.shape))} along dim {op.dim} "
                    f"would make {count} tensors; a mapping makes at most {MAX_SPLIT_PARTS} of one"
                )
            for i in range(count):
                out[pat.replace("*", str(i))] = Select(op.dim, i, node)
        return out
    if isinstance(op, tf.Concatenate):
        if len(tgt) > 1:
            raise UnsupportedError(f"{where}: Concatenate with several targets {tgt}")
        parts: list[Node] = []
        for p in src:
            if p in state:
                v = state[p]
                parts.extend(v if isinstance(v, list) else [v])
        return {tgt[0]: Cat(op.dim, parts)}
    if isinstance(op, (tf.Chunk, tf.Split)):
        if len(state) != 1:
            raise UnsupportedError(f"{where}: {name} of {len(state)} inputs")
        node = _one(next(iter(state.values())))
        if isinstance(op, tf.Chunk) and op.num_shards_attribute is not None:
            raise UnsupportedError(f"{where}: Chunk(num_shards_attribute=...) reads the model config")
        length = node.shape[op.dim]
        if isinstance(op, tf.Chunk):
            step = -(-length // len(tgt)) if length else 0
            sizes = [max(0, min(step, length - i * step)) for i in range(len(tgt))]
        else:
            got = [shape_of(t) for t in tgt]
            if any(g is None for g in got):
                raise UnsupportedError(f"{where}: Split needs the shapes of {tgt} in the model")
            sizes = [g[op.dim] for g in got]  # type: ignore[index]
        if sum(sizes) != length:
            raise UnsupportedError(f"{where}: {name} of {length} along dim {op.dim} into {sizes}")
        out, at = {}, 0
        for t, n in zip(tgt, sizes, strict=True):
            out[t] = Narrow(op.dim, at, n, node)
            at += n
        return out
    if isinstance(op, tf.Transpose):
        if len(state) != 1:
            raise UnsupportedError(f"{where}: Transpose of {len(state)} inputs")
        node = _one(next(iter(state.values())))
        key = src[0] if len(tgt) > 1 and len(src) == 1 else tgt[0]
        if op.check_dims and shape_of(key) == node.shape:
            return {key: node}
        d0, d1 = op.dim0 % len(node.shape), op.dim1 % len(node.shape)
        return {key: Swap(d0, d1, node)}
    if isinstance(op, tf.Interleave):
        node = _one(next(iter(state.values())))
        return {tgt[0]: Interleave(op.dim % len(node.shape), op.inverse, node)}
    raise UnsupportedError(
        f"{where}: unickpt maps tensors through MergeModulelist, SplitModulelist, Concatenate, Chunk, "
        f"Split, Transpose and Interleave; {name} is none of them"
    )


def _full_names(layer_name: str, outputs: State) -> dict[str, Node]:
    """The keys an op chain returned expanded into full names, as ``WeightConverter.convert``."""
    full = layer_name.replace("*.", "0.") if "*." in layer_name else layer_name
    for k in outputs:
        if k in full:
            prefix, _, suffix = full.partition(k)
            return {prefix + k + suffix: _one(v) for k, v in outputs.items()}
    return {k: _one(v) for k, v in outputs.items()}


def _convert(
    conv: Any, layer_name: str, state: State, shape_of: Callable[[str], Shape | None]
) -> dict[str, Node]:
    where = f"{layer_name} ({type(conv).__name__} {conv.source_patterns} -> {conv.target_patterns})"
    for op in conv.operations:
        state = _run_op(op, state, conv, shape_of, where)
    return _full_names(layer_name, state)


def _match_converter(name: str, converters: list[Any]) -> tuple[str, Any, str] | None:
    """(renamed key, converter, its source pattern that matched) of the one converter that matches."""
    for conv in converters:
        renamed, pattern = conv.rename_source_key(name)
        if pattern is not None:
            return renamed, conv, pattern
    return None


def _natural_key(name: str) -> list[tuple[Any, ...]]:
    """The order of transformers' ``dot_natural_key`` (per dotted part: digits numerically, then
    text, a trailing number numerically) for any name a checkpoint holds. transformers' own key
    calls ``int()`` on every digit part, which raises on a part of over 4,300 digits or a digit
    that is not ASCII (``'\u00b2'``); here such a part sorts as text."""
    parts: list[tuple[Any, ...]] = []
    for part in name.split("."):
        if part.isascii() and part.isdigit() and len(part) <= MAX_INDEX_DIGITS:
            parts.append((0, int(part)))
            continue
        text = part.rstrip("0123456789")
        digits = part[len(text) :]
        parts.append((1, text, int(digits)) if digits and len(digits) <= MAX_INDEX_DIGITS else (1, part))
    return parts


def _index_re(pattern: str) -> re.Pattern[str] | None:
    """A pattern's first ``*`` as a captured expert index (``.experts.*.w1.weight``)."""
    if "*" not in pattern:
        return None
    head, *rest = pattern.split("*")
    # An index is a position among stored tensors, never a number whose range could not be walked.
    return re.compile(
        re.escape(head) + rf"(\d{{1,{MAX_INDEX_DIGITS}}})" + ".*".join(re.escape(x) for x in rest)
    )


# ---------------------------------------------------------------------------- loading
@dataclass
class LoadPlan:
    """How the stored tensors make up the live ones.

    ``renames``: live name -> the stored tensor it is, under another name. ``built``: live name
    -> the tree of stored tensors it is made of. ``problems``: what does not fit, one line per
    live tensor (what the mapping expects, what the checkpoint holds)."""

    renames: dict[str, str] = field(default_factory=dict)
    built: dict[str, Node] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def plan_load(
    transforms: Sequence[Any],
    stored: dict[str, tuple[str, Shape]],
    targets: dict[str, Shape],
    *,
    skip: set[str] | frozenset[str] = frozenset(),
    src_of: dict[str, str] | None = None,
) -> LoadPlan:
    """The plan that loads ``stored`` (name -> (dtype, shape)) into ``targets`` (live name ->
    global shape) through ``transforms``. A stored name that is a live name (or in ``skip``)
    loads as it is; the others go through transformers' renaming and at most one converter (its
    rules: renamings first, in order, then the first converter that matches). The trees' leaves
    are named ``src_of[name]`` (the tensor to read) where given."""
    src_of = src_of or {}
    tf = _tf()
    renamings, converters = _split(transforms)
    plan = LoadPlan()
    groups: dict[tuple[str, int], tuple[Any, dict[str, list[str]]]] = {}
    renamed_of: dict[str, str] = {}
    for name in sorted(stored, key=_natural_key):
        if name in targets or name in skip:
            continue
        renamed = tf.apply_renamings(name, renamings)
        hit = _match_converter(renamed, converters)
        if hit is None:
            if renamed != name and renamed in targets and renamed not in stored:
                plan.renames[renamed] = name
            continue
        layer, conv, pattern = hit
        renamed_of[name] = renamed
        groups.setdefault((layer, id(conv)), (conv, {}))[1].setdefault(pattern, []).append(name)
    for (layer, _), (conv, by_pattern) in groups.items():
        missing = _missing_keys(conv, by_pattern, renamed_of)
        if missing:
            plan.problems.extend(f"{t}: {why}" for t, why in _targets_of(conv, layer, missing))
            continue
        dtypes = {stored[n][0] for names in by_pattern.values() for n in names}
        if len(dtypes) > 1:
            plan.problems.append(
                f"{layer}: the stored tensors it is made of have different dtypes {sorted(dtypes)}"
            )
            continue
        state: State = {
            p: [Leaf(src_of.get(n, n), stored[n][1], stored[n][0]) for n in names]
            for p, names in by_pattern.items()
        }

        def shape_of(t: str, layer: str = layer, first: str = conv.target_patterns[0]) -> Shape | None:
            return targets.get(layer.replace(first, t))

        try:
            outputs = _convert(conv, layer, state, shape_of)
        except Misfit as e:  # parts that cannot be stacked or concatenated
            full = layer.replace("*.", "0.") if "*." in layer else layer
            plan.problems.append(f"{full}: {e}")
            continue
        for live, node in outputs.items():
            if live not in targets or live in stored:
                continue  # its stored names stay unexpected
            problem = _fit(live, node, targets[live])
            if problem:
                plan.problems.append(problem)
            else:
                plan.built[live] = node
    return plan


def _missing_keys(conv: Any, by_pattern: dict[str, list[str]], renamed_of: dict[str, str]) -> list[str]:
    """The stored keys a converter's group lacks: an expert index absent from one of its patterns
    but found in another, or below the largest found."""
    found: dict[str, dict[int, str]] = {}
    for p in conv.source_patterns:
        rx = _index_re(p)
        if rx is None:
            continue
        found[p] = {}
        for n in by_pattern.get(p, []):
            m = rx.search(renamed_of[n])
            if m:
                found[p][int(m.group(1))] = n
    every = set().union(*(set(v) for v in found.values()))
    if not every:
        return []
    # Indices come from the checkpoint's names: nothing here is sized by the largest one (an index
    # of 10^12 in one name names what is lost, it allocates nothing of that size).
    top = max(every)
    lines = []
    for p, have in found.items():
        if len(have) == top + 1:  # every index 0..top (have holds no other)
            continue
        lost = list(itertools.islice((i for i in range(top + 1) if i not in have), 5))
        if have:
            i0, n0 = next(iter(have.items()))
            m = _index_re(p).search(n0)  # type: ignore[union-attr]
            names = [n0[: m.start(1)] + str(i) + n0[m.end(1) :] for i in lost] if m else []  # type: ignore[union-attr]
            del i0
        else:
            names = []
        listed = ", ".join(shown(n) for n in names[:4]) or f"pattern {shown(p)} index {lost[:4]}"
        lines.append(
            f"expects stored tensors {listed}{' and more' if len(lost) > 4 else ''} (indices 0..{top} of "
            f"{shown(p)}), found indices {shown(sorted(have))}"
        )
    return lines


def _targets_of(conv: Any, layer: str, lines: list[str]) -> list[tuple[str, str]]:
    full = layer.replace("*.", "0.") if "*." in layer else layer
    return [(full, line) for line in lines]


def _fit(live: str, node: Node, want: Shape) -> str:
    if tuple(node.shape) != tuple(want):
        srcs = node.sources()
        listed = ", ".join(shown(s) for s in srcs[:3]) + (
            f" and {len(srcs) - 3} more" if len(srcs) > 3 else ""
        )
        return (
            f"{live}: the mapping builds shape {list(node.shape)} from the stored tensors {listed}, "
            f"the model has shape {list(want)}"
        )
    return ""


# ---------------------------------------------------------------------------- writing
def plan_save(transforms: Sequence[Any], live: dict[str, tuple[str, Shape]]) -> dict[str, Node]:
    """The tensors to write under the stored (Hub) names: stored name -> tree over the live
    tensors ``live`` (name -> (dtype, shape)), through the reverse of ``transforms`` (as
    transformers' ``revert_weight_conversion``: the transforms reversed, in reverse order; at most
    one converter per name first, then every renaming)."""
    tf = _tf()
    reverse = [t.reverse_transform() for t in list(transforms)[::-1]]
    renamings, converters = _split(reverse)
    out: dict[str, Node] = {}
    groups: dict[tuple[str, int], tuple[Any, State]] = {}
    for name in sorted(live, key=_natural_key):
        dtype, shape = live[name]
        hit = _match_converter(name, converters)
        if hit is None:
            out[tf.apply_renamings(name, renamings)] = Leaf(name, tuple(shape), dtype)
            continue
        layer, conv, pattern = hit
        state = groups.setdefault((layer, id(conv)), (conv, {}))[1]
        state.setdefault(pattern, []).append(Leaf(name, tuple(shape), dtype))
    for (layer, _), (conv, state) in groups.items():
        for hub, node in _convert(conv, layer, state, lambda _t: None).items():
            out[tf.apply_renamings(hub, renamings)] = node
    return out


def map_payload(payload: Any, transforms: Sequence[Any]) -> Any:
    """A gathered save's payload (``io.tensors.SavePayload`` of live names) under the stored
    names of ``transforms`` reversed: each stored tensor's local slices are the parts of the live
    slices this rank holds that land in it (an FSDP rank's experts, whole), views, no copy; the
    payload itself when nothing is renamed."""
    import dataclasses

    from unickpt.io.tensors import LocalSlice, global_shape, is_dtensor, st_dtype

    live = {n: (st_dtype(t.dtype, n), tuple(global_shape(t))) for n, t in payload.tensors.items()}
    plan = plan_save(transforms, live)
    if is_identity(plan):
        return payload
    tensors: dict[str, torch.Tensor] = {}
    slices: dict[str, list[LocalSlice]] = {}
    for hub, node in plan.items():
        if isinstance(node, Leaf):
            tensors[hub] = payload.tensors[node.name]
            slices[hub] = [dataclasses.replace(sl, name=hub) for sl in payload.slices[node.name]]
            continue
        out: list[LocalSlice] = []
        for src in dict.fromkeys(node.sources()):
            for sl in payload.slices[src]:
                data = sl.tensor.detach().reshape(sl.shape)
                for o, n, x in node.pieces(src, tuple(sl.offsets), tuple(sl.shape), data):
                    out.append(LocalSlice(hub, node.dtype, tuple(node.shape), o, n, x))
        slices[hub] = out
        if any(is_dtensor(payload.tensors[s]) for s in node.sources()):
            # Known only by its slices; a save that gathers whole tensors refuses it (funnel_save).
            tensors[hub] = torch.empty(
                node.shape, dtype=payload.tensors[node.sources()[0]].dtype, device="meta"
            )
        else:
            whole = {s: payload.tensors[s].detach() for s in node.sources()}

            def view(name: str, o: Shape, n: Shape, whole: dict[str, torch.Tensor] = whole) -> torch.Tensor:
                return whole[name][tuple(slice(a, a + k) for a, k in zip(o, n, strict=True))]

            tensors[hub] = node.build((0,) * len(node.shape), tuple(node.shape), view)
    hub_of = {node.name: hub for hub, node in plan.items() if isinstance(node, Leaf)}
    aliases = {}
    for a, t in payload.aliases.items():
        (hub_a,) = plan_save(transforms, {a: live[t]}) if t in live else (a,)
        aliases[hub_a] = hub_of.get(t, t)
    return dataclasses.replace(payload, tensors=tensors, slices=slices, aliases=aliases)
