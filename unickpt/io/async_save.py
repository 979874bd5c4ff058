"""Asynchronous saves of ``CheckpointIO`` (``save_model(..., use_async=True)``), and Colossal-AI's flags.

An async save plans and copies in the foreground, then writes in the background, the way
``CheckpointManager(async_save=True)`` does: the save returns once this rank's data is copied
to CPU memory (training may then change the live tensors), and this rank's writer process
(``io/writer_process.py``: started once, reused by every save, fed from shared memory) writes,
hashes, fsyncs and commits the copy, with the other ranks' writers as its own gloo world, never
through the training's group, and without taking the training process's GIL. A thread of the
training process waits for it and keeps its error for ``wait()``. A store only this process can
reach (``memory://``) is written by that thread itself, over a second gloo group made once per
``CheckpointIO`` (``dist.new_group``). One save is in flight at most per ``CheckpointIO``: every
later save or load through it, and ``CheckpointIO.wait()``, first waits for it and raises its
error, if any.

The copy is the slices each rank writes (``io/stage.py``: a replica only on its writer), whatever the layout asked for:
a sliced save writes them as slices, a gathered one straight into their place in the Hugging
Face files (``io/hf_save.py``). Nothing is gathered, in the foreground or in the thread.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  (its exit hook is registered before this module's)
import contextlib
import dataclasses
import functools
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from unickpt import _dist
from unickpt._logging import get_logger
from unickpt.errors import UnickptError
from unickpt.io.pinned import POOL, wait_staged
from unickpt.io.save import WriteSpec, open_store, writes_in_place
from unickpt.io.stage import stage_written
from unickpt.io.tensors import SavePayload
from unickpt.io.writer_process import WriterProcess, share_buffers
from unickpt.spec.naming import index_name, single_name
from unickpt.store.storage import open_location, process_reachable

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "AsyncSaves",
    "shared_payload",
]

logger = get_logger(__name__)


class _Flight:
    """One background save: its thread, its error (if any) and whether a caller has seen it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.thread: threading.Thread | None = None
        self.errors: list[BaseException] = []


# Every save started and not yet waited for (its error not yet raised to a caller), in every
# ``AsyncSaves`` of the process: what the exit hook below finishes.
_FLIGHTS: list[_Flight] = []
_FLIGHTS_LOCK = threading.Lock()


def _finish_at_exit() -> None:
    """Interpreter exit: finish every save in flight; a save that did not commit ends the process with 1.

    Registered with ``threading._register_atexit`` after ``concurrent.futures.thread`` is
    imported, so it runs before that module shuts its executors down (its hook is registered
    first, and the hooks run last registered first) and before non-daemon threads are joined:
    the background thread may still start the hashing and upload executors it needs. A plain
    ``atexit`` hook would run after that shutdown, where the save fails with ``cannot schedule
    new futures after interpreter shutdown``. A save that fails here (or failed earlier and was
    never waited for) is not committed: the process says so on stderr and exits with status 1
    (``os._exit``: an exit hook cannot change the exit status otherwise), so a job that ends
    with an uncommitted step is never reported as a success.
    """
    with _FLIGHTS_LOCK:
        flights = list(_FLIGHTS)
    failed: list[_Flight] = []
    for flight in flights:
        if flight.thread is not None and flight.thread.is_alive():
            logger.info("finishing the async save %s before the process exits", flight.name)
            flight.thread.join()
        if flight.errors:
            failed.append(flight)
    if not failed:
        return
    for flight in failed:
        err = flight.errors[-1]
        msg = (
            f"unickpt: the async save {flight.name} failed while the process was exiting and was NOT committed "
            f"by this process: {type(err).__name__}: {err}"
        )
        with contextlib.suppress(Exception):
            sys.stderr.write(msg + "\n")
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(1)


def _register_exit_hook() -> None:
    register = getattr(threading, "_register_atexit", None)
    if register is None:  # pragma: no cover - CPython >= 3.9 has it
        atexit.register(_finish_at_exit)
    else:
        register(_finish_at_exit)


_register_exit_hook()


