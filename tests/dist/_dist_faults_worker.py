"""Rank side of tests/dist/test_dist_faults.py: faults on one rank of a 2-rank gloo world.

Two entry points:

* :func:`fault_cases` runs under ``harness.run_world`` (one world for every non-fatal case).
  Each case returns, on every rank, an *observation* (which error this rank raised, its
  message and attributes, how long the call took, whether the model was modified); the
  parent test asserts on the observations of both ranks, so a known bug can be an
  ``xfail`` test of its own without a second world.
* ``python _dist_faults_worker.py kill ROOT`` (launched by the test, torchrun-style
  environment): a save during which rank 1 SIGKILLs itself halfway through writing its
  data file. The process group is created here with a 20 s collective timeout, so rank 0
  must give up within that bound; rank 0 writes what it saw to ``ROOT/rank0.json``.

Models are tiny (a few hundred bytes). ``Tiny`` parameters become ``Shard(0)`` DTensors on a
1-D mesh of 2 (the FSDP2/TP row-sharded layout: rank 1 owns the last rows), or stay plain
replicated tensors (the DDP layout).
"""

from __future__ import annotations

import datetime
import errno
import hashlib
import json
import os
import signal
import struct
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import _save_collectives_worker
import torch
import torch.distributed as dist
from torch import nn

import unickpt.ckpt.writer as writer_mod
import unickpt.io.load as load_mod
from unickpt.ckpt.safetensors_io import SafetensorsWriter
from unickpt.errors import IntegrityError, StateMismatchError
from unickpt.plugins.ddp import DDPCheckpointIO
from unickpt.plugins.fsdp2 import FSDP2CheckpointIO
from unickpt.plugins.tp import TPCheckpointIO

TINY_MB = 1e-4  # size_per_shard: about 100 bytes, so every slice gets a file of its own


class Tiny(nn.Module):
    def __init__(self, hidden: int = 10, extra: bool = False) -> None:
        super().__init__()
        self.up = nn.Linear(4, hidden)
        self.down = nn.Linear(hidden, 3)
        if extra:
            self.extra = nn.Parameter(torch.ones(2))


def tiny(seed: int, hidden: int = 10, extra: bool = False, mesh: Any = None) -> Tiny:
    """``Tiny`` from ``seed``; with ``mesh`` every parameter becomes a Shard(0) DTensor (no communication)."""
    torch.manual_seed(seed)
    model = Tiny(hidden, extra)
    if mesh is not None:
        from torch.distributed.tensor import Shard, distribute_tensor

        for mod in list(model.modules()):
            for name, p in list(mod.named_parameters(recurse=False)):
                d = distribute_tensor(p.detach(), mesh, [Shard(0)], src_data_rank=None)
                setattr(mod, name, nn.Parameter(d))
    return model


def local_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What this rank holds of every tensor (DTensor shards as local tensors), cloned."""
    out = {}
    for k, v in model.state_dict().items():
        v = v.to_local() if hasattr(v, "to_local") else v
        out[k] = v.detach().clone()
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bit-exact equality (names, dtypes, shapes, bytes)."""
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if not torch.equal(
            x.contiguous().view(-1).view(torch.uint8), y.contiguous().view(-1).view(torch.uint8)
        ):
            return False
    return True


def attempt(fn: Callable[[], Any]) -> dict[str, Any]:
    """Call ``fn``; describe what it raised (type, message, attributes) and how long it took."""
    t0 = time.monotonic()
    obs: dict[str, Any] = {"raised": None}
    try:
        fn()
    except BaseException as e:  # every outcome, whatever its type, is reported to the parent
        obs.update(
            raised=type(e).__name__,
            mro=[c.__name__ for c in type(e).__mro__],
            message=str(e),
            errno=getattr(e, "errno", None),
        )
        if isinstance(e, IntegrityError):
            obs["failures"] = [
                {
                    "type": type(f).__name__,
                    "tensor": getattr(f, "tensor", None),
                    "file": getattr(f, "file", None),
                }
                for f in e.failures
            ]
        if isinstance(e, StateMismatchError):
            obs.update(missing=e.missing, unexpected=e.unexpected, mismatched=e.mismatched)
        obs["traceback"] = traceback.format_exc()[-3000:]
    obs["seconds"] = time.monotonic() - t0
    return obs


