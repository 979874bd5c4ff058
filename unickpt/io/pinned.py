"""The process's host buffers for async snapshots: exact sizes, pinned once, reused, released.

An async save copies the slices it writes into host memory (``io/stage.py``) and writes the copy
in the background. ``torch.empty(..., pin_memory=True)`` would take that memory from CUDA's
caching host allocator, which rounds every block up to a power of two (up to twice the state
in pinned memory) and keeps it cached after the tensor dies. Here each buffer is allocated at
its exact size (``torch.empty``, in shared memory when a writer process reads it) and, when
CUDA is present, registered with ``cudaHostRegister`` (as ``torch.distributed.checkpoint``'s
``StateDictStager`` pins its staging) so that device-to-host copies into it are asynchronous.

:data:`POOL` is one per process, shared by every ``CheckpointIO`` and ``CheckpointManager``: a
save leases a :class:`StagingSet` (:meth:`HostPool.lease`), copies into it, and hands it back
when the save is committed or failed (:meth:`HostPool.give_back`); the next save of the same kind
gets the same buffers back (no allocation, no registration when the layout is unchanged). A set
is never leased twice at once: a second save in flight gets a set of its own. When a save hands
its set back, the buffers it did not use are dropped, so the pool holds exactly the bytes of the
last save of each kind. :meth:`HostPool.release` (``unickpt.io.pinned.release()``,
``CheckpointIO.release_staging()``, ``CheckpointManager.release_staging()``) frees every set
not in use (the ones in use go when their save hands them back); the process releases them at
exit too.

:class:`Fence` marks when the copies of a snapshot are done: the copies run on a side CUDA
stream (``io/stage.py``) and the save returns before they finish. Whatever would read the
buffers or change the copied tensors waits first (:func:`wait_staged`): the writer (its
thread, before it hands the job over), every optimizer step (a pre-hook on all optimizers,
installed with the first fence), ``CheckpointIO.synchronize()`` and the next save; and the
forward of a module whose buffers are being copied (:meth:`Fence.guard_forward`, a forward
pre-hook per module, removed once the fence is done). On CPU a fence is complete when the copy
returns (the copy is synchronous), waiting costs nothing, and no forward is hooked.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import threading
import weakref
from collections.abc import Hashable, Iterable
from typing import Any

import torch

from unickpt.errors import UnickptError

__all__ = [
    "POOL",
    "Fence",
    "HostPool",
    "PinningError",
    "StagingSet",
    "host_buffer",
    "pending",
    "release",
    "side_stream",
    "stage_copy",
    "track",
    "wait_staged",
]


class PinningError(UnickptError, RuntimeError):
    """CUDA refused to register (pin) a host buffer of a snapshot."""


def _cuda() -> bool:
    return torch.cuda.is_available()


def _register(t: torch.Tensor) -> None:
    """Pin ``t``'s storage in place (``cudaHostRegister``); unpinned when the storage is freed."""
    storage = t.untyped_storage()
    ptr, n = storage.data_ptr(), storage.nbytes()
    if n == 0:
        return
    cudart = torch.cuda.cudart()
    rc = int(cudart.cudaHostRegister(ptr, n, 1))  # cudaHostRegisterPortable
    if rc != 0:
        raise PinningError(
            f"pinning a snapshot buffer of {n} bytes (shape {list(t.shape)}, {t.dtype}) with "
            f"cudaHostRegister failed with CUDA error {rc}; expected 0 (success). The locked-memory "
            "limit (ulimit -l) or the host's free memory may be too small for the state"
        )

    def unregister(p: int = ptr) -> None:
        with contextlib.suppress(Exception):  # the CUDA context is gone: the process is ending
            torch.cuda.cudart().cudaHostUnregister(p)

    fin = weakref.finalize(storage, unregister)
    fin.atexit = False  # never after the CUDA context is destroyed


def host_buffer(
    shape: torch.Size | tuple[int, ...], dtype: torch.dtype, *, pin: bool, shared: bool
) -> torch.Tensor:
    """A host tensor of exactly ``shape`` and ``dtype`` (no rounding): in shared memory when
    ``shared`` (a writer process maps it), registered with CUDA when ``pin`` and CUDA is present."""
    t = torch.empty(shape, dtype=dtype)
    if shared and t.untyped_storage().nbytes():
        t.untyped_storage()._share_fd_cpu_()
    if pin and _cuda():
        _register(t)
    return t


