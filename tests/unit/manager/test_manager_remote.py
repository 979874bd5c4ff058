"""CheckpointManager with an fsspec URL: ``memory://`` in process, a rename-refusing store on 2 ranks."""

from __future__ import annotations

import json
import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem
from fsspec.spec import AbstractFileSystem

from unickpt.errors import IncompleteCheckpointError
from unickpt.manager import CheckpointManager, _RemoteStore

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_manager import _SAVE_ID, Counter, _setup, _train


def _refuse(*a: Any, **k: Any) -> None:
    raise AssertionError("the manager must never rename or move on an fsspec store")


class NoRenameFileSystem(LocalFileSystem):  # type: ignore[misc]
    """A local directory that behaves like an object store: no rename, no move."""

    protocol = ("norename",)
    mv = rename = move = mv_file = _refuse

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        path = str(path)
        if path.startswith("norename://"):
            path = path[len("norename://") :]
        return super()._strip_protocol(path)


fsspec.register_implementation("norename", NoRenameFileSystem, clobber=True)


@pytest.fixture(autouse=True)
def _no_renames(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("mv", "rename", "move"):
        monkeypatch.setattr(AbstractFileSystem, name, _refuse)
        monkeypatch.setattr(MemoryFileSystem, name, _refuse, raising=False)


@pytest.fixture
def url() -> Iterator[str]:
    name = f"unickpt-test-{uuid.uuid4().hex[:8]}"
    yield f"memory://{name}"
    fs = fsspec.filesystem("memory")
    if fs.exists(f"/{name}"):
        fs.rm(f"/{name}", recursive=True)


def _objects(url: str) -> dict[str, bytes]:
    fs, root = fsspec.core.url_to_fs(url)
    return {p[len(root) + 1 :]: fs.cat_file(p) for p in sorted(fs.find(root))}


def test_round_trip_bit_exact_resume_and_nothing_left_locally(url: str, tmp_path: Path) -> None:
    ref = _train(None, 17)
    cache = tmp_path / "cache"
    mgr = CheckpointManager(url, save_steps=5, keep_last=2, local_cache_dir=cache)
    first = _train(mgr, 12)
    assert mgr.all_steps() == [5, 10] and mgr.latest_step() == 10
    assert mgr.step_dir(10) == f"{url}/step-10"
    objs = _objects(url)
    assert json.loads(objs["latest"]) == {"step": 10}
    assert json.loads(objs["step-10/COMMIT"])["step"] == 10
    assert {k.split("/")[0] for k in objs} == {"latest", "step-5", "step-10"}
    assert "step-10/model/model.safetensors.index.json" in objs
    assert "step-10/train_state/rank-00000.safetensors" in objs
    assert [p for p in cache.rglob("*") if p.is_file()] == []  # staged copies are removed after upload
    # A different seed: weights, RNG and data order all come back from the store.
    counter = Counter()
    mgr2 = CheckpointManager(url, save_steps=5, keep_last=2, local_cache_dir=cache)
    rest = _train(mgr2, 17, seed=123, counter=counter)
    assert {s: first[s] for s in range(1, 11)} == {s: ref[s] for s in range(1, 11)}
    assert rest == {s: ref[s] for s in range(11, 18)}  # bit for bit
    assert counter.n == 17
    assert mgr2.all_steps() == [10, 15]
    assert [p for p in cache.rglob("*") if p.is_file()] == []  # downloads are removed after load


def test_retention_resume_by_step_latest_none_and_replace(url: str) -> None:
    model, opt, sched, _ = _setup(0)
    mgr = CheckpointManager(url, save_steps=2, keep_last=3)
    saved = {}
    for step in range(1, 11):
        with torch.no_grad():
            model.a.weight.add_(1.0)
        saved[step] = model.a.weight.detach().clone()
        assert mgr.save(step, model, opt, sched) == (step % 2 == 0)
    assert mgr.all_steps() == [6, 8, 10] and mgr.latest_step() == 10
    assert {k.split("/")[0] for k in _objects(url)} == {"latest", "step-6", "step-8", "step-10"}
    m2, o2, s2, _ = _setup(1)
    assert mgr.load(m2, o2, s2, resume_from_checkpoint=None) == 0
    assert mgr.load(m2, o2, s2, resume_from_checkpoint=8) == 8
    assert torch.equal(m2.a.weight, saved[8])
    assert mgr.load(m2, o2, s2, resume_from_checkpoint=4) == 10  # not committed: the latest
    assert torch.equal(m2.a.weight, saved[10])
    # Saving an existing step again replaces it (a resumed run); `latest` names it.
    with torch.no_grad():
        model.a.bias.fill_(7.0)
    mgr.save(8, model, opt, sched, force=True)
    assert mgr.all_steps() == [6, 8, 10] and mgr.latest_step() == 8
    assert mgr.load(m2, o2, s2) == 8
    assert torch.equal(m2.a.bias, model.a.bias)
    assert CheckpointManager(url + "-empty").load(m2, o2) == 0


def test_crash_before_commit_upload_leaves_the_step_ignored(
    url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    model, opt, _, _ = _setup(0)
    mgr = CheckpointManager(url, save_steps=1, keep_last=2)
    mgr.save(1, model, opt)
    before = {k: v for k, v in _objects(url).items() if k.startswith("step-1/")}
    put = _RemoteStore.put_bytes

    def killed(self: _RemoteStore, rel: str, data: bytes, **k: Any) -> bool:
        if rel.endswith("COMMIT"):
            raise OSError("killed between the data upload and the COMMIT upload")
        return put(self, rel, data, **k)

    monkeypatch.setattr(_RemoteStore, "put_bytes", killed)
    with pytest.raises(OSError, match="killed between"):
        mgr.save(2, model, opt)
    monkeypatch.undo()
    objs = _objects(url)
    assert "step-2/model/model.safetensors.index.json" in objs and "step-2/COMMIT" not in objs
    assert json.loads(objs["latest"]) == {"step": 1}
    fresh = CheckpointManager(url, save_steps=1, keep_last=2)
    assert fresh.all_steps() == [1] and fresh.latest_step() == 1
    m2, o2, _, _ = _setup(1)
    assert fresh.load(m2, o2, resume_from_checkpoint=2) == 1
    assert {k: v for k, v in _objects(url).items() if k.startswith("step-1/")} == before
    # A retention delete killed after removing COMMIT: the rest is ignored too.
    fs, root = fsspec.core.url_to_fs(url)
    fs.rm_file(f"{root}/step-1/COMMIT")
    assert fresh.all_steps() == [] and fresh.latest_step() is None
    # 'latest' still records step 1: losing every committed step is reported, not a fresh start.
    with pytest.raises(IncompleteCheckpointError, match="records a save of step 1, but no committed step"):
        fresh.load(m2, o2)
    # The next save removes both leftovers.
    fresh.save(3, model, opt)
    assert {k.split("/")[0] for k in _objects(url)} == {"latest", "step-3"}


def test_step_deleted_after_listing_is_refused(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt, _, _ = _setup(0)
    mgr = CheckpointManager(url, save_steps=1)
    mgr.save(1, model, opt)
    monkeypatch.setattr(CheckpointManager, "_pick_step", lambda self, wanted: (1, mgr.step_dir(1)))
    fs, root = fsspec.core.url_to_fs(url)
    fs.rm(f"{root}/step-1", recursive=True)
    with pytest.raises(IncompleteCheckpointError, match="no longer committed"):
        mgr.load(*_setup(1)[:2])


@pytest.mark.parametrize("save_hf", [False, True])
def test_async_save_to_memory_equals_sync(url: str, save_hf: bool) -> None:
    trees = []
    for mode in (False, True):
        torch.manual_seed(0)
        model, opt, sched, dl = _setup(0)
        for x, y in dl:
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        u = f"{url}-{mode}"
        mgr = CheckpointManager(u, save_steps=1, async_save=mode, save_hf=save_hf)
        torch.manual_seed(5)
        mgr.save(3, model, opt, sched, dl, counter=Counter())
        if mode:  # training goes on while the background thread writes and uploads
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(100.0)
        mgr.wait()
        assert mgr.all_steps() == [3]
        # Each save has its own random save id (index and headers): blanked before comparing.
        trees.append({k: _SAVE_ID.sub(rb"\1\2" + b"0" * 32, v) for k, v in _objects(u).items()})
        fsspec.filesystem("memory").rm(fsspec.core.url_to_fs(u)[1], recursive=True)
    assert trees[0] == trees[1]
    # On a store the HF copy is the merge of the sliced model: one model.safetensors when it fits.
    assert ("step-3/hf/model.safetensors" in trees[0]) == save_hf


def test_async_upload_error_surfaces_at_wait(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt, _, _ = _setup(0)
    mgr = CheckpointManager(url, save_steps=1, async_save=True)

    def boom(*a: Any, **k: Any) -> None:
        raise OSError("bucket unreachable")

    from unickpt.store.storage import FsspecStorage

    monkeypatch.setattr(FsspecStorage, "open_write", boom)  # the background thread's uploads
    assert mgr.save(1, model, opt)
    with pytest.raises(OSError, match="bucket unreachable"):
        mgr.wait()
    monkeypatch.undo()
    assert mgr.all_steps() == []
    mgr.save(2, model, opt)
    mgr.wait()
    assert mgr.all_steps() == [2]


# ---------------------------------------------------------------------- 2 ranks (FSDP2, gloo)
def remote_worker(url: str, cache: str) -> dict[str, Any]:
    """Each rank: FSDP2 over 2 ranks, sync then async (with HF copy) saves to a rename-free store."""
    import torch.distributed as dist

    import unickpt
    from unickpt.plugins.fsdp2 import FSDP2Plugin

    fsspec.register_implementation("norename", NoRenameFileSystem, clobber=True)
    for name in ("mv", "rename", "move"):
        setattr(AbstractFileSystem, name, _refuse)
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    booster = unickpt.Booster(FSDP2Plugin())
    model, opt, *_ = booster.boost(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(rank))
    model(x).sum().backward()
    opt.step()
    full = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    out: dict[str, Any] = {}
    for mode in (False, True):
        u = f"{url}-{int(mode)}"
        mgr = CheckpointManager(
            u, booster, save_steps=1, async_save=mode, save_hf=mode, local_cache_dir=cache
        )
        mgr.save(1, model, opt)
        mgr.wait()
        torch.manual_seed(1)
        net2 = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
        b2 = unickpt.Booster(FSDP2Plugin())
        m2, o2, *_ = b2.boost(net2, torch.optim.AdamW(net2.parameters(), lr=1e-2))
        step = CheckpointManager(u, b2, local_cache_dir=cache).load(m2, o2)
        got = {k: v.full_tensor() for k, v in m2.state_dict().items()}
        out[f"mode{int(mode)}"] = (step, all(torch.equal(got[k], full[k]) for k in full))
    return out


@pytest.mark.long
def test_two_ranks_each_upload_their_own_files(tmp_path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "dist"))
    from harness import run_world

    store = tmp_path / "store"
    store.mkdir()
    url = f"norename://{store}/ckpt"
    here = Path(__file__).resolve()
    env = {"PYTHONPATH": os.pathsep.join([str(here.parent), str(here.parents[1])])}
    results = run_world(2, "test_manager_remote:remote_worker", url, str(tmp_path / "cache"), env=env)
    assert results == [{"mode0": (1, True), "mode1": (1, True)}] * 2
    for mode in ("0", "1"):
        files = {str(p.relative_to(store / f"ckpt-{mode}")) for p in (store / f"ckpt-{mode}").rglob("*")}
        assert {"step-1/COMMIT", "latest"} <= files
        # Both ranks' train states and (sliced, FSDP2) model files reached the store.
        assert {"step-1/train_state/rank-00000.json", "step-1/train_state/rank-00001.json"} <= files
        data = [f for f in files if f.startswith("step-1/model/") and f.endswith(".safetensors")]
        assert len(data) == 2, data
    # Ranks stage in their own local caches: rank 0 merges the uploaded sliced copy (one file
    # for this small model) instead of every rank writing its own bytes.
    assert "step-1/hf/model.safetensors" in {
        str(p.relative_to(store / "ckpt-1")) for p in (store / "ckpt-1").rglob("*")
    }
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]


class _Killed(BaseException):
    """A simulated kill: raised at the k-th mutating store call, caught by nothing in unickpt."""


@pytest.mark.parametrize("every", [pytest.param(1, marks=pytest.mark.slow), 6])
def test_resave_killed_at_store_operations_never_loses_the_step(
    url: str, monkeypatch: pytest.MonkeyPatch, every: int
) -> None:
    """Re-saving a committed step N, "killed" (the save stops) at each object write, copy or delete:
    afterwards step N loads bit-exactly as the old or the new save, and the next save with retention
    keeps it and leaves nothing else behind."""
    from _reliability import train_state as _state
    from _reliability import trained as _trained

    EXPECTED = {seed: _state(*_trained(seed)) for seed in (1, 2, 3)}

    # Every object write (whole PUTs and streamed files opened for writing), copy and delete.
    ops = ("pipe_file", "put_file", "rm_file", "cp_file", "_open")
    n = {"count": 0, "kill_at": 0, "killed": 0}

    def counting(name: str) -> Any:
        orig = getattr(MemoryFileSystem, name)

        def f(self: Any, *a: Any, **k: Any) -> Any:
            if name == "_open" and "w" not in (a[1] if len(a) > 1 else k.get("mode", "rb")):
                return orig(self, *a, **k)
            n["count"] += 1
            if n["count"] == n["kill_at"]:
                n["killed"] = n["count"]
                raise _Killed(f"{name} {a[0]}")
            return orig(self, *a, **k)

        return f

    for name in ops:
        monkeypatch.setattr(MemoryFileSystem, name, counting(name))

    def resave(u: str, kill_at: int) -> int:
        m, o = _trained(2)
        n["count"], n["kill_at"] = 0, kill_at
        try:
            CheckpointManager(u, save_steps=1).save(4, m, o)
        except _Killed:
            return n["killed"]
        finally:
            n["kill_at"] = 0
        return 0

    def base(u: str) -> None:
        for step in (2, 4):
            m, o = _trained(1)
            CheckpointManager(u, save_steps=1).save(step, m, o)

    def loaded(u: str, step: Any = "latest") -> tuple[int, int | None]:
        m, o = _trained(99)
        got = CheckpointManager(u, save_steps=1).load(m, o, resume_from_checkpoint=step)
        st = _state(m, o)
        return got, next((s for s, e in EXPECTED.items() if e == st), None)

    base(url + "-probe")
    assert resave(url + "-probe", 0) == 0
    total = n["count"]
    objs = _objects(url + "-probe")
    assert not [k for k in objs if "replacing" in k] and loaded(url + "-probe") == (4, 2)
    seen: dict[int, int] = {}
    for k in sorted({*range(1, total + 1, every), total}):
        u = f"{url}-k{k}"
        base(u)
        assert resave(u, k) == k
        step, seed = loaded(u)
        assert step == 4 and seed in (1, 2), (k, step, seed, sorted(_objects(u)))
        seen[seed] = seen.get(seed, 0) + 1
        m, o = _trained(3)
        CheckpointManager(u, save_steps=1, keep_last=2).save(5, m, o)
        assert CheckpointManager(u, save_steps=1).all_steps() == [4, 5]
        assert loaded(u, 4) == (4, seed)  # the copy that survived the kill, not lost by the next save
        assert {key.split("/")[0] for key in _objects(u)} == {"latest", "step-4", "step-5"}, k
    assert seen.get(1, 0) > 0 and seen.get(2, 0) > 0 and total >= 10, (seen, total)
    print(f"remote re-save: {total} store operations, {sum(seen.values())} kills, outcomes {seen}")


def test_a_rank_the_step_has_no_state_for_is_told_the_saving_world(
    url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Rank 1 of 2 resuming a step one rank saved: rank 0's per-rank state, and a warning that
    names the world that saved it, read from the step's COMMIT record on a store as on disk."""
    import logging

    from unickpt.manager import train_state

    for run in (url, str(tmp_path / "run")):
        assert CheckpointManager(run, save_steps=1).save(1, torch.nn.Linear(2, 2), None)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="unickpt"):
            train_state.restore(f"{run}/step-1", 1, 1, 2, None, {})
        assert "step 1 was saved by 1 rank(s), this is rank 1 of 2" in caplog.text, (run, caplog.text)