def dir_digest(path: Path) -> dict[str, str]:
    """sha256 of every file in a directory (names included), to prove it was not touched."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir()) if p.is_file()}


@contextmanager
def patched(module: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def flip_bit_in_slice(directory: Path, tensor: str, row0: int) -> str:
    """Flip one bit in the stored slice of ``tensor`` whose first row is ``row0``; return its file name."""
    from unickpt.spec.index import as_listed

    index = as_listed(json.loads((directory / "model.safetensors.index.json").read_text()))
    (sl,) = [s for s in index["unickpt"]["tensors"][tensor]["slices"] if s["offsets"][0] == row0]
    path = directory / sl["file"]
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    begin, _end = json.loads(raw[8 : 8 + n])[sl["key"]]["data_offsets"]
    raw[8 + n + begin + 1] ^= 0x10
    path.write_bytes(bytes(raw))
    return str(sl["file"])


# ----------------------------------------------------------------------------- cases
# Every case runs on both ranks; ``d`` is the case's own directory (shared file system).


def _replicated_ckpt(d: Path) -> Path:
    ckpt = d / "ckpt"
    DDPCheckpointIO().save_model(tiny(0), ckpt, shard=True, size_per_shard=TINY_MB)
    return ckpt


def case_shape_differs_on_rank1(d: Path) -> dict[str, Any]:
    """DDP layout; rank 1's model has a different hidden size (different shapes on rank 1 only)."""
    ckpt = _replicated_ckpt(d)
    rank = dist.get_rank()
    model = tiny(1, hidden=10 if rank == 0 else 12)
    before = local_state(model)
    obs = attempt(lambda: DDPCheckpointIO().load_model(model, ckpt))
    obs["unchanged"] = same(before, local_state(model))
    return obs


def case_extra_param_on_rank0(d: Path) -> dict[str, Any]:
    """DDP layout; rank 0's model has a parameter the checkpoint (and rank 1) lacks."""
    ckpt = _replicated_ckpt(d)
    model = tiny(1, extra=dist.get_rank() == 0)
    before = local_state(model)
    obs = attempt(lambda: DDPCheckpointIO().load_model(model, ckpt))
    obs["unchanged"] = same(before, local_state(model))
    return obs


def case_checkpoint_mismatch_fsdp2(d: Path) -> dict[str, Any]:
    """FSDP2 layout (Shard(0) DTensors) loading a checkpoint of another architecture (hidden 7)."""
    from torch.distributed.device_mesh import init_device_mesh

    ckpt = d / "ckpt"
    DDPCheckpointIO().save_model(tiny(0, hidden=7), ckpt, shard=True)
    mesh = init_device_mesh("cpu", (2,))
    model = tiny(1, mesh=mesh)
    before = local_state(model)
    obs = attempt(lambda: FSDP2CheckpointIO(mesh=mesh).load_model(model, ckpt))
    obs["unchanged"] = same(before, local_state(model))
    return obs


