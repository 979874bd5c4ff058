"""Other tools' checkpoints, told apart from their names and first bytes (pure rules, no I/O).

unickpt reads safetensors files and indexes directly; everything else is read by ``unickpt
convert``. These rules say what a file or directory that is not a unickpt checkpoint holds, so
that the reader's errors name the command that reads it (``inspect``, ``verify``, ``load_model``)
and ``convert`` can choose its importer itself. They look at a file's first bytes and a
directory's listing only, so they apply alike to local paths and URLs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable, Iterable

__all__ = ["Foreign", "foreign_dir", "foreign_file"]

_ZIP = b"PK\x03\x04"
_STEP = re.compile(r"^step-(\d+)$")
_DS_STEP = re.compile(r"^global_step\d+$")
_DS_UCP = re.compile(r"^global_step\d+_universal$")
_DS_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_\d+_mp_rank_\d+_optim_states\.pt$")
_DS_MODEL = re.compile(r"^(zero_pp_rank_\d+_)?mp_rank_\d+_model_states\.pt$")
_BIN = re.compile(r"^pytorch_model(-\d+-of-\d+)?\.bin$")
_DCP_HF = re.compile(r"^shard-\d+-model-\d+-of-\d+\.safetensors$")


@dataclasses.dataclass(frozen=True)
class Foreign:
    """Another tool's checkpoint: what it is, and the ``convert --from`` source that reads it."""

    what: str
    source: str

    def hint(self, path: str) -> str:
        """The sentence an error appends: what ``path`` is and the command that reads it."""
        return f"{path} is {self.what}: read it with `unickpt convert --from {self.source} {path} OUT`"


def foreign_file(first: bytes) -> Foreign | None:
    """A file that is not safetensors, from its first bytes (at least 8 of them, if it has them).

    A safetensors file starts with the little-endian length of its JSON header, whose first
    byte is ``{``; ``torch.save`` writes a zip archive (since torch 1.6) or a bare pickle.
    """
    if first.startswith(_ZIP):
        return Foreign("a PyTorch checkpoint (torch.save: a zip archive), not safetensors", "bin")
    if len(first) >= 2 and first[0] == 0x80 and 2 <= first[1] <= 5:
        return Foreign("a pickle (an old-style torch.save file), not safetensors", "bin")
    return None


def foreign_dir(
    names: Iterable[str], listdir: Callable[[str], Iterable[str]] | None = None
) -> Foreign | None:
    """A directory that holds another tool's checkpoint, from the names it lists.

    ``listdir(name)`` lists one of those names, a subdirectory: it is asked for the latest
    ``step-<N>/`` only (a torchtitan folder's steps are DCP checkpoints), when given.
    """
    listed = set(names)
    steps = sorted((int(m.group(1)), n) for n in listed if (m := _STEP.match(n)))
    below: dict[str, set[str]] = {}
    if steps and listdir is not None:
        latest = steps[-1][1]
        with contextlib.suppress(OSError):
            below[latest] = set(listdir(latest))
    if ".metadata" in listed:
        return Foreign("a PyTorch DCP checkpoint (.metadata and .distcp files)", "dcp")
    if any(_DCP_HF.match(n) for n in listed):
        return Foreign("per-rank files of DCP's HuggingFaceStorageWriter(save_distributed=True)", "dcp")
    if any(".metadata" in below.get(n, ()) for _, n in steps):
        return Foreign("a torchtitan checkpoint folder (step-<N>/ DCP checkpoints)", "dcp")
    if "pytorch_optim.bin.index.json" in listed:
        return Foreign(
            "a Colossal-AI sharded optimizer checkpoint (pytorch_optim.bin.index.json)", "colossalai"
        )
    if any(_DS_OPTIM.match(n) for n in listed) or any(_DS_MODEL.match(n) for n in listed):
        return Foreign("a DeepSpeed checkpoint step (ZeRO rank files)", "deepspeed")
    if "latest" in listed and any(_DS_STEP.match(n) for n in listed):
        return Foreign("a DeepSpeed checkpoint (latest + global_step<N>/)", "deepspeed")
    if "latest_universal" in listed and any(_DS_UCP.match(n) for n in listed):
        return Foreign(
            "a DeepSpeed universal checkpoint (latest_universal + global_step<N>_universal/)", "deepspeed"
        )
    if "pytorch_model.bin.index.json" in listed or any(_BIN.match(n) for n in listed):
        return Foreign("a PyTorch .bin checkpoint (pytorch_model*.bin)", "bin")
    return None
