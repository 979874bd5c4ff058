"""File names of the format (docs/format.md, section "Files")."""

from __future__ import annotations

import reprlib
from collections.abc import Iterable

__all__ = [
    "shown",
    "INDEX_SUFFIX",
    "SLICED_SENTINEL",
    "index_name",
    "single_name",
    "shard_name",
    "slice_key",
    "slice_keys",
    "parse_slice_key",
    "MAX_INDEX_DIGITS",
    "optimizer_tensor_name",
    "is_own_data_file",
    "HF_SIDE_FILES",
]

# What a Hugging Face loader reads beside the weights: the model's config and its tokenizer's
# and processor's files. Merges and conversions copy those their source has.
HF_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
)

INDEX_SUFFIX = ".safetensors.index.json"
# In a checkpoint that keeps distributed slices, every weight_map entry points at this file,
# which never exists: a Hugging Face loader then fails loudly with a message naming the fix,
# instead of loading a slice as if it were the whole tensor. unickpt reads the slice table.
# Short, since every tensor of a sliced index repeats it (a quarter of the index at 4 ranks).
SLICED_SENTINEL = "run-unickpt-merge-first.safetensors"


def index_name(kind: str) -> str:
    return f"{kind}{INDEX_SUFFIX}"


def single_name(kind: str) -> str:
    return f"{kind}.safetensors"


def shard_name(kind: str, i: int, n: int) -> str:
    """Hugging Face's shard naming, 1-based: ``model-00001-of-00003.safetensors``."""
    return f"{kind}-{i:05d}-of-{n:05d}.safetensors"


def slice_key(name: str, k: int) -> str:
    """Key of the k-th slice of tensor ``name`` inside a sliced (non-gathered) checkpoint."""
    return f"{name}@{k}"


def slice_keys(name: str, ks: Iterable[int]) -> list[str]:
    """:func:`slice_key` of each of the slices ``ks`` of tensor ``name``, formed in bulk."""
    prefix = f"{name}@"
    return [prefix + str(k) for k in ks]


#: The longest digit run read as a number in a name (a slice or an expert index, never a value):
#: no index is larger, and ``int()`` refuses a run of over 4,300 digits.
MAX_INDEX_DIGITS = 18


def parse_slice_key(key: str) -> tuple[str, int] | None:
    """``(name, k)`` of a key :func:`slice_key` writes (``K`` in decimal, no sign, no leading
    zero), else ``None``."""
    name, at, k = key.rpartition("@")
    if not (at and k.isascii() and k.isdigit() and len(k) <= MAX_INDEX_DIGITS) or k != str(int(k)):
        return None
    return name, int(k)


def optimizer_tensor_name(fqn: str, state_key: str) -> str:
    """Name of one optimizer state tensor in an optimizer checkpoint: ``state.<param>.<state>``."""
    return f"state.{fqn}.{state_key}"


def is_own_data_file(kind: str, file_name: str) -> bool:
    """True for names this format writes for ``kind``: left-overs of an older save may be removed."""
    if file_name == single_name(kind):
        return True
    if not (file_name.startswith(kind + "-") and file_name.endswith(".safetensors")):
        return False
    middle = file_name[len(kind) + 1 : -len(".safetensors")]
    parts = middle.split("-of-")
    return len(parts) == 2 and all(p.isdigit() and len(p) >= 5 for p in parts)


SHOWN_CHARS = 200

# Containers are cut before they are formatted: the cost does not grow with their length or depth.
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict, _REPR.maxset = 3, 16, 16, 16, 16
_REPR.maxstring, _REPR.maxother, _REPR.maxlong = SHOWN_CHARS, SHOWN_CHARS, 60


def shown(v: object, limit: int = SHOWN_CHARS) -> str:
    """A name, key, number or shape from a file as a message shows it: ``repr``, printable (escaped
    where it is not: a newline, an ANSI escape, a lone surrogate), cut to about ``limit`` characters
    (a real tensor name is seldom over 150; a hostile one can be a megabyte long, a number thousands
    of digits, a list millions of items)."""
    if type(v) is not str:
        return _REPR.repr(v)
    text = repr(v) if v.isprintable() else ascii(v)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(v)} characters)"