class AsyncSaves:
    """The background save in flight of one ``CheckpointIO`` or manager (at most one), and its writer.

    A save is written by this rank's writer process (``io/writer_process.py``: started once,
    reused, fed from shared memory, its own gloo world with the other ranks' writers), driven by
    a thread of this process that only waits for its answer. A save to a store only this
    process can reach (``memory://``: :func:`~unickpt.store.storage.process_reachable`) is
    written by the thread itself, over a second gloo group of the training processes.

    A process that exits with a save in flight finishes it first (like Colossal-AI's
    ``CheckpointIO.__del__``, but at interpreter exit too, see :func:`_finish_at_exit`); a save
    that cannot be finished then makes the process exit with status 1, saying so on stderr.
    """

    def __init__(self) -> None:
        self._flight: _Flight | None = None
        self._bg_group: ProcessGroup | None = None
        self._made_group = False
        self.writer = WriterProcess()
        weakref.finalize(self, self.writer.close)
        # The snapshots' host buffers are leased from the process's pool (io/pinned.py), shared
        # with every other IO and manager, reused by the next save of the same kind.

    @property
    def pending(self) -> bool:
        """A save is still being written."""
        f = self._flight
        return f is not None and f.thread is not None and f.thread.is_alive()

    def background_group(self, group: ProcessGroup | None) -> ProcessGroup | None:
        """Collective the first time (every rank of ``group``): the gloo group a writing thread uses."""
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
        if self._flight is not None:  # pragma: no cover - callers wait() first
            raise RuntimeError("internal: an async save is already in flight")
        flight = _Flight(name)

        def run() -> None:
            try:
                wait_staged()  # the snapshot's copies (a side CUDA stream) are done
                work()
            except BaseException as e:  # surfaced by the next wait(), or at exit
                logger.error("async save %s failed: %s", name, e)
                flight.errors.append(e)

        # Daemon: the exit hook joins it before anything it needs shuts down; a non-daemon
        # thread would be joined only after the executors it uses refuse new work.
        flight.thread = threading.Thread(target=run, name=f"unickpt-async-{name}", daemon=True)
        self._flight = flight
        with _FLIGHTS_LOCK:
            _FLIGHTS.append(flight)
        flight.thread.start()

    def start_in_writer(
        self,
        group: ProcessGroup | None,
        name: str,
        job: Callable[[Any], Any],
        buffers: Iterable[torch.Tensor],
        stamp: Callable[[], object],
        then: Callable[[Any], object] | None = None,
        cleanup: Callable[[], object] | None = None,
    ) -> None:
        """Collective over ``group``: run ``job(writers' group)`` in this rank's writer process.

        ``job`` is pickled now (its errors raised here, on every rank; tensors viewing the
        staging ``buffers`` go by reference, others by value); a thread sends it and
        waits for the answer, then runs ``then(result)`` once it succeeded, and ``cleanup()``
        either way; errors as :meth:`start`.

        ``stamp()``: what identifies the checkpoint committed where this save commits, ``None``
        or ``False`` when none is (read by the thread before the job is sent, and again if the
        writer dies before answering: unchanged, the previous checkpoint is untouched; gone, a
        save in place had removed it; otherwise this save committed; the ``WriterDiedError``
        says which).
        """
        writer = self.writer
        what = f"the async save {name}"
        prepared = writer.prepare(group, job, f"preparing {what}", buffers)

        def work() -> None:
            try:
                before = stamp()

                def outcome() -> str:
                    now = stamp()
                    return "untouched" if now == before else "removed" if now is None else "committed"

                result = writer.run(prepared, what, outcome)
                if then is not None:
                    then(result)
            finally:
                if cleanup is not None:
                    cleanup()

        self.start(name, work)

    def save(
        self,
        spec: WriteSpec,
        payload: SavePayload,
        checkpoint: str | os.PathLike[str],
        group: ProcessGroup | None,
        after: Callable[[str], None] | None = None,
        model: torch.nn.Module | None = None,
    ) -> str:
        """Collective over ``group``: copy ``payload`` to CPU memory now, write and commit the copy
        with ``spec`` in the background (this rank's writer process, or a thread for ``memory://``).

        Returns the path the save will commit. ``after(path)`` runs on rank 0 once committed.
        ``model``: the module ``payload`` was planned from, whose forwards wait for the copies
        of its buffers still running (``io.stage.guard_buffers``).
        """
        gather = spec.options.gather
        path = os.fspath(checkpoint)
        final = committed_path(path, payload.kind, spec.options.shard, gather, spec.options.storage_options)
        in_writer = process_reachable(path)
        # The snapshot's host buffers are leased from the process's pool (io/pinned.py: exact
        # sizes, pinned on CUDA, shared with every IO and manager), handed back once written.
        staging = POOL.lease(payload.kind, shared=in_writer)
        try:
            return self._stage_and_start(spec, payload, path, final, staging, group, after, model)
        except BaseException:
            POOL.give_back(staging)
            raise

    def _stage_and_start(
        self,
        spec: WriteSpec,
        payload: SavePayload,
        path: str,
        final: str,
        staging: Any,
        group: ProcessGroup | None,
        after: Callable[[str], None] | None,
        model: torch.nn.Module | None,
    ) -> str:
        """:meth:`save` with the snapshot's buffers leased: ``staging`` goes back to the pool once
        the write is over (or here, if it raises)."""
        gather = spec.options.gather
        if gather and not _in_place(path, spec.options.storage_options):
            # On a store that cannot write in place a gathered save is written by rank 0 from full
            # tensors (io/funnel_save.py): the full copies are made now, in the foreground, kept
            # by the rank that sends each.
            from unickpt.io.funnel_save import gathered_snapshot

            copy = gathered_snapshot(payload, group, staging)
        else:  # every rank writes its own slices (a sliced save, or in place: io/hf_save.py)
            if gather:  # column-sharded DTensors: row slices, moved now (io/hf_rows.py)
                from unickpt.io.hf_rows import row_snapshot

                payload = dataclasses.replace(payload, slices=row_snapshot(payload.tensors, payload.slices))
            copy = stage_written(payload, staging, group, replicas=spec.check_replicas != "off", model=model)
        name = os.path.basename(path.rstrip("/")) or path
        is_rank0 = _dist.rank(group) == 0
        if staging.shared:
            job = functools.partial(_write_job, spec, shared_payload(copy, staging), path)

            def then(written: Any) -> None:
                if after is not None and is_rank0:
                    after(str(written))

            stamp = functools.partial(
                commit_stamp,
                final,
                payload.kind,
                gather and not spec.options.shard,
                spec.options.storage_options,
            )
            self.start_in_writer(
                group,
                name,
                job,
                list(staging.values()),
                stamp,
                then,
                functools.partial(POOL.give_back, staging),
            )
            return final
        # A store only this process reaches (memory://): written by a thread of this process.
        bg_group = self.background_group(group)

        def work() -> None:
            try:
                written = spec.write(copy, path, bg_group)
            finally:
                POOL.give_back(staging)
            if after is not None and _dist.rank(bg_group) == 0:
                after(written)

        self.start(name, work)
        return final

    def wait(self) -> None:
        """Block until the save in flight is committed; raise its error, if it failed."""
        flight, self._flight = self._flight, None
        if flight is None:
            return
        if flight.thread is not None:
            flight.thread.join()
        with _FLIGHTS_LOCK, contextlib.suppress(ValueError):
            _FLIGHTS.remove(flight)
        if flight.errors:
            raise flight.errors[-1]

    def close(self) -> None:
        """Wait for the save in flight (raising its error), then stop the writer process."""
        try:
            self.wait()
        finally:
            self.writer.close()