class StagingSet(dict[Any, torch.Tensor]):
    """The host buffers of one kind of snapshot (key -> tensor), leased from :data:`POOL`.

    A plain dict to the code that copies into it (``io/stage.py``, ``funnel_save``); it
    records which keys the current save used (:meth:`get` and assignment), so that the buffers
    of a layout no longer saved are dropped when the set is handed back.
    """

    def __init__(self, tag: Hashable, shared: bool) -> None:
        super().__init__()
        self.tag = tag
        self.shared = shared
        self.allocations = 0
        self.used: set[Hashable] = set()
        self.leased = False
        self.dropped = False

    # A set is itself, not its contents: two sets of equal keys are never equal (and their
    # tensors are never compared).
    def __eq__(self, other: object) -> bool:
        return self is other

    def __ne__(self, other: object) -> bool:
        return self is not other

    __hash__ = object.__hash__  # type: ignore[assignment]

    def get(self, key: Any, default: Any = None) -> Any:  # a dict's get, noting the key as used
        self.used.add(key)
        return super().get(key, default)

    def __setitem__(self, key: Any, value: torch.Tensor) -> None:
        self.used.add(key)
        super().__setitem__(key, value)

    def buffer(self, key: Hashable, src: torch.Tensor) -> torch.Tensor:
        """The buffer under ``key`` for a copy of ``src``: the one held if its shape and dtype
        match, else a new one of exactly ``src``'s size (pinned when ``src`` is on CUDA)."""
        self.used.add(key)
        held: torch.Tensor | None = super().get(key)
        if held is not None and held.shape == src.shape and held.dtype == src.dtype:
            return held
        buf = host_buffer(src.shape, src.dtype, pin=src.device.type == "cuda", shared=self.shared)
        self[key] = buf
        self.allocations += 1
        return buf

    def at_least(self, key: Hashable, nbytes: int) -> torch.Tensor:
        """A pinned (on CUDA) byte buffer under ``key`` of ``nbytes`` or more: the one held if it
        is long enough, else a new one of exactly ``nbytes``. For bounded read and copy buffers
        (a load's chunks, a digest's), which the caller slices."""
        self.used.add(key)
        held: torch.Tensor | None = super().get(key)
        if held is not None and held.numel() >= nbytes:
            return held
        buf = host_buffer((nbytes,), torch.uint8, pin=True, shared=self.shared)
        self[key] = buf
        self.allocations += 1
        return buf

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers."""
        return sum(t.untyped_storage().nbytes() for t in self.values())

    def prune(self) -> None:
        """Drop the buffers the save just made did not use (a layout no longer saved)."""
        for key in [k for k in self if k not in self.used]:
            super().pop(key)


class HostPool:
    """Every snapshot buffer set of the process (see the module's docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sets: list[StagingSet] = []

    def lease(self, tag: Hashable, *, shared: bool) -> StagingSet:
        """A set for a snapshot of ``tag`` (its kind), in shared memory when ``shared``: the free
        one of that tag and memory kind if there is one, else a new one. Hand it back with
        :meth:`give_back` once the save no longer reads it."""
        with self._lock:
            for s in self._sets:
                if s.tag == tag and s.shared == shared and not s.leased:
                    break
            else:
                s = StagingSet(tag, shared)
                self._sets.append(s)
            s.leased = True
            s.used = set()
            return s

    def give_back(self, staging: StagingSet) -> None:
        """The save using ``staging`` is over (committed or failed): its unused buffers are
        dropped and the set waits for the next save of its kind (or goes, if released since)."""
        with self._lock:
            if staging.used:
                staging.prune()
            staging.leased = False
            if staging.dropped:
                staging.clear()
                self._drop(staging)

    def _drop(self, staging: StagingSet) -> None:
        staging.dropped = True
        self._sets = [s for s in self._sets if s is not staging]

    def release(self) -> int:
        """Free the buffers of every set no save is using (unpinned once nothing else holds them);
        a set in use goes when its save hands it back. Returns the bytes freed now."""
        with self._lock:
            freed = 0
            for s in list(self._sets):
                s.dropped = True
                if not s.leased:
                    freed += s.nbytes
                    s.clear()
                    self._drop(s)
            return freed

    @property
    def nbytes(self) -> int:
        """Bytes held by every set of the pool."""
        with self._lock:
            return sum(s.nbytes for s in self._sets)

    @property
    def allocations(self) -> int:
        """Buffers allocated by the sets the pool holds, since each was made."""
        with self._lock:
            return sum(s.allocations for s in self._sets)

    def sets(self) -> list[StagingSet]:
        """The sets held now (in use or free)."""
        with self._lock:
            return list(self._sets)


#: The process's pool, shared by every IO and manager.
POOL = HostPool()


def release() -> int:
    """Free the snapshot buffers no save in flight uses (``POOL.release()``); the bytes freed."""
    return POOL.release()


atexit.register(POOL.release)


def stage_copy(src: torch.Tensor, staging: dict[Any, torch.Tensor] | None, key: Hashable) -> torch.Tensor:
    """``src`` copied into a host buffer of exactly its size (pinned when ``src`` is on CUDA).

    ``staging`` keeps the buffers between calls under ``key`` (a :class:`StagingSet` of
    :data:`POOL` or a plain dict). The copy from CUDA is issued ``non_blocking`` on the current
    stream: the caller waits for it (a :class:`Fence`, or a synchronize) before reading it.
    """
    src = src.detach()
    if isinstance(staging, StagingSet):
        buf = staging.buffer(key, src)
    else:
        held = None if staging is None else staging.get(key)
        if held is not None and held.shape == src.shape and held.dtype == src.dtype:
            buf = held
        else:
            buf = host_buffer(src.shape, src.dtype, pin=src.device.type == "cuda", shared=False)
            if staging is not None:
                staging[key] = buf
    if math.prod(src.shape):
        buf.copy_(src, non_blocking=src.device.type == "cuda")
    return buf


# ---------------------------------------------------------------------------- fences
class Fence:
    """The end of a snapshot's copies: the CUDA events recorded after them on their streams, or,
    without CUDA, a CPU-side event, set once the (synchronous) copy is done (:meth:`complete`).

    :meth:`guard_forward` makes the forward of modules whose buffers are being copied wait for
    it; those hooks are removed once the fence is done.
    """

    def __init__(self, cuda_events: list[Any] | None = None) -> None:
        self._events = list(cuda_events or ())
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._hooks: list[Any] = []

    def complete(self) -> None:
        """The copies are done (a CUDA fence completes with its events, when waited for)."""
        self._finish()

    def done(self) -> bool:
        """Whether waiting would return at once."""
        if not self._done.is_set() and self._events and all(e.query() for e in self._events):
            self._finish()
        return self._done.is_set()

    def wait(self) -> None:
        """Block until the copies are done."""
        if self._done.is_set():
            return
        if self._events:
            for e in self._events:
                e.synchronize()
            self._finish()
        else:
            self._done.wait()

    def guard_forward(self, modules: Iterable[torch.nn.Module]) -> int:
        """Until the copies are done, each forward of ``modules`` first waits for them (a forward
        pre-hook): a module that changes the tensors being copied in its forward (BatchNorm's
        running statistics) changes them after they are copied. Every hook is removed once the
        fence is done (by whoever waits for it first); none is added to a fence done already.
        Returns the number of hooks added."""
        if self.done():
            return 0
        with self._lock:
            for m in modules:
                self._hooks.append(m.register_forward_pre_hook(self._before_forward))
            added = len(self._hooks)
        if self._done.is_set():  # completed while the hooks went on: its _finish may have missed them
            self._unhook()
        return added

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        self.wait()

    def _finish(self) -> None:
        self._done.set()
        self._unhook()

    def _unhook(self) -> None:
        with self._lock:
            hooks, self._hooks = self._hooks, []
        for h in hooks:
            h.remove()


_STREAMS: dict[int, Any] = {}


def side_stream(device: torch.device) -> Any:
    """The stream the snapshot copies from ``device`` run on (one per device, made once)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _STREAMS.get(index)
    if stream is None:
        stream = _STREAMS[index] = torch.cuda.Stream(device=index)
    return stream


_PENDING: list[Fence] = []
_PENDING_LOCK = threading.Lock()
_HOOK: list[Any] = []


def _before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """Every optimizer's step pre-hook: the step waits for the snapshots still being copied."""
    wait_staged()


def track(fence: Fence) -> Fence:
    """``fence`` is waited for by :func:`wait_staged` (and so by every optimizer step) until done."""
    with _PENDING_LOCK:
        _PENDING[:] = [f for f in _PENDING if not f.done()]
        _PENDING.append(fence)
        if not _HOOK:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            _HOOK.append(register_optimizer_step_pre_hook(_before_step))
    return fence


def wait_staged() -> None:
    """Block until every snapshot copy of the process is done (a no-op when none is pending)."""
    with _PENDING_LOCK:
        pending = list(_PENDING)
    for f in pending:
        f.wait()
    with _PENDING_LOCK:
        _PENDING[:] = [f for f in _PENDING if not f.done()]


def pending() -> int:
    """How many tracked snapshot copies are not yet known to be done."""
    with _PENDING_LOCK:
        return sum(not f.done() for f in _PENDING)
