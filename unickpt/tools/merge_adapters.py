"""``unickpt merge --merge-adapters``: a ``PeftModel``'s LoRA run merged into base-model weights.

The checkpoint of a ``PeftModel`` (saved under any layout) names its tensors as the
``PeftModel`` does: ``base_model.model.<module>.base_layer.weight``,
``<module>.lora_A.<adapter>.weight``, ``<module>.modules_to_save.<adapter>.weight``... This
merge writes a plain Hugging Face checkpoint of the base architecture: every LoRA layer's
weight becomes ``W + delta`` with delta computed as peft's ``lora.Linear.get_delta_weight``
computes it (``transpose(B @ A, fan_in_fan_out) * scaling``, in fp32 for fp16/bf16 weights, as
peft does on CPU) and added in place as ``merge_and_unload`` adds it, so the output equals
peft's merged model bit for bit. ``scaling`` is ``lora_alpha / r`` (``lora_alpha / sqrt(r)``
with ``use_rslora``), with ``rank_pattern``/``alpha_pattern`` matched per module as peft's
``get_pattern_key`` matches them (the same expression, run by the ``regex`` module under a
deadline: the patterns are the file's). The adapter config is the checkpoint's ``adapter_config.json``
(``save_model`` of a ``PeftModel`` writes it) or the one given.

Tensors are read, merged and written one at a time (``_write.write_checkpoint`` asks for each
one's bytes when it writes it): peak memory is about one base weight, its delta and its two
LoRA factors. Every slice's xxh3 is checked as it is read (``verify``). Adapters other than
plain LoRA on linear layers (DoRA, LoRA biases, embedding or convolution LoRA, other peft
methods) are refused before anything is written, naming the tensor or the config field.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from unickpt.ckpt.reader import CheckpointReader, open_checkpoint
from unickpt.errors import ConfigError, IntegrityError, IntegrityFailure, StateMismatchError, UnsupportedError
from unickpt.io.adapters import ADAPTER_CONFIG, read_adapter_config
from unickpt.spec.hashing import SliceHasher
from unickpt.spec.index import LayoutInfo, TensorEntry
from unickpt.spec.naming import HF_SIDE_FILES, shown
from unickpt.store.publish import output_location, output_sink
from unickpt.store.storage import open_storage, parent_location, url_options
from unickpt.tools._common import read_side_files
from unickpt.tools._progress import progress_bar
from unickpt.tools._write import SliceData, TensorData, write_checkpoint

__all__ = ["merge_adapters"]

PREFIX = "base_model.model."
# The LoraConfig fields whose non-default values change what a merge computes, with a value
# that the merge supports; any other value is refused by name.
_REFUSED: dict[str, Callable[[Any], bool]] = {
    "use_dora": bool,
    "lora_bias": bool,
    "layer_replication": bool,
    "target_parameters": bool,
    "alora_invocation_tokens": lambda v: v is not None,
    "trainable_token_indices": lambda v: v is not None,
}
# Names of tensors a LoRA adapter of linear layers never has, which a plain merge cannot handle.
_OTHER_ADAPTER_TENSOR = re.compile(
    r"\.(lora_magnitude_vector|lora_embedding_[AB]|trainable_tokens_\w+|lora_\w+)(\.|$)"
)
_LORA = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.(?P<adapter>[^.]+)\.(?P<param>[^.]+)$")
_BASE = re.compile(r"^(?P<module>.+)\.base_layer\.(?P<param>[^.]+)$")
_SAVED = re.compile(r"^(?P<module>.+)\.modules_to_save\.(?P<adapter>[^.]+)\.(?P<rest>.+)$")
_ORIGINAL = re.compile(r"^(?P<module>.+)\.original_module\.(?P<rest>.+)$")


@dataclass
class _Plan:
    """Output name -> source tensor name; LoRA factors by module; the aliases to keep."""

    out: dict[str, str] = field(default_factory=dict)
    lora: dict[str, dict[str, str]] = field(default_factory=dict)
    adapters: set[str] = field(default_factory=set)


def _config_dict(
    adapter_config: Any, src: str, storage_options: dict[str, Any] | None
) -> tuple[dict[str, Any], str]:
    """The adapter config as a dict, and where it came from."""
    if adapter_config is None:
        directory = src.rstrip("/")
        storage, root = open_storage(directory, storage_options)
        if storage.is_file(root):  # a single file: its directory's config
            directory = parent_location(directory)
        where = f"{directory}/{ADAPTER_CONFIG}"
        return read_adapter_config(directory, storage_options), where
    if isinstance(adapter_config, (str, os.PathLike)):
        p = os.fspath(adapter_config)
        if os.path.isdir(p):
            return read_adapter_config(p), os.path.join(p, ADAPTER_CONFIG)
        return read_adapter_config(os.path.dirname(p) or ".") if os.path.basename(
            p
        ) == ADAPTER_CONFIG else _read_json(p), p
    if isinstance(adapter_config, dict):
        return dict(adapter_config), "the adapter_config argument"
    to_dict = getattr(adapter_config, "to_dict", None)  # a peft PeftConfig
    if callable(to_dict):
        return dict(to_dict()), f"the {type(adapter_config).__name__} given"
    raise ConfigError(
        f"merge --merge-adapters: adapter_config must be a path, a dict or a peft PeftConfig, not {type(adapter_config).__name__}"
    )


def _read_json(path: str) -> dict[str, Any]:
    from unickpt.errors import IndexFileError

    try:
        with open(path, "rb") as f:
            obj = json.loads(f.read(1 << 20))
    except FileNotFoundError:
        raise ConfigError(f"merge --merge-adapters: no adapter config at {path}") from None
    except ValueError as e:
        raise IndexFileError(f"{path}: adapter config is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise IndexFileError(f"{path}: adapter config must be a JSON object")
    return obj


def _check_config(cfg: dict[str, Any], where: str) -> None:
    peft_type = cfg.get("peft_type")
    peft_type = getattr(peft_type, "value", peft_type)
    if peft_type != "LORA":
        raise UnsupportedError(
            f"merge --merge-adapters: {where}: peft_type is {shown(peft_type)}; only LoRA adapters ('LORA') are merged"
        )
    for key, refused in _REFUSED.items():
        if key in cfg and refused(cfg[key]):
            raise UnsupportedError(
                f"merge --merge-adapters: {where}: {key}={shown(cfg[key])} is not supported "
                "(only plain LoRA of linear layers is merged); merge it with peft's merge_and_unload"
            )
    for key in ("r", "lora_alpha"):
        v = cfg.get(key)
        if not _positive(v):
            raise ConfigError(
                f"merge --merge-adapters: {where}: {key} must be a positive number, found {shown(v)}"
            )
    for key in ("rank_pattern", "alpha_pattern"):
        patterns = cfg.get(key) or {}
        if not isinstance(patterns, dict):
            raise ConfigError(
                f"merge --merge-adapters: {where}: {key} must be an object of patterns, found {shown(patterns)}"
            )
        for pattern, v in patterns.items():
            if not _positive(v):
                raise ConfigError(
                    f"merge --merge-adapters: {where}: {key}[{shown(pattern)}] must be a positive number, "
                    f"found {shown(v)}"
                )


def _positive(v: Any) -> bool:
    """A positive number as JSON gives one (``true`` is not one)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0


