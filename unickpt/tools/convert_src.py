"""The sources of ``unickpt convert`` on a URL, read in place.

A DCP checkpoint on a store is read through torch's own fsspec reader (``tools.dcp_read``: the
``.metadata`` object with the allowlist unpickler, each data file opened on the store and only
the byte ranges of the entries asked for read); side files are read whole. (``pytorch_model*.bin``
shards, like the DeepSpeed and Colossal-AI files, are read through the storage layer's location
functions, wherever they lie: ``tools.convert``.) Only the per-rank files of
``HuggingFaceStorageWriter(save_distributed=True)`` are fetched into a temporary directory
first: their slice table is in their safetensors headers, which the merge reads locally.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from unickpt.ckpt.dcp_hf import SHARD_FILE
from unickpt.errors import CheckpointFormatError, IncompleteCheckpointError
from unickpt.spec.untrusted import strict_loads
from unickpt.store.storage import FsspecStorage, Storage, open_storage

__all__ = ["StoreSource", "bin_shard_names", "latest_step"]

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


class StoreSource:
    """A DCP checkpoint directory (or a torchtitan folder of them) at ``url``."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        storage, self.root = open_storage(self.url)
        if not isinstance(storage, FsspecStorage):  # never: only URLs come here
            raise IncompleteCheckpointError(f"{url}: not a URL")
        self.storage: Storage = storage
        self.fs: Any = storage.fs
        self._names: list[str] | None = None

    def names(self) -> list[str]:
        if self._names is None:
            self._names = self.storage.listdir(self.root)
        return self._names

    def url_of(self, name: str) -> str:
        return f"{self.url}/{name}"

    def read(self, name: str) -> bytes | None:
        """The side file ``name`` whole, or None when the source has none."""
        if name not in self.names():
            return None
        return self.storage.read_bytes(self.storage.join(self.root, name))

    # ---------------------------------------------------------------- DCP
    def dcp_step(self) -> StoreSource:
        """This source, or for a torchtitan folder of ``step-<N>/`` its latest step."""
        if ".metadata" in self.names():
            return self
        step = latest_step(self.names(), lambda n: ".metadata" in StoreSource(self.url_of(n)).names())
        return self if step is None else StoreSource(self.url_of(step))

    def dcp_hf_files(self) -> list[str]:
        """The per-rank files of a distributed Hugging Face DCP save, or []."""
        if ".metadata" in self.names():
            return []
        return sorted(n for n in self.names() if SHARD_FILE.match(n))

    @contextmanager
    def fetched(self, names: list[str]) -> Iterator[str]:
        """A local temporary directory holding the objects ``names`` of this source."""
        with tempfile.TemporaryDirectory(prefix="unickpt-convert-") as tmp:
            for n in names:
                self.fs.get_file(self.storage.join(self.root, n), os.path.join(tmp, n))
            yield tmp
