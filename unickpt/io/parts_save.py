"""Gathered saves on S3 without a rank-0 funnel: every rank uploads parts of the same files.

A gathered save into a local directory has every rank ``pwrite`` its bytes of the planned
Hugging Face files (``io/hf_save.py``). S3 has no ``pwrite``, but its multipart uploads take
parts from any client holding the upload's id (``store/storage_parts.py``), so:

1. every rank computes the same layout (``format.hf_layout``: files, headers, where each tensor
   starts), the writer of every byte (the plan's writer of each slice; rank 0 the headers) and
   the same parts: fixed boundaries (``PART_SIZE``), each part owned by the rank holding most
   of its bytes (the least loaded on ties);
2. rank 0 creates one multipart upload per file and broadcasts the ids;
3. in rounds of ``world x IN_FLIGHT`` parts, every rank sends the bytes it holds of parts
   other ranks own (one ``all_to_all_single`` of uint8 per round: only bytes across a part
   boundary between holders travel) and uploads the parts it owns, ``IN_FLIGHT`` at a time,
   hashing the ranges it holds on a second thread; the ranks agree after every round;
4. the ETags and hashes are all-gathered; rank 0 builds the block (as ``io/hf_save``: per-range
   hashes for tensors several ranks hold), uploads a single file's first part last (its header
   carries the block), completes every upload and commits through ``io._commit`` (index last).

Any rank's failure aborts every upload (after every rank has stopped uploading): nothing of the
save appears, the previous checkpoint stays committed. Files are byte-identical to the local
gathered save's (same layout, header and metadata). ``SharedParts`` is this strategy of the save
engine (``io.save.choose_strategy``: a store with shared multipart uploads).
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import posixpath
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np
import torch

from unickpt import _dist
from unickpt._faults import maybe_fail
from unickpt.ckpt.hf_layout import HFLayout, box_runs, plan_hf_layout
from unickpt.ckpt.reader import single_file_name
from unickpt.ckpt.writer import build_index, data_file_metadata, single_file_metadata
from unickpt.io.hf_save import gathered_block, hash_tensor_ranges, order_files
from unickpt.io.planner import PlannedFile, SavePlan
from unickpt.io.tensors import as_bytes
from unickpt.io.write_strategy import SaveRun, WriteStrategy, commit_collective, settle
from unickpt.spec.dtypes import itemsize
from unickpt.spec.index import index_to_json
from unickpt.spec.naming import single_name
from unickpt.store import storage_parts, storage_s3
from unickpt.store.publish import commit_condition, refused_commit, remove_superseded, store_file_name
from unickpt.store.storage import FsspecStorage
from unickpt.store.storage_parts import Part, SharedUpload, part_size_for, plan_parts

__all__ = ["IN_FLIGHT", "save_gathered_parts"]

#: Parts each rank uploads at once (and keeps in memory per round).
IN_FLIGHT = 4

_Hashes = dict[tuple[str, int], str]
_Partials = dict[str, list[int]]
# (file index, part number) -> ETag
_ETags = dict[tuple[int, int], str]


class _Source:
    """The bytes this rank holds of each file: sorted (absolute start, uint8 array) pieces."""

    def __init__(self) -> None:
        self.pieces: dict[int, list[tuple[int, np.ndarray]]] = collections.defaultdict(list)
        self._starts: dict[int, list[int]] = {}

    def add(self, file: int, start: int, arr: np.ndarray) -> None:
        self.pieces[file].append((start, arr))

    def seal(self) -> None:
        for f, ps in self.pieces.items():
            ps.sort(key=lambda p: p[0])
            self._starts[f] = [s for s, _ in ps]

    def read(self, file: int, a: int, b: int) -> Iterator[memoryview]:
        """Bytes ``[a, b)`` of ``file``, which this rank holds, as views in order."""
        ps, starts = self.pieces[file], self._starts[file]
        i = max(0, bisect.bisect_right(starts, a) - 1)
        pos = a
        while pos < b:
            s, arr = ps[i]
            if not s <= pos < s + arr.nbytes:
                raise RuntimeError(f"internal: file {file}: byte {pos} is not held by this rank")
            take = min(b, s + arr.nbytes) - pos
            yield memoryview(arr[pos - s : pos - s + take])  # type: ignore[arg-type]
            pos += take
            i += 1


class SharedParts(WriteStrategy):
    """A gathered save on a store with shared multipart uploads (S3: ``supports_shared_parts``):
    every rank uploads the parts it owns of the same files (the module docstring)."""

    name = "shared-parts"
    plans_files = (
        False  # the writer of every slice: the files are planned from the layout (``save_gathered_parts``)
    )

    def __init__(self, store: FsspecStorage) -> None:
        self.store = store

    def write_and_commit(self, run: SaveRun) -> None:
        save_gathered_parts(run, self.store)


def save_gathered_parts(s: SaveRun, store: FsspecStorage) -> None:
    """Collective: write and commit a gathered save on S3; every rank raises if any rank failed.

    ``s.over``: a checkpoint of the kind is committed in ``s.directory`` (new files get save-id names).
    """
    over, group, rank, world = s.over, s.group, s.rank, s.world
    plan, ranges, descs = order_files(s)
    single = bool(s.file_path)
    file_name = single_file_name(s.file_path, s.kind) if single else None
    placeholders = (
        gathered_block(s, ranges, None, None, file_name=file_name, placeholder=True) if single else None
    )
    if placeholders is not None:
        meta = single_file_metadata(placeholders, s.save_id)
        layout = plan_hf_layout(
            descs, kind=s.kind, size_per_shard_bytes=None, metadata=meta, single_file=file_name
        )
        paths = [s.file_path]
    else:
        meta = data_file_metadata(False, s.save_id)
        layout = plan_hf_layout(
            descs, kind=s.kind, size_per_shard_bytes=s.size_per_shard_bytes, metadata=meta
        )
        names = [store_file_name(f.name, s.save_id) if over else f.name for f in layout.files]
        paths = [store.join(s.directory, n) for n in names]
    parts = _plan(layout, ranges, world, single)

    # 2. rank 0 creates the uploads.
    uploads: list[SharedUpload] = []
    err: BaseException | None = None
    if rank == 0:
        try:
            maybe_fail("save.hf_create")
            store.makedirs(posixpath.dirname(paths[0]))
            for p, ps in zip(paths, parts, strict=True):
                uploads.append(SharedUpload(store.fs, p))
                if len(ps) > 1:  # a file of one part is one PUT by its owner
                    uploads[-1].create()
        except BaseException as e:
            err = e
            _abort(uploads)
    where = f"uploading {s.file_path or store.join(s.directory, '')}"
    # the upload ids travel with the agreement: one exchange
    ids = _dist.agree_gather(err, [u.upload_id for u in uploads], where, group)[0]
    if rank != 0:
        uploads = [SharedUpload(store.fs, p, i) for p, i in zip(paths, ids, strict=True)]

    # 3. rounds of exchange and upload.
    try:
        kept, gathered = _upload_own(s, layout, ranges, parts, uploads, meta, group, rank, world)
    except BaseException:
        if rank == 0:  # every rank has stopped uploading: nothing of this save appears
            _abort(uploads)
            if not single:  # a single file's one part is put at the commit (its path may be the old file's)
                with contextlib.suppress(Exception):
                    store.remove([u.path for u, ps in zip(uploads, parts, strict=True) if len(ps) == 1])
        raise

    # 4. rank 0: the block, the completions, the commit.
    all_etags: _ETags = {}
    all_hashes: _Hashes = {}
    all_partials: _Partials = {}
    for rank_etags, rank_hashes, rank_partials in gathered:
        all_etags.update(rank_etags)
        all_hashes.update(rank_hashes)
        for name, got in rank_partials.items():
            all_partials.setdefault(name, []).extend(got)
    index = b""
    completed: list[str] = []
    # a single file is its own commit point: written only while it is the version under the lock
    when = commit_condition(s.fence, posixpath.basename(s.file_path)) if single else None
    if rank == 0:
        try:
            maybe_fail("save.commit")
            if single:
                block = gathered_block(s, ranges, all_hashes, all_partials, file_name=file_name)
                header = layout.files[0].header(single_file_metadata(block, s.save_id))
                first = kept[(0, 1)]
                if len(header) != layout.files[0].header_len:  # pragma: no cover - same-length placeholders
                    raise RuntimeError("internal: a single file's header changed length after hashing")
                first[: len(header)] = header
                if s.fence is not None:  # the single file's completion is the commit
                    s.fence.check(f"completing {s.file_path}")
                if len(parts[0]) == 1:
                    _commit_point(s, lambda: uploads[0].put(first, when))
                else:
                    all_etags[(0, 1)] = uploads[0].upload_part(1, first)
            else:
                files = {
                    n: paths[i].rsplit("/", 1)[1] for i, f in enumerate(layout.files) for n, _, _ in f.specs
                }
                block = gathered_block(s, ranges, all_hashes, all_partials, files)
                index = index_to_json(build_index(block, sliced=False))
            for i, up in enumerate(uploads):
                if len(parts[i]) > 1:
                    etags = [(p.number, all_etags[(i, p.number)]) for p in parts[i]]
                    _commit_point(s, lambda up=up, etags=etags: up.complete(etags, when if single else None))
                completed.append(up.path)
        except BaseException as e:
            err = e
            _abort(uploads[len(completed) :])
            if not single:  # the completed files and the one-part PUTs (a single file: nothing appeared)
                with contextlib.suppress(Exception):
                    store.remove([u.path for u in uploads if u.upload_id is None or u.path in completed])
    if single:
        if rank == 0 and err is None:
            try:
                directory, base = posixpath.split(s.file_path)
                if base == single_name(s.kind):
                    remove_superseded(store, directory, s.kind, {base}, single=True, fence=s.fence)
            except BaseException as e:
                err = e
        settle(err, f"committing {s.file_path}", group, s.lock)
        return
    commit_files = [PlannedFile(p.rsplit("/", 1)[1], 0) for p in paths]
    commit_plan = SavePlan(plan.tensors, commit_files, {}, False)
    staged = {f.name: p for f, p in zip(commit_files, paths, strict=True)} if rank == 0 else {}
    commit_collective(
        s.directory,
        s.kind,
        False,
        commit_plan,
        staged,
        index,
        s.save_id,
        err,
        group,
        rank,
        world,
        store,
        s.lock,
        fence=s.fence,
    )


def _plan(
    layout: HFLayout, ranges: dict[str, list[tuple[int, int, int]]], world: int, single: bool
) -> list[list[Part]]:
    """Every file's parts (the same on every rank): the header is rank 0's, each range its writer's."""
    load = [0] * world
    out: list[list[Part]] = []
    total = sum(f.size for f in layout.files)
    for f in layout.files:
        size = part_size_for(f.size, storage_parts.PART_SIZE)
        cap = -(-total // world) + size // 2  # each rank uploads about its share
        runs: list[tuple[int, int, int]] = [(0, f.header_len, 0)]
        for name, _, _ in f.specs:
            pos = layout.places[name].pos
            runs.extend((pos + b, pos + e, w) for b, e, w in ranges[name])
        out.append(plan_parts(f.size, runs, size, load, cap=cap, first_owner=0 if single else None))
    return out


def _commit_point(s: SaveRun, write: Any) -> None:
    """``write()`` (a conditional completion): refused by the store, the save's lock was taken
    over and another save committed: ``CheckpointBusyError``."""
    try:
        write()
    except OSError as e:
        if s.fence is not None and storage_s3.precondition_failed(e):
            raise refused_commit(s.file_path, s.fence) from None
        raise


def _put(upload: SharedUpload, body: bytearray) -> str:
    upload.put(body)
    return ""


def _abort(uploads: Sequence[SharedUpload]) -> None:
    for u in uploads:
        if u.upload_id is not None:
            with contextlib.suppress(Exception):
                u.abort()


def _upload_own(
    s: SaveRun,
    layout: HFLayout,
    ranges: dict[str, list[tuple[int, int, int]]],
    parts: list[list[Part]],
    uploads: list[SharedUpload],
    meta: dict[str, str],
    group: Any,
    rank: int,
    world: int,
) -> tuple[dict[tuple[int, int], bytearray], list[tuple[_ETags, _Hashes, _Partials]]]:
    """Step 3 on this rank: returns the parts kept for later (a single file's first part, rank 0)
    and every rank's ETags and hashes of the ranges it holds (gathered with the last agreement).
    Raises on every rank if any failed."""
    opts = s.opts
    plan = s.plan
    file_of = {f.name: i for i, f in enumerate(layout.files)}
    src = _Source()
    err: BaseException | None = None
    hashes: _Hashes = {}
    partials: _Partials = {}
    hash_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="unickpt-hash")
    hashing: list[Future[tuple[_Hashes, _Partials]]] = []
    try:
        if rank == 0:
            for i, f in enumerate(layout.files):
                src.add(i, 0, np.frombuffer(f.header(meta), dtype=np.uint8))
        for name, (dtype, gshape) in plan.tensors.items():
            mine = [ps for ps in plan.slices[name] if ps.rank == rank]
            if not mine:
                continue
            place = layout.places[name]
            blocks, pieces = [], []
            for ps in mine:
                arr = as_bytes(s.local[ps.local_index].tensor)
                blocks.append((arr, ps.offsets, ps.shape))
                runs = box_runs(gshape, ps.offsets, ps.shape, itemsize(dtype))
                n = runs[0][1] - runs[0][0] if runs else 0
                for j, (b, _) in enumerate(runs):
                    pieces.append((b, arr[j * n : (j + 1) * n]))
                    src.add(file_of[place.file], place.pos + b, arr[j * n : (j + 1) * n])
            pieces.sort(key=lambda bp: bp[0])
            mine_ranges = [(b, e) for b, e, w in ranges[name] if w == rank]
            hashing.append(
                hash_pool.submit(hash_tensor_ranges, name, dtype, gshape, blocks, pieces, mine_ranges, opts)
            )
        src.seal()
    except BaseException as e:
        err = e
    where = f"uploading {s.file_path or s.directory}"
    etags: _ETags = {}
    kept: dict[tuple[int, int], bytearray] = {}
    pool = ThreadPoolExecutor(max_workers=IN_FLIGHT, thread_name_prefix="unickpt-upload")
    try:
        _dist.agree(err, where, group)
        todo = [(i, p) for i, ps in enumerate(parts) for p in ps]
        window = max(1, world * IN_FLIGHT)
        for at in range(0, len(todo), window):
            batch = todo[at : at + window]
            futures: dict[tuple[int, int], Future[str]] = {}
            try:
                bodies = _exchange(batch, src, group, rank, world)
                for (i, p), body in zip([ip for ip in batch if ip[1].owner == rank], bodies, strict=True):
                    if (i, p.number) == (0, 1) and s.file_path:
                        kept[(0, 1)] = body  # its header is known once every rank has hashed
                    elif len(parts[i]) == 1:
                        futures[(i, p.number)] = pool.submit(_put, uploads[i], body)
                    else:
                        futures[(i, p.number)] = pool.submit(uploads[i].upload_part, p.number, body)
                del bodies
                wait(futures.values())  # every part of this round ends before the agreement
                for key, fut in futures.items():
                    etags[key] = fut.result()
                maybe_fail("save.hf_write")
            except BaseException as e:
                err = e
                wait(futures.values())
            _dist.agree(err, where, group)  # every rank has finished this round's uploads
        try:
            for hashed in hashing:
                h, tensor_partials = hashed.result()
                hashes.update(h)
                for name, got in tensor_partials.items():
                    partials.setdefault(name, []).extend(got)
        except BaseException as e:
            err = e
        # the agreement carries every rank's ETags and hashes: one exchange
        gathered = _dist.agree_gather(
            err, (etags, hashes, partials), f"hashing {s.file_path or s.directory}", group
        )
    finally:
        pool.shutdown(wait=True)
        hash_pool.shutdown(wait=True)
    return kept, gathered