def shared_payload(payload: SavePayload, staging: dict[Any, torch.Tensor]) -> SavePayload:
    """``payload`` (a snapshot into ``staging``) as the writer process receives it.

    The staging buffers move to shared memory (once: later snapshots reuse them), and the live
    tensors, which the writer needs only by name, shape and dtype, become meta tensors.
    """
    if not all(t.untyped_storage().is_shared() for t in staging.values()):
        wait_staged()  # moving a buffer reads it: its copy must be done
    moved = share_buffers(staging)
    staged = {t.untyped_storage().data_ptr() for t in staging.values()}

    def swap(t: torch.Tensor) -> torch.Tensor:
        return moved.get(id(t), t)

    slices = payload.slices
    if moved:  # the first save into pinned buffers: the slices view the shared ones instead
        slices = {
            n: [dataclasses.replace(sl, tensor=swap(sl.tensor)) for sl in sls] for n, sls in slices.items()
        }
    tensors = {}
    for n, t in payload.tensors.items():
        t = swap(t)
        plain = type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu"
        if not plain or t.untyped_storage().data_ptr() not in staged:
            t = torch.empty(t.shape, dtype=t.dtype, device="meta")
        tensors[n] = t
    return dataclasses.replace(payload, tensors=tensors, slices=slices)


def _write_job(spec: WriteSpec, payload: SavePayload, path: str, group: ProcessGroup | None) -> str:
    """In the writer process: ``CheckpointIO.write`` of a snapshot, over the writers' world."""
    return spec.write(payload, path, group)


def _in_place(path: str, storage_options: dict[str, Any] | None) -> bool:
    """Whether a gathered save at ``path`` has every rank write its own bytes in place: the
    store writes at offsets and stages by renames (``io.save.save_tensors``)."""
    store, _ = open_store(path, storage_options)
    return writes_in_place(store)


def committed_path(
    path: str, kind: str, shard: bool, gather: bool, storage_options: dict[str, Any] | None = None
) -> str:
    """The path a save with these arguments commits (what ``save_tensors`` returns: the
    location's :class:`~unickpt.store.storage.Location` names it back)."""
    loc = open_location(path, storage_options)
    if gather and not shard:
        return loc.shown_file(single_name(kind))
    if loc.is_file:
        raise UnickptError(f"{path}: a sharded or sliced checkpoint is a directory; pass a directory path")
    return loc.shown


def commit_stamp(
    final: str, kind: str, single: bool, storage_options: dict[str, Any] | None = None
) -> bytes | None:
    """What identifies the checkpoint committed at ``final`` (:func:`committed_path`), ``None``
    when none is: its commit point's bytes (the index; a single file's header), which name the
    save's id, so that two saves of the same tensors differ."""
    loc = open_location(final, storage_options)
    point = loc.path if single else loc.storage.join(loc.path, index_name(kind))
    if not loc.storage.exists(point):
        return None
    if not single:
        return loc.storage.read_bytes(point)
    h = loc.storage.open_read(point)
    try:
        n = int.from_bytes(h.pread(0, 8), "little") if h.size >= 8 else 0
        return h.pread(0, min(h.size, 8 + n))
    finally:
        h.close()