#: Seconds one rank_pattern/alpha_pattern regular expression may take to match a module name (the
#: patterns are the file's: a nested quantifier backtracks exponentially in ``re``).
PATTERN_SECONDS = 1.0


def _pattern_key(patterns: list[str], module: str, where: str) -> str:
    """peft's ``get_pattern_key`` (the first pattern that matches the end of ``module`` after a dot,
    else ``module`` itself) with the ``regex`` module under a deadline: a pattern that is not a
    regular expression, or one that takes longer than ``PATTERN_SECONDS`` on a name, is refused."""
    import regex

    for pattern in patterns:
        try:
            hit = regex.match(rf"(.*\.)?({pattern})$", module, timeout=PATTERN_SECONDS)
        except regex.error as e:
            raise ConfigError(
                f"merge --merge-adapters: {where}: pattern {shown(pattern)} is not a regular expression ({e})"
            ) from None
        except TimeoutError:
            raise UnsupportedError(
                f"merge --merge-adapters: {where}: pattern {shown(pattern)} took over {PATTERN_SECONDS:g} s to "
                f"match module {shown(module)}"
            ) from None
        if hit:
            return pattern
    return module


def _plan(names: list[str], src: str) -> _Plan:
    plan = _Plan()
    outside = [n for n in names if not n.startswith(PREFIX)]
    if outside:
        raise UnsupportedError(
            f"merge --merge-adapters: {src} is not a PeftModel's checkpoint: {len(outside)} tensor(s) are not "
            f"under {shown(PREFIX)} ({', '.join(shown(n) for n in outside[:3])})"
        )
    for n in names:
        rest = n[len(PREFIX) :]
        m = _LORA.match(rest)
        if m is not None:
            if m["param"] != "weight":
                raise UnsupportedError(
                    f"merge --merge-adapters: tensor {shown(n)} is a LoRA {m['param']} (lora_bias); only LoRA weights are merged"
                )
            plan.adapters.add(m["adapter"])
            plan.lora.setdefault(m["module"], {})[m["ab"]] = n
            continue
        other = _OTHER_ADAPTER_TENSOR.search(rest)
        if other is not None:
            kind = "DoRA" if other[1] == "lora_magnitude_vector" else other[1]
            raise UnsupportedError(
                f"merge --merge-adapters: tensor {shown(n)} belongs to a {kind} adapter, which merge does not support; "
                "only plain LoRA of linear layers is merged"
            )
        if _ORIGINAL.match(rest):
            continue  # modules_to_save's frozen copy: the trained one replaces it
        m = _SAVED.match(rest)
        if m is not None:
            plan.adapters.add(m["adapter"])
            target = f"{m['module']}.{m['rest']}"
        else:
            m = _BASE.match(rest)
            target = f"{m['module']}.{m['param']}" if m is not None else rest
        if target in plan.out:
            raise UnsupportedError(
                f"merge --merge-adapters: tensors {shown(plan.out[target])} and {shown(n)} both become {shown(target)}"
            )
        plan.out[target] = n
    if len(plan.adapters) > 1:
        raise UnsupportedError(
            f"merge --merge-adapters: {src} holds several adapters ({sorted(plan.adapters)}); merge one adapter's run"
        )
    for module, ab in plan.lora.items():
        for part in ("A", "B"):
            if part not in ab:
                raise StateMismatchError(
                    f"merge --merge-adapters: {src}: module {shown(module)} has lora_{'B' if part == 'A' else 'A'} but no lora_{part}",
                    missing=[f"{PREFIX}{module}.lora_{part}"],
                )
        if f"{module}.weight" not in plan.out:
            raise StateMismatchError(
                f"merge --merge-adapters: {src}: LoRA module {shown(module)} has no base weight ({PREFIX}{module}.base_layer.weight)",
                missing=[f"{PREFIX}{module}.base_layer.weight"],
            )
    return plan


