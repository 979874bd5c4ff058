"""Loads into device tensors (CUDA): pinned, double-buffered host reads, one copy per chunk.

A block whose target is not in CPU memory cannot be read in place. :class:`DeviceLoader` reads
it a chunk at a time (rows of the box, about :data:`CHUNK_BYTES` each) into one of two host
buffers, pinned (``cudaHostRegister``, exact sizes, leased from the process's pool in
``io/pinned.py`` and kept there for the next load), and copies each chunk to the device with one
``non_blocking`` host-to-device copy on a side stream, so that the copy of one chunk overlaps
the read of the next; a buffer is read into again only once its last copy is done (its event).
A cast (the checkpoint's dtype to the target's) runs on the device, after the copy. The compute
stream waits for the side stream when the load finishes (:meth:`DeviceLoader.close`), and the
host too, so a loaded tensor is ready when the load returns.

On a machine without CUDA the same code copies synchronously from unpinned reused buffers
(what the CPU tests run); a CPU target never comes here (``io/load.py`` reads it in place).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from unickpt.io.pinned import POOL, StagingSet, side_stream

__all__ = ["CHUNK_BYTES", "DeviceLoader", "copy_cast", "off_host"]

#: The bytes of one chunk read and copied at a time (two such host buffers per load).
CHUNK_BYTES = 64 << 20

# read(offsets, shape, out): the box (offsets, shape) of the stored tensor into ``out``, a
# contiguous host tensor of that shape and the stored dtype.
Reader = Callable[[tuple[int, ...], tuple[int, ...], torch.Tensor], object]


def off_host(t: torch.Tensor) -> bool:
    """Whether ``t`` lives on a device (not in CPU memory, not a meta tensor): loaded through
    :class:`DeviceLoader`."""
    return t.device.type not in ("cpu", "meta")


def copy_cast(target: torch.Tensor, data: torch.Tensor) -> None:
    """``target.copy_(data)`` for ``data`` read on the host in the checkpoint's dtype: a device
    target gets the bytes first and casts on the device; a CPU target casts on the CPU."""
    if off_host(target) and data.dtype != target.dtype:
        data = data.to(target.device)
    elif data.dtype != target.dtype:
        data = data.to(target.dtype)
    target.copy_(data.reshape(target.shape))


class _Slot:
    def __init__(self, key: tuple[str, int]) -> None:
        self.key = key
        self.event: Any = None


class DeviceLoader:
    """The reads of one load into device tensors (see the module's docstring). Use it as a
    context manager, or call :meth:`close` (it waits for every copy and hands the buffers back)."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.chunk_bytes = max(1, int(chunk_bytes))
        self._buffers: StagingSet | None = None
        self._slots = [_Slot(("load", 0)), _Slot(("load", 1))]
        self._next = 0
        self._streams: dict[torch.device, Any] = {}
        self.chunks = 0

    def __enter__(self) -> DeviceLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _host(self, slot: _Slot, nbytes: int) -> torch.Tensor:
        """``slot``'s host buffer, at least ``nbytes`` long, free to be read into."""
        if slot.event is not None:
            slot.event.synchronize()  # its last copy to the device is done
            slot.event = None
        if self._buffers is None:
            self._buffers = POOL.lease("load", shared=False)
        return self._buffers.at_least(slot.key, nbytes)

    def _stream(self, device: torch.device) -> Any:
        if device.type != "cuda":
            return None
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = side_stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))  # the target's earlier work first
        return stream

    def load(
        self,
        target: torch.Tensor,
        offsets: tuple[int, ...],
        shape: tuple[int, ...],
        stored: torch.dtype,
        read: Reader,
    ) -> None:
        """Fill ``target`` (``shape``'s elements, any device and dtype) with the box (``offsets``,
        ``shape``) of a stored tensor of dtype ``stored``, read by ``read`` a chunk of rows at a time."""
        target = target.detach()
        n = math.prod(shape)
        if n == 0:
            return
        view = target if tuple(target.shape) == tuple(shape) else None
        if view is None and target.is_contiguous():
            view = target.view(shape)
        itemsize = torch.empty((), dtype=stored).element_size()
        if view is None or len(shape) == 0:  # one chunk: the whole box
            spans = [(0, shape[0] if shape else 0)]
        else:
            row = math.prod(shape[1:]) * itemsize
            step = max(1, self.chunk_bytes // max(1, row))
            spans = [(r, min(r + step, shape[0])) for r in range(0, shape[0], step)]
        stream = self._stream(target.device)
        for r0, r1 in spans:
            cshape = (r1 - r0, *shape[1:]) if shape else ()
            coffs = (offsets[0] + r0, *offsets[1:]) if shape else ()
            nbytes = math.prod(cshape) * itemsize
            slot = self._slots[self._next]
            self._next = 1 - self._next
            host = self._host(slot, nbytes)[:nbytes].view(stored).view(cshape)
            read(coffs, cshape, host)
            dst = view[r0:r1] if view is not None and shape else target
            self._copy(dst, host, stream)
            if stream is not None:
                slot.event = torch.cuda.Event()
                slot.event.record(stream)
            self.chunks += 1

    @staticmethod
    def _copy(dst: torch.Tensor, host: torch.Tensor, stream: Any) -> None:
        if stream is None:  # no CUDA: a synchronous copy (a cast on the CPU)
            copy_cast(dst, host)
            return
        with torch.cuda.stream(stream):
            src = host.reshape(dst.shape)
            if src.dtype != dst.dtype:  # the bytes first, the cast on the device
                src = src.to(dst.device, non_blocking=True)
            dst.copy_(src, non_blocking=True)

    def close(self) -> None:
        """Wait for every copy (the compute streams wait for the side streams, then the host),
        then hand the host buffers back to the pool for the next load."""
        try:
            for device, stream in self._streams.items():
                torch.cuda.current_stream(device).wait_stream(stream)
                stream.synchronize()
        finally:
            self._streams = {}
            for slot in self._slots:
                slot.event = None
            if self._buffers is not None:
                POOL.give_back(self._buffers)
                self._buffers = None