def _exchange(
    batch: Sequence[tuple[int, Part]], src: _Source, group: Any, rank: int, world: int
) -> list[bytearray]:
    """Collective: the bodies of the parts of ``batch`` this rank owns, in order.

    Each rank sends every other rank the bytes it holds of that rank's parts (in part order,
    then file order): one ``all_to_all_single``. A rank that fails to assemble what it sends
    sends zeros of the same sizes, so that the collective still lines up, then raises (its
    peers raise at the round's agreement).
    """
    send_sizes = [0] * world
    recv_sizes = [0] * world
    for _, p in batch:
        for a, b, r in p.runs:
            if r == rank and p.owner != rank:
                send_sizes[p.owner] += b - a
            if p.owner == rank and r != rank:
                recv_sizes[r] += b - a
    send = torch.empty(sum(send_sizes), dtype=torch.uint8)
    failed: BaseException | None = None
    try:
        buf = send.numpy()
        at = 0
        for dest in range(world):
            for i, p in batch:
                if p.owner != dest or dest == rank:
                    continue
                for a, b, r in p.runs:
                    if r == rank:
                        for mv in src.read(i, a, b):
                            buf[at : at + mv.nbytes] = np.frombuffer(mv, dtype=np.uint8)
                            at += mv.nbytes
    except BaseException as e:
        failed = e
        send.zero_()
    recv = torch.empty(sum(recv_sizes), dtype=torch.uint8)
    if _dist.is_distributed(group):
        import torch.distributed as dist

        with _dist.peer_failures("all_to_all_single"):
            dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=_dist.cpu_group(group))
    if failed is not None:
        raise failed
    got = recv.numpy()
    offsets = [sum(recv_sizes[:r]) for r in range(world)]
    bodies: list[bytearray] = []
    for i, p in batch:
        if p.owner != rank:
            continue
        body = bytearray(p.end - p.start)
        for a, b, r in p.runs:
            if r == rank:
                at = a - p.start
                for mv in src.read(i, a, b):
                    body[at : at + mv.nbytes] = mv
                    at += mv.nbytes
            else:
                body[a - p.start : b - p.start] = got[offsets[r] : offsets[r] + b - a].data
                offsets[r] += b - a
        bodies.append(body)
    return bodies
