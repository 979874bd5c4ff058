"""What ``unickpt convert`` finds in a source directory, wherever it lies: a torchtitan folder's
latest step, the shards a ``pytorch_model.bin.index.json`` names.

A DCP checkpoint is read through torch's own readers (``tools.dcp_read``: the ``.metadata``
object with the allowlist unpickler; on a store each data file opened there and only the byte
ranges of the entries asked for read); ``pytorch_model*.bin`` shards, like the DeepSpeed and
Colossal-AI files, through the storage layer's location functions (``tools.convert``); the
per-rank files of ``HuggingFaceStorageWriter(save_distributed=True)`` by the reader, through
their store (``ckpt.dcp_hf``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

from unickpt.errors import CheckpointFormatError, IncompleteCheckpointError
from unickpt.spec.untrusted import strict_loads

__all__ = ["bin_shard_names", "latest_step"]

STEP_DIR = re.compile(r"^step-(\d+)$")
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"


def latest_step(names: Iterable[str], has_metadata: Callable[[str], bool]) -> str | None:
    """The newest ``step-<N>`` among a torchtitan checkpoint folder's entries ``names`` that holds
    a DCP checkpoint (``has_metadata``, asked newest first), or None."""
    steps = sorted(((int(m.group(1)), n) for n in names if (m := STEP_DIR.match(n))), reverse=True)
    return next((n for _, n in steps if has_metadata(n)), None)


def bin_shard_names(
    where: str, exists: Callable[[str], bool], read: Callable[[str], bytes], label: Callable[[str], str]
) -> list[str]:
    """The ``.bin`` shard file names of the directory ``where``: those its
    ``pytorch_model.bin.index.json`` names (each checked with ``exists``), or ``pytorch_model.bin``.
    ``read`` gives a file's bytes, ``label`` its path for messages."""
    if exists(BIN_INDEX):
        idx = label(BIN_INDEX)
        files = bin_index_names(read(BIN_INDEX), idx)
        for fn in files:
            if not exists(fn):
                raise IncompleteCheckpointError(f"{idx}: names {fn!r}, which is missing")
        return files
    if exists(BIN_SINGLE):
        return [BIN_SINGLE]
    raise IncompleteCheckpointError(f"{where} holds neither {BIN_SINGLE} nor {BIN_INDEX}")


def bin_index_names(raw: bytes, idx: str) -> list[str]:
    """The file names a ``pytorch_model.bin.index.json`` (bytes ``raw``, at ``idx``) maps to, sorted."""
    from unickpt.spec.index import check_file_name

    try:
        obj = strict_loads(raw.decode("utf-8"), CheckpointFormatError, f"{idx}: index")
    except UnicodeDecodeError as e:
        raise CheckpointFormatError(f"{idx}: not a valid pytorch_model.bin.index.json ({e})") from None
    wm = obj.get("weight_map") if isinstance(obj, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise CheckpointFormatError(
            f"{idx}: not a valid pytorch_model.bin.index.json (expected an object with a 'weight_map' "
            "object mapping names to file names)"
        )
    return sorted({check_file_name(fn, idx) for fn in wm.values()})
