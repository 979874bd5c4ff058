"""Asynchronous saves of ``CheckpointIO`` (``save_model(..., use_async=True)``), and Colossal-AI's flags.

An async save plans and copies in the foreground, then writes in a background thread, the way
``CheckpointManager(async_save=True)`` does: the save returns once this rank's data is copied
to CPU memory (training may then change the live tensors), and a thread writes, hashes,
fsyncs and commits the copy. The thread talks to the other ranks only through a second gloo
process group made once per ``CheckpointIO`` (``dist.new_group``), never through the
training's group. One save is in flight at most per ``CheckpointIO``: every later save or load
through it, and ``CheckpointIO.wait()``, first waits for it and raises its error, if any.

The copy depends on the layout asked for:

- sliced (``gather_dtensor=False``): each rank's blocks, as the manager's async save copies them;
- gathered (the default): the full tensor of each name (``DTensor.full_tensor()``, a collective
  on its mesh, run in the foreground), kept only by the one rank that writes or sends it (the
  lowest rank holding the name), so a replicated model costs one copy, on rank 0.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from unickpt._logging import get_logger
from unickpt.errors import UnickptError
from unickpt.format.commit_store import checkpoint_directory, write_small_file
from unickpt.format.naming import single_name
from unickpt.format.storage import is_url
from unickpt.io import _dist
from unickpt.io.tensors import is_dtensor, local_boxes

if TYPE_CHECKING:
    from unickpt.io.checkpoint_io import SavePayload
    from unickpt.io.save import SaveOptions

__all__ = [
    "AsyncSaveMixin",
    "AsyncSaves",
    "gathered_snapshot",
    "check_use_safetensors",
    "SafetensorsOnlyWarning",
]

logger = get_logger(__name__)


class SafetensorsOnlyWarning(UserWarning):
    """``use_safetensors=False`` was passed: unickpt writes safetensors regardless."""


def check_use_safetensors(use_safetensors: bool | None, method: str) -> None:
    """Colossal-AI's ``use_safetensors``: ``True``/``None`` need nothing; ``False`` is explained.

    Colossal-AI writes pickled ``.bin`` files when it is False (its default). unickpt never
    writes pickles: a pickle runs code when it is loaded, cannot be read a slice at a time, and
    has no place for the hashes and fingerprints that ``verify`` and ``diff`` use. The save goes
    ahead in safetensors, and this warning says so.
    """
    if use_safetensors is None or use_safetensors:
        return
    warnings.warn(
        f"{method}(use_safetensors=False): unickpt always writes safetensors (never pickled .bin files: "
        "a pickle executes code when loaded, cannot be read one slice at a time, and has no room for the "
        "slice hashes and fingerprints); saving as safetensors. transformers, huggingface_hub and "
        "Colossal-AI's loaders (given a directory or a .safetensors path) read the result. Pass "
        "use_safetensors=True (or omit it) to silence this.",
        SafetensorsOnlyWarning,
        stacklevel=3,
    )


class AsyncSaves:
    """The background save in flight of one ``CheckpointIO`` (at most one), and its process group."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._errors: list[BaseException] = []
        self._bg_group: Any = None
        self._made_group = False
        # CPU buffers of the snapshots, reused by the next save of the same kind and layout (one
        # save is in flight at most): copying into memory already mapped is several times
        # faster than into fresh allocations. Kept for the IO's lifetime, as Colossal-AI keeps
        # its pinned state dicts.
        self.staging: dict[tuple[str, bool], dict[Any, torch.Tensor]] = {}
        # A process that exits with a save in flight finishes it first (like Colossal-AI's
        # CheckpointIO.__del__); the thread holds no reference back to this object.
        self._box: list[threading.Thread] = []
        weakref.finalize(self, _join_all, self._box)

    @property
    def pending(self) -> bool:
        """A save is still being written."""
        return self._thread is not None and self._thread.is_alive()

    def background_group(self, group: Any) -> Any:
        """Collective the first time (every rank of ``group``): the gloo group the thread uses."""
        if not _dist.is_distributed(group):
            return group
        if not self._made_group:
            import torch.distributed as dist

            ranks = None if group is None else dist.get_process_group_ranks(group)
            self._bg_group = dist.new_group(ranks=ranks, backend="gloo")
            self._made_group = True
        return self._bg_group

    def start(self, name: str, work: Callable[[], object]) -> None:
        """Run ``work`` in a background thread; its error is raised by the next :meth:`wait`."""
        if self._thread is not None:  # pragma: no cover - callers wait() first
            raise RuntimeError("internal: an async save is already in flight")

        def run() -> None:
            try:
                work()
            except BaseException as e:  # surfaced by the next wait()
                logger.error("async save %s failed: %s", name, e)
                self._errors.append(e)

        thread = threading.Thread(target=run, name=f"unickpt-async-{name}", daemon=True)
        self._thread = thread
        self._box[:] = [thread]
        thread.start()

    def wait(self) -> None:
        """Block until the save in flight is committed; raise its error, if it failed."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        self._box.clear()
        if self._errors:
            err = self._errors.pop()
            self._errors.clear()
            raise err


def _join_all(box: list[threading.Thread]) -> None:
    for t in box:
        t.join()


def gathered_snapshot(
    tensors: dict[str, torch.Tensor], group: Any, staging: dict[Any, torch.Tensor] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, list[Any]]]:
    """Collective: CPU copies of the full tensors for a gathered save, on the rank that writes each.

    Returns ``(tensors, boxes)`` for a ``SavePayload``. Every rank runs the same loop, so the
    ``full_tensor`` collectives line up as in the synchronous gathered save. ``staging`` keeps
    the buffers for the next call (reused when the name, shape and dtype match).
    """
    names = _dist.all_gather_object(list(tensors), group)
    holder: dict[str, int] = {}
    for r, ns in enumerate(names):
        for n in ns:
            holder.setdefault(n, r)
    me = _dist.rank(group)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        full = t.full_tensor() if is_dtensor(t) else t  # type: ignore[attr-defined]
        if holder[name] == me:
            src = full.detach()
            buf = None if staging is None else staging.get(name)
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=src.device.type == "cuda")
                if staging is not None:
                    staging[name] = buf
            buf.copy_(src, non_blocking=src.device.type == "cuda")
            out[name] = buf
        del full
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, {n: local_boxes(n, t) for n, t in out.items()}


class AsyncSaveMixin:
    """The async half of ``CheckpointIO``: :meth:`wait`, Colossal-AI's names for it, the background write."""

    group: Any

    # Provided by CheckpointIO.
    def write(
        self,
        payload: SavePayload,
        checkpoint: str | os.PathLike[str],
        *,
        shard: bool = True,
        gather_dtensor: bool = True,
        size_per_shard: float = 1024,
        group: Any = None,
    ) -> str:
        raise NotImplementedError

    def _options(self, kind: str, shard: bool, gather: bool, size_mb: float) -> SaveOptions:
        raise NotImplementedError

    @property
    def _async(self) -> AsyncSaves:
        saves: AsyncSaves | None = self.__dict__.get("_async_saves")
        if saves is None:
            saves = self.__dict__["_async_saves"] = AsyncSaves()
        return saves

    def wait(self) -> None:
        """Block until this IO's async save in flight is committed; raise its error, if it failed.

        Every rank calls it. Every save and load through this IO waits first, so a load never
        reads a checkpoint still being written. Colossal-AI's name, ``_sync_io()``, works too.
        """
        self._async.wait()

    def _sync_io(self) -> None:
        """Colossal-AI's name for :meth:`wait`."""
        self.wait()

    def synchronize(self) -> None:
        """Colossal-AI: call before the weights change. An async save copied them before it
        returned, so there is nothing left to wait for."""

    def _sync_d2h(self) -> None:
        """Colossal-AI's name for :meth:`synchronize`."""

    def _write_async(
        self,
        payload: SavePayload,
        checkpoint: str | os.PathLike[str],
        shard: bool,
        gather_dtensor: bool,
        size_per_shard: float,
        after: Callable[[str], None] | None = None,
    ) -> str:
        """Collective: copy ``payload`` to CPU memory now, write and commit the copy in a thread.

        Returns the path the save will commit. ``after(path)`` runs on rank 0 once committed.
        """
        # Bad arguments raise now, not in the thread.
        self._options(payload.kind, shard, gather_dtensor, size_per_shard)
        path = os.fspath(checkpoint)
        final = committed_path(path, payload.kind, shard, gather_dtensor)
        staging = self._async.staging.setdefault((payload.kind, gather_dtensor), {})
        if gather_dtensor:
            tensors, boxes = gathered_snapshot(payload.tensors, self.group, staging)
            copy = dataclasses.replace(payload, tensors=tensors, boxes=boxes)
        else:
            copy = payload.snapshot(staging)
        group = self._async.background_group(self.group)

        def work() -> None:
            written = self.write(
                copy,
                path,
                shard=shard,
                gather_dtensor=gather_dtensor,
                size_per_shard=size_per_shard,
                group=group,
            )
            if after is not None and _dist.rank(group) == 0:
                after(written)

        self._async.start(os.path.basename(path.rstrip("/")) or path, work)
        return final


def committed_path(path: str, kind: str, shard: bool, gather: bool) -> str:
    """The path a save with these arguments commits (what ``save_tensors`` returns)."""
    url = is_url(path)
    is_file = path.endswith(".safetensors") or (not url and os.path.isfile(path))
    if gather and not shard:
        return path if is_file else os.path.join(path, single_name(kind))
    if is_file:
        raise UnickptError(f"{path}: a sharded or sliced checkpoint is a directory; pass a directory path")
    return path if url else os.path.abspath(path)


def write_config_files(
    config: dict[str, str], path: str, storage_options: dict[str, Any] | None = None
) -> None:
    """Write ``config.json``-like files beside the committed checkpoint ``path`` (a URL too)."""
    directory = checkpoint_directory(path)
    for fname, text in config.items():
        write_small_file(os.path.join(directory, fname), text.encode("utf-8"), storage_options)