def case_integrity_rank1_rows(d: Path) -> dict[str, Any]:
    """TP/FSDP2 row-sharded load, verify=True; only the rows rank 1 reads are corrupted."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    io = TPCheckpointIO(mesh=mesh)
    ckpt = d / "ckpt"
    io.save_model(tiny(0, mesh=mesh), ckpt, shard=True, gather_dtensor=False)
    dist.barrier()
    corrupt = [""]
    if dist.get_rank() == 0:
        corrupt[0] = flip_bit_in_slice(ckpt, "up.weight", 5)  # rows 5..9 live on rank 1
    dist.broadcast_object_list(corrupt, src=0)
    model = tiny(1, mesh=mesh)
    before = local_state(model)
    obs = attempt(lambda: io.load_model(model, ckpt, verify=True))
    obs["unchanged"] = same(before, local_state(model))
    obs["corrupt_file"] = corrupt[0]
    return obs


def _fails_mid_load_rank1(d: Path, atomic: bool) -> dict[str, Any]:
    """Rank 1's reads fail with EIO after the agreement step (a disk error while copying): its
    coalesced reads (``ReadBatch.run``, after every block is located) raise."""
    ckpt = _replicated_ckpt(d)
    model = tiny(1)
    before = local_state(model)

    class FailingBatch(load_mod.ReadBatch):  # type: ignore[name-defined,misc]
        def run(self, *args: Any, **kwargs: Any) -> None:
            raise OSError(errno.EIO, "injected read error", "model-00002.safetensors")

    io = DDPCheckpointIO(atomic_load=atomic)
    if dist.get_rank() == 1:
        with patched(load_mod, "ReadBatch", FailingBatch):
            obs = attempt(lambda: io.load_model(model, ckpt))
    else:
        obs = attempt(lambda: io.load_model(model, ckpt))
    obs["unchanged"] = same(before, local_state(model))
    # A bounded wait for the peer: a rank that returned normally must not be left waiting alone.
    dist.barrier()
    # Loading again after the failure gives the checkpoint's values on every rank.
    io.load_model(model, ckpt)
    obs["reload_exact"] = same(local_state(model), local_state(tiny(0)))
    return obs


def case_fails_mid_load_rank1(d: Path) -> dict[str, Any]:
    return _fails_mid_load_rank1(d, atomic=True)


def case_fails_mid_load_in_place_rank1(d: Path) -> dict[str, Any]:
    return _fails_mid_load_rank1(d, atomic=False)


class _FailingWriter(SafetensorsWriter):
    """Writes half of the first tensor of its ``fail_at``-th file, then the disk is full."""

    opened: ClassVar[list[str]] = []
    fail_at: ClassVar[int] = 2

    def __init__(self, path: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(path, *args, **kwargs)
        _FailingWriter.opened.append(path)

    def write(self, key: str, data: memoryview | bytes) -> None:
        if len(_FailingWriter.opened) >= _FailingWriter.fail_at:
            mv = memoryview(data).cast("B")
            assert self._f is not None
            self._f.write(mv[: max(1, mv.nbytes // 2)])
            self._f.flush()
            raise OSError(errno.ENOSPC, "No space left on device (injected)", self.path)
        super().write(key, data)


def case_save_fails_rank1(d: Path) -> dict[str, Any]:
    """FSDP2 layout, sliced save: rank 1's writer fails (ENOSPC) halfway through its second file."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    io = FSDP2CheckpointIO(mesh=mesh)
    prev, new = d / "prev", d / "new"
    old_model = tiny(0, mesh=mesh)
    io.save_model(old_model, prev, shard=True, gather_dtensor=False, size_per_shard=TINY_MB)
    dist.barrier()
    prev_digest = dir_digest(prev)
    model = tiny(1, mesh=mesh)
    before = local_state(model)
    _FailingWriter.opened = []

    def save() -> None:
        io.save_model(model, new, shard=True, gather_dtensor=False, size_per_shard=TINY_MB)

    if dist.get_rank() == 1:
        with patched(writer_mod, "SafetensorsWriter", _FailingWriter):
            obs = attempt(save)
    else:
        obs = attempt(save)
    dist.barrier()
    obs["rank1_opened"] = [os.path.basename(p) for p in _FailingWriter.opened]
    obs["rank1_left"] = [os.path.basename(p) for p in _FailingWriter.opened if os.path.exists(p)]
    obs["new_files"] = sorted(os.listdir(new)) if new.exists() else []
    obs["unchanged"] = same(before, local_state(model))
    # The failed directory is refused on every rank, as a whole.
    probe = tiny(2, mesh=mesh)
    probe_before = local_state(probe)
    obs["load_new"] = attempt(lambda: io.load_model(probe, new))
    obs["load_new"]["unchanged"] = same(probe_before, local_state(probe))
    # The previous checkpoint: same bytes, and it still loads bit-exact.
    obs["prev_untouched"] = dir_digest(prev) == prev_digest
    loaded = tiny(3, mesh=mesh)
    obs["load_prev"] = attempt(lambda: io.load_model(loaded, prev, verify=True))
    obs["prev_exact"] = same(local_state(loaded), local_state(old_model))
    # The lock was released: saving again into the failed directory works.
    obs["retry"] = attempt(save)
    return obs


def case_group_of_rank0_only(d: Path) -> dict[str, Any]:
    """The object collectives honour their group: a group holding rank 0 only is a world of one
    there, and rank 1, which is not a member, is refused instead of acting as rank 0 (torch says
    rank -1 for it)."""
    from unickpt import _dist

    del d
    g0 = dist.new_group(ranks=[0])  # collective over the world: every rank calls it
    obs: dict[str, Any] = {"world": [_dist.rank(), _dist.world_size()]}
    if dist.get_rank() == 0:
        obs["in_g0"] = [_dist.is_distributed(g0), _dist.rank(g0), _dist.world_size(g0)]
        obs["gathered"] = _dist.all_gather_object("mine", g0)
        obs["agreed"] = _dist.agreed(lambda: 5, "a phase", g0)
    obs["is_distributed"] = attempt(lambda: _dist.is_distributed(g0))
    obs["rank"] = attempt(lambda: _dist.rank(g0))
    obs["agree"] = attempt(lambda: _dist.agree(None, "a phase", g0))
    dist.barrier()
    return obs


