"""``SavePayload``: what one rank saves in one checkpoint, and its copy into CPU memory."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Any

import torch

from unickpt.io.pinned import stage_copy
from unickpt.io.tensors import LocalSlice

__all__ = ["SavePayload", "Staged", "cpu_copy"]

# A slice's box: (tensor name, offsets, shape).
SliceKey = tuple[str, tuple[int, ...], tuple[int, ...]]


def cpu_copy(src: torch.Tensor, staging: dict[Any, torch.Tensor] | None, key: Hashable) -> torch.Tensor:
    """``src`` copied into a CPU buffer of exactly its size (pinned when ``src`` lives on CUDA:
    ``io.pinned.stage_copy``, registered with ``cudaHostRegister``, never rounded up).

    ``staging`` keeps the buffers between calls under ``key``: one whose shape and dtype still
    match is reused, so a repeated snapshot copies into memory that is already mapped. A copy
    from CUDA is asynchronous; the caller synchronizes once after its last copy.
    """
    return stage_copy(src, staging, key)


@dataclasses.dataclass(frozen=True)
class Staged:
    """What the copy of a ``SavePayload`` into CPU memory holds (``io/stage.py``).

    ``nbytes``: the bytes copied. ``replicated``: the boxes several ranks hold (the only ones the
    replica check digests), ``None`` when every local slice was copied and the check must find
    them itself. ``digests``: xxh3-64 of the replicated slices this rank holds but does not
    write, taken from the live tensors before the save returned (they were not copied).
    """

    nbytes: int
    replicated: frozenset[SliceKey] | None = None
    digests: dict[SliceKey, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class SavePayload:
    """What one rank saves in one checkpoint: its tensors, the local slices it holds, and the extras.

    ``CheckpointIO.plan_model``/``plan_optimizer`` build it from live objects; ``snapshot``
    copies the local slices to CPU memory (an async save writes the copy while training goes
    on); ``CheckpointIO.write`` saves it.
    """

    kind: str
    tensors: dict[str, torch.Tensor]
    slices: dict[str, list[LocalSlice]]
    aliases: dict[str, str] = dataclasses.field(default_factory=dict)
    entry_extras: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    block_extras: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Set on a copy in CPU memory (``snapshot``, ``io.stage.stage_written``): the slices are not
    # the live tensors.
    staged: Staged | None = None

    def snapshot(self, staging: dict[tuple[str, int], torch.Tensor] | None = None) -> SavePayload:
        """A copy whose local slices live in CPU memory (pinned when they come from CUDA).

        ``staging`` keeps the CPU buffers between calls: a caller that snapshots repeatedly
        (the async checkpoint manager, which has one save in flight at most) reuses them, and
        a snapshot is then a plain copy into memory that is already mapped, several times
        faster than allocating fresh buffers each time.
        """
        slices = {
            name: [
                dataclasses.replace(sl, tensor=cpu_copy(sl.tensor, staging, (name, i)))
                for i, sl in enumerate(sls)
            ]
            for name, sls in self.slices.items()
        }
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        nbytes = sum(sl.tensor.nbytes for sls in slices.values() for sl in sls)
        return dataclasses.replace(self, slices=slices, staged=Staged(nbytes))
