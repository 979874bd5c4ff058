"""``merge`` and ``convert`` writing the Hub's names: a weight mapping reversed.

transformers 5 holds the experts of an MoE layer fused (``mlp.experts.gate_up_proj``), so a
trained model's unickpt checkpoint carries those names; the Hub (and ``from_pretrained``) keep one
tensor per expert. When the checkpoint's ``config.json`` names a transformers architecture with
a conversion mapping (the one ``from_pretrained`` applies on load), or the caller passes a
mapping, each output tensor is a tree over the checkpoint's tensors (``io/mapping.plan_save``:
an expert ``Select``-ed, its gate or up half ``Narrow``-ed), read box-wise from the stored slices
(only the bytes of that expert) and written whole, one tensor in memory at a time.
"""

from __future__ import annotations

import math
from typing import Any

from unickpt.ckpt.reader import CheckpointReader
from unickpt.errors import ConfigError, IntegrityError
from unickpt.spec.index import LayoutInfo
from unickpt.store.publish import Sink
from unickpt.tools._write import SliceData, TensorData, write_checkpoint

__all__ = ["hub_plan", "hub_tensor_data", "write_mapped", "CASTABLE_DTYPES"]

CASTABLE_DTYPES = ("F16", "BF16", "F32", "F64")


def hub_plan(
    config_json: bytes | None,
    tensors: dict[str, tuple[str, tuple[int, ...]]],
    *,
    mapping: Any,
    hub_names: bool | None,
    aliases: dict[str, str] | None = None,
) -> tuple[dict[str, Any], dict[str, str]] | None:
    """The output tensors (Hub name -> ``io.mapping.Node`` over ``tensors``) and aliases (tied
    names, mapped alike) when names are to be mapped, None when they are written as stored.
    ``hub_names``: None maps when a mapping applies (``mapping``, or the conversion mapping of
    ``config.json``'s transformers architecture); False never; True requires one."""
    if hub_names is False or (mapping is None and config_json is None and not hub_names):
        return None  # nothing to map, and torch stays unimported (inspect, verify, merge alike)
    from unickpt.io.mapping import Leaf, is_identity, mapping_from_config, plan_save

    transforms = None
    if isinstance(mapping, (list, tuple)):
        transforms = list(mapping) or None
    elif mapping is not None:
        raise ConfigError(
            f"mapping must be a list of transformers WeightRenaming/WeightConverter, got {type(mapping).__name__}"
        )
    elif config_json is not None:
        transforms = mapping_from_config(config_json, saving=True)
    if transforms is None:
        if hub_names:
            raise ConfigError(
                "hub_names=True: no weight mapping applies (no mapping given, and no config.json naming a "
                "transformers architecture with a conversion mapping)"
            )
        return None
    plan = plan_save(transforms, tensors)
    if is_identity(plan):
        return None
    if mapping is None and not hub_names and all(isinstance(n, Leaf) for n in plan.values()):
        # Renames alone, no tensor fused: the names may be the Hub's already (a gathered save's
        # output); renaming them again could only go wrong.
        return None
    hub_of = {node.name: hub for hub, node in plan.items() if isinstance(node, Leaf)}
    out_aliases: dict[str, str] = {}
    for a, t in (aliases or {}).items():
        if t in hub_of and t in tensors:
            (hub_a,) = plan_save(transforms, {a: tensors[t]})
            out_aliases[hub_a] = hub_of[t]
    return plan, out_aliases


def write_mapped(
    reader: CheckpointReader,
    plan: dict[str, Any],
    sink: Sink,
    *,
    aliases: dict[str, str] | None = None,
    max_shard_bytes: int,
    out_dtype: str | None,
    verify: bool,
    created_by: str,
    progress: Any = None,
) -> None:
    """Write the tensors of ``plan`` (Hub name -> tree over ``reader``'s tensors) as a gathered
    checkpoint into ``sink`` (a tool's output: ``store.publish.Sink``): each read box-wise from the
    stored slices when its turn comes. ``verify`` checks every stored slice's hash first."""
    import torch

    from unickpt.io.load import box_fetcher
    from unickpt.tools._torch import tensor_bytes, torch_of

    if verify:
        failures = reader.verify()
        if failures:
            raise IntegrityError(failures, reader.index_path or reader.directory)
    fetch, close = box_fetcher(reader)
    try:
        tensors: dict[str, TensorData] = {}
        for name, node in plan.items():
            dtype = out_dtype if out_dtype is not None and node.dtype in CASTABLE_DTYPES else node.dtype
            shape = list(node.shape)

            def data(node: Any = node, dtype: str = dtype) -> Any:
                with torch.no_grad():
                    t = node.build((0,) * len(node.shape), tuple(node.shape), fetch)
                    if dtype != node.dtype:
                        t = t.to(torch_of(dtype))
                    return tensor_bytes(t.contiguous())

            tensors[name] = TensorData(dtype, shape, [SliceData([0] * len(shape), shape, data)])
        layout = reader.block.layout
        write_checkpoint(
            sink,
            tensors,
            sliced=False,
            max_shard_bytes=max_shard_bytes,
            aliases=aliases or None,
            layout=LayoutInfo(plugin=layout.plugin, world_size=layout.world_size, mesh=layout.mesh),
            created_by=created_by,
            progress=progress,
        )
    finally:
        close()


def nbytes(plan: dict[str, Any]) -> int:
    from unickpt.spec.dtypes import itemsize

    return sum(math.prod(n.shape) * itemsize(n.dtype) for n in plan.values())


def hub_tensor_data(
    tensors: dict[str, TensorData], config_json: bytes | None, *, hub_names: bool | None = None
) -> dict[str, TensorData]:
    """``convert``'s whole tensors under the Hub's names when ``config.json``'s transformers
    architecture maps them (``hub_plan``); ``tensors`` itself otherwise. Each output tensor is
    built when it is written, from the source tensors it is made of (the last one kept)."""
    got = hub_plan(
        config_json,
        {n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()},
        mapping=None,
        hub_names=hub_names,
    )
    if got is None:
        return tensors
    plan, _ = got
    import numpy as np
    import torch

    from unickpt.io.mapping import Leaf
    from unickpt.tools._torch import from_bytes, tensor_bytes, torch_of

    last: dict[str, torch.Tensor] = {}

    def whole(name: str) -> torch.Tensor:
        if name not in last:
            last.clear()
            td = tensors[name]
            full = torch.empty(tuple(td.shape), dtype=torch_of(td.dtype))
            for sd in td.slices:
                raw = sd.data() if callable(sd.data) else sd.data
                buf = (
                    np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
                    if isinstance(raw, np.ndarray)
                    else np.frombuffer(memoryview(raw).cast("B"), dtype=np.uint8)
                )
                idx = tuple(slice(o, o + n) for o, n in zip(sd.offsets, sd.shape, strict=True))
                full[idx] = from_bytes(buf.copy(), td.dtype, list(sd.shape))
            last[name] = full
        return last[name]

    def fetch(name: str, off: tuple[int, ...], shp: tuple[int, ...]) -> torch.Tensor:
        return whole(name)[tuple(slice(o, o + n) for o, n in zip(off, shp, strict=True))]

    out: dict[str, TensorData] = {}
    for hub, node in plan.items():
        shape = list(node.shape)

        def data(node: Any = node) -> Any:
            return tensor_bytes(node.build((0,) * len(node.shape), tuple(node.shape), fetch).contiguous())

        extras = tensors[node.name].extras if isinstance(node, Leaf) else {}
        out[hub] = TensorData(node.dtype, shape, [SliceData([0] * len(shape), shape, data)], extras)
    return out
