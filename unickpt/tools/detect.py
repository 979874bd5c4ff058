"""What ``convert`` reads at a path when ``--from`` is not given (local paths and URLs alike).

The rules are ``ckpt/foreign.py``'s, over one listing of the path (and of its latest
``step-<N>/``), or over the first bytes of a single file; nothing else is read.
"""

from __future__ import annotations

import os

from unickpt.ckpt.foreign import foreign_dir, foreign_file
from unickpt.errors import UnsupportedError
from unickpt.spec.naming import index_name, single_name
from unickpt.store.storage import open_storage

__all__ = ["detect_source"]


def detect_source(src: str | os.PathLike[str]) -> str:
    """The ``convert --from`` source of the checkpoint at ``src`` (``dcp``, ``bin``,
    ``colossalai``, ``deepspeed``); ``UnsupportedError`` naming what was found otherwise."""
    storage, root = open_storage(src)
    shown = os.fspath(src)
    names = storage.listdir(root)
    if names:
        ours = {index_name(k) for k in ("model", "optimizer")} | {
            single_name(k) for k in ("model", "optimizer")
        }
        if ours & set(names):
            raise UnsupportedError(
                f"convert: {shown} is already a unickpt / Hugging Face safetensors checkpoint: "
                "`unickpt merge` gathers it, `unickpt convert --to dcp` exports it to DCP"
            )
        found = foreign_dir(names, lambda n: storage.listdir(storage.join(root, n)))
    elif storage.exists(root):
        handle = storage.open_read(root)
        try:
            found = foreign_file(handle.pread(0, 16))
        finally:
            handle.close()
    else:
        raise UnsupportedError(f"convert: {shown} does not exist")
    if found is None:
        raise UnsupportedError(
            f"convert: cannot tell what {shown} holds (no DCP .metadata, pytorch_model*.bin, DeepSpeed "
            "rank files or Colossal-AI optimizer index); give --from (dcp, bin, colossalai or deepspeed)"
        )
    return found.source