def case_agree_gather(d: Path) -> dict[str, Any]:
    """``agree_gather``: every rank's object when all succeeded; one rank's error raised on every
    rank (same type, message naming it); a peer in another collective is out of step."""
    from unickpt import _dist
    from unickpt.errors import CheckpointFormatError

    del d
    r = dist.get_rank()
    obs: dict[str, Any] = {"ok": _dist.agree_gather(None, {"rank": r}, "a phase")}
    err = CheckpointFormatError("bad header in f.safetensors") if r == 1 else None
    obs["one_failed"] = attempt(lambda: _dist.agree_gather(err, r, "writing d"))
    if r == 0:
        obs["out_of_step"] = attempt(lambda: _dist.agree_gather(None, 0, "writing d"))
    else:
        _dist.all_gather_object(("not", "a report"))  # rank 0 is in agree_gather
        obs["out_of_step"] = {}
    dist.barrier()
    return obs


CASES: list[tuple[str, Callable[[Path], dict[str, Any]]]] = [
    ("shape_differs_on_rank1", case_shape_differs_on_rank1),
    ("extra_param_on_rank0", case_extra_param_on_rank0),
    ("checkpoint_mismatch_fsdp2", case_checkpoint_mismatch_fsdp2),
    ("integrity_rank1_rows", case_integrity_rank1_rows),
    ("fails_mid_load_rank1", case_fails_mid_load_rank1),
    ("fails_mid_load_in_place_rank1", case_fails_mid_load_in_place_rank1),
    ("save_fails_rank1", case_save_fails_rank1),
    ("group_of_rank0_only", case_group_of_rank0_only),
    ("agree_gather", case_agree_gather),
    ("save_collectives", _save_collectives_worker.case_save_collectives),
    ("plan_fails_rank1_prepared", _save_collectives_worker.case_plan_fails_on_rank1_while_rank0_prepares),
]


def fault_cases(root: str) -> dict[str, dict[str, Any]]:
    """Every rank: run each case in its own directory under ``root``; return the observations."""
    out: dict[str, dict[str, Any]] = {}
    for name, fn in CASES:
        d = Path(root) / name
        if dist.get_rank() == 0:
            d.mkdir(parents=True, exist_ok=True)
        dist.barrier()  # a case that broke the process group ends the job here (within its timeout)
        t0 = time.monotonic()
        try:
            obs = fn(d)
        except Exception:
            obs = {"case_error": traceback.format_exc()}
        obs["case_seconds"] = time.monotonic() - t0
        out[name] = obs
    return out


# ----------------------------------------------------------------------------- kill case


class _KillingWriter(SafetensorsWriter):
    """Writes half of its first tensor, flushes, then SIGKILLs its own process."""

    def write(self, key: str, data: memoryview | bytes) -> None:
        mv = memoryview(data).cast("B")
        assert self._f is not None
        self._f.write(mv[: max(1, mv.nbytes // 2)])
        self._f.flush()
        os.kill(os.getpid(), signal.SIGKILL)


PG_TIMEOUT_S = 20


def kill_main(root: str) -> None:
    """``python _dist_faults_worker.py kill ROOT``: rank 1 dies mid-save; rank 0 reports to ROOT/rank0.json."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    from torch.distributed.device_mesh import init_device_mesh

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    io = FSDP2CheckpointIO(mesh=mesh)
    prev, new = Path(root) / "prev", Path(root) / "new"
    io.save_model(tiny(0, mesh=mesh), prev, shard=True, gather_dtensor=False)
    dist.barrier()
    model = tiny(1, mesh=mesh)
    if rank == 1:
        writer_mod.SafetensorsWriter = _KillingWriter  # type: ignore[misc]
    report: dict[str, Any] = {"prev_digest": dir_digest(prev)}
    report["save"] = attempt(lambda: io.save_model(model, new, shard=True, gather_dtensor=False))
    report["new_files"] = sorted(os.listdir(new)) if new.exists() else []
    tmp = Path(root) / "rank0.json.tmp"
    tmp.write_text(json.dumps(report))
    tmp.replace(Path(root) / "rank0.json")
    # The peer is gone: tearing the group down could wait on it, so leave at once.
    os._exit(0)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "kill":
        kill_main(sys.argv[2])
    else:
        raise SystemExit("usage: _dist_faults_worker.py kill ROOT")