def _read_whole(reader: CheckpointReader, name: str, verify: bool, src: str) -> Any:
    """The tensor ``name`` whole, as a torch tensor, each slice hash checked when ``verify``.

    A slice that is the whole tensor is read straight into the tensor's memory; others are read
    one at a time and copied into their box."""
    import torch

    from unickpt.io.tensors import torch_dtype

    entry: TensorEntry = reader.tensors[name]
    dt = torch_dtype(entry.dtype)
    full = _mapped_empty(tuple(entry.shape), dt)
    table = entry.table
    for k in range(len(table)):
        offsets, shape = table.box(k)
        file, key, xxh3 = table.file(k), table.key(k), table.xxh3(k)
        whole = shape == list(entry.shape)
        target = full if whole else _mapped_empty(tuple(shape), dt)
        if target.numel():
            raw = memoryview(target.view(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
            reader.read_key(file, key, raw)
            if verify and xxh3 is not None:
                h = SliceHasher()
                h.update(raw)
                if h.hexdigest() != xxh3:
                    raise IntegrityError([IntegrityFailure(name, file, key, xxh3, h.hexdigest())], src)
        if not whole:
            full[tuple(slice(o, o + n) for o, n in zip(offsets, shape, strict=True))] = target
    return full


def _mapped_empty(shape: tuple[int, ...], dtype: Any) -> Any:
    """An uninitialised CPU tensor in its own anonymous memory map, unmapped when the tensor goes.

    Every tensor of a merge is allocated once and freed once; from the C heap, the heap would
    keep the freed memory of the large tensors (glibc raises its mmap threshold after the first
    frees), and the process would grow to about the checkpoint's size. A mapping of its own
    gives each tensor's memory back to the system as soon as the writer has hashed it.
    """
    import mmap

    import torch

    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if nbytes < (1 << 20):
        return torch.empty(shape, dtype=dtype)
    buf = np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)
    return torch.from_numpy(buf).view(dtype).reshape(shape)


def merge_adapters(
    src: str,
    out: str,
    *,
    adapter_config: Any = None,
    max_shard_size: int | str = "5GB",
    out_dtype: str | None = None,
    verify: bool = True,
    progress: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> str:
    """Merge the LoRA run at ``src`` (a ``PeftModel``'s unickpt checkpoint, any layout) into a
    plain Hugging Face checkpoint of the base architecture at ``out``; returns ``out``.

    ``adapter_config``: the adapter's config when ``src`` has no ``adapter_config.json``: a
    path (the file or its directory), a dict, or the peft model's ``PeftConfig``
    (``model.peft_config["default"]``). ``out_dtype``: the safetensors dtype ("BF16", "F16",
    "F32") floating-point tensors are cast to after the merge. The rest is as
    :func:`~unickpt.tools.merge.merge_checkpoint` (which calls this for ``merge_adapters=True``).
    """
    import torch
    from huggingface_hub.serialization._base import parse_size_to_int

    from unickpt.tools._torch import tensor_bytes, torch_of

    out_s = output_location(out, storage_options)
    opts = url_options(src, storage_options)
    cfg, where = _config_dict(adapter_config, src, opts)
    _check_config(cfg, where)
    reader = open_checkpoint(src, "model", storage_options=opts)
    try:
        reader.check_coverage()
        plan = _plan(list(reader.tensors), src)
        fan_in_fan_out = bool(cfg.get("fan_in_fan_out", False))
        use_rslora = bool(cfg.get("use_rslora", False))
        rank_pattern = cfg.get("rank_pattern") or {}
        alpha_pattern = cfg.get("alpha_pattern") or {}

        def scaling(module: str, name_a: str) -> float:
            r = rank_pattern.get(_pattern_key(list(rank_pattern), module, where), cfg["r"])
            alpha = alpha_pattern.get(_pattern_key(list(alpha_pattern), module, where), cfg["lora_alpha"])
            stored = reader.tensors[name_a].shape[0]
            if stored != r:
                raise StateMismatchError(
                    f"merge --merge-adapters: tensor {shown(name_a)} has rank {stored}, but {where} gives module "
                    f"{shown(module)} r={r}",
                    mismatched=[name_a],
                )
            return float(alpha / math.sqrt(r) if use_rslora else alpha / r)

        lora_of = {f"{m}.weight": m for m in plan.lora}
        scales = {m: scaling(m, ab["A"]) for m, ab in plan.lora.items()}

        def merged(name: str) -> Any:
            w = _read_whole(reader, plan.out[name], verify, src)
            module = lora_of.get(name)
            if module is not None:
                ab = plan.lora[module]
                a = _read_whole(reader, ab["A"], verify, src)
                b = _read_whole(reader, ab["B"], verify, src)
                # peft's lora.Linear.get_delta_weight, then merge()'s in-place add.
                lora_dtype = b.dtype
                cast = lora_dtype in (torch.float16, torch.bfloat16)
                if cast:
                    a, b = a.float(), b.float()
                delta = _mapped_empty((b.shape[0], a.shape[1]), b.dtype)
                torch.matmul(b, a, out=delta)  # ``b @ a``, into memory of its own
                del a, b
                if fan_in_fan_out:
                    delta = delta.T
                delta.mul_(scales[module])  # peft's ``* scaling``, in place: the same products
                if cast:
                    delta = delta.to(dtype=lora_dtype)
                if tuple(delta.shape) != tuple(w.shape):
                    raise StateMismatchError(
                        f"merge --merge-adapters: module {shown(module)}: B @ A is {list(delta.shape)}"
                        f"{' transposed (fan_in_fan_out)' if fan_in_fan_out else ''}, the base weight "
                        f"{shown(plan.out[name])} {list(w.shape)}",
                        mismatched=[plan.out[name]],
                    )
                w += delta
            if out_dtype is not None and w.is_floating_point() and torch_of(out_dtype) != w.dtype:
                cast = _mapped_empty(tuple(w.shape), torch_of(out_dtype))
                cast.copy_(w)  # ``w.to(dtype)``
                w = cast
            return w

        tensors: dict[str, TensorData] = {}
        for name, source in plan.out.items():
            e = reader.tensors[source]
            st = e.dtype
            if out_dtype is not None and st in ("F16", "BF16", "F32", "F64"):
                st = out_dtype
            tensors[name] = TensorData(
                st,
                list(e.shape),
                [SliceData([0] * len(e.shape), list(e.shape), _lazy(merged, name, tensor_bytes))],
            )
        aliases = {}
        back = {v: k for k, v in plan.out.items()}
        for alias, target in reader.block.aliases.items():
            a_out = _out_name(alias)
            t_out = back.get(target)
            if a_out is not None and t_out is not None and a_out not in tensors:
                aliases[a_out] = t_out
        total = sum(t.nbytes for t in reader.block.tensors.values())
        layout = reader.block.layout
        with (
            output_sink(out_s, storage_options) as sink,
            progress_bar(total, "merge --merge-adapters", progress) as update,
        ):
            write_checkpoint(
                sink,
                tensors,
                sliced=False,
                max_shard_bytes=max_shard_size
                if isinstance(max_shard_size, int)
                else int(parse_size_to_int(max_shard_size)),
                aliases=aliases or None,
                layout=LayoutInfo(plugin=layout.plugin, world_size=layout.world_size),
                created_by=f"unickpt merge --merge-adapters (from {layout.plugin} x{layout.world_size})",
                progress=update,
            )
            for fname, data in read_side_files(reader.directory, list(HF_SIDE_FILES), opts):
                sink.put(fname, data)
        return out_s
    finally:
        reader.close()


def _out_name(name: str) -> str | None:
    """The output name of a source alias (None for a LoRA factor or a frozen modules_to_save copy)."""
    if not name.startswith(PREFIX):
        return None
    rest = name[len(PREFIX) :]
    if _LORA.match(rest) or _ORIGINAL.match(rest) or _OTHER_ADAPTER_TENSOR.search(rest):
        return None
    m = _SAVED.match(rest)
    if m is not None:
        return f"{m['module']}.{m['rest']}"
    m = _BASE.match(rest)
    return f"{m['module']}.{m['param']}" if m is not None else rest


def _lazy(
    fn: Callable[[str], Any], name: str, to_bytes: Callable[[Any], np.ndarray]
) -> Callable[[], np.ndarray]:
    return lambda: to_bytes(fn(name))
