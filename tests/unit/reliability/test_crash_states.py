"""Crash consistency under a weak file-system model: every crash state of every publish protocol.

Each test records the file-system operations of one save (``tests/crashfs.py``: a shadow model
of the tree with per-file durable and volatile data, per-directory durable and volatile entries),
then enumerates the states a power loss may leave after every prefix of them (unsynced data
lost, torn or with a write dropped; unsynced directory entries lost, in order or with one
dropped), materialises each into a fresh directory and reads it: ``open_checkpoint`` + structure
+ ``verify`` + a bit-exact ``load_model`` (the manager: ``all_steps`` and a bit-exact ``load``
of every committed step and of ``latest``). Every state must read as the previous checkpoint,
the new one, or (only where the protocol documents that window) a clear
``IncompleteCheckpointError``; once the save has returned, every state must read as the new one.

The states after each prefix are the product of every file's and directory's outcomes,
enumerated whole when it has at most ``CAP`` members, else sampled (every state varying one
object with the others all lost or all persisted, plus ``CAP`` random ones). ``CAP`` is 64 in
the default run; ``UNICKPT_CRASH_STATES=all`` raises it to 5,000 (``=N``: to N), which makes
the single-file and sliced saves exhaustive at every prefix.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _reliability import Tiny, flat_optim, same_state, save_checkpoint, snapshot, train_state, trained
from crashfs import Recorder, Search, explore

from unickpt import GeneralCheckpointIO
from unickpt.ckpt.reader import open_checkpoint
from unickpt.errors import IncompleteCheckpointError, UnickptError

_ENV = os.environ.get("UNICKPT_CRASH_STATES", "")
FULL = _ENV == "all" or _ENV.isdigit()
CAP = int(_ENV) if _ENV.isdigit() else 5000 if FULL else 64
RECHECK = 50 if FULL else 400  # every n-th memoised verdict is read again and must agree
OLD_SEED, NEW_SEED = 1, 2
INCOMPLETE = f"error:{IncompleteCheckpointError.__name__}"
SNAPS = {"old": snapshot(Tiny(OLD_SEED)), "new": snapshot(Tiny(NEW_SEED))}
SEARCHES: list[Search] = []


def _verdict_of_checkpoint(path: str) -> str:
    """'old', 'new', 'error:<UnickptError class>', or what went wrong (a failing verdict)."""
    try:
        r = open_checkpoint(path)
        r.validate_structure()
        failures = r.verify()
        if failures:
            return f"corrupt-but-committed:{failures[0]}"
        m = Tiny(99)
        GeneralCheckpointIO().load_model(m, path, verify=True)
    except UnickptError as e:
        return f"error:{type(e).__name__}"
    except Exception as e:  # not a clear error: a failing verdict
        return f"raw-error:{type(e).__name__}:{e}"
    for name, snap in SNAPS.items():
        if same_state(m, snap):
            return name
    return "mix"


def _save(kind: str, seed: int, path: str) -> None:
    """``kind``: "sliced" (a sliced index), "hf" (Hugging Face files and their index), "single"."""
    io = GeneralCheckpointIO(fsync=True)
    save_checkpoint(path, seed, sharded=kind == "hf", sliced=kind == "sliced", io=io)


def _search(
    tmp: Path,
    name: str,
    base: Path,
    run: Callable[[], None],
    check: Callable[[str], str],
    allowed: Callable[[int, bool, str], bool],
) -> Search:
    rec = Recorder(str(base))
    torch.set_num_threads(1)
    with rec.recording():
        run()
    rec.check_against_disk()
    assert not rec.missed_flushes, rec.missed_flushes
    scratch = tmp / "states"
    scratch.mkdir()
    s = explore(rec, name, check, allowed, str(scratch), cap=CAP, recheck=RECHECK)
    SEARCHES.append(s)
    print(s.summary())
    assert not s.bad, f"{name}: {len(s.bad)} failing crash states:\n" + "\n".join(s.bad)
    return s


# ----------------------------------------------------------------------------- checkpoint saves
@pytest.mark.parametrize("kind", ["sliced", "hf", "single"])
def test_save_over_a_committed_checkpoint(tmp_path: Path, kind: str) -> None:
    """Every crash state of a save over the committed checkpoint of the same layout reads as
    the old one or the new one; a directory layout may also be refused in its documented window
    (the previous index is removed before the new data files are renamed in); never a mix."""
    base = tmp_path / "base"
    ck = base / "ck"
    base.mkdir()
    _save(kind, OLD_SEED, str(ck))
    allowed_mid = {"old", "new"} | ({INCOMPLETE} if kind != "single" else set())

    def allowed(k: int, final: bool, v: str) -> bool:
        if k == 0:
            return v == "old"
        return v == "new" if final else v in allowed_mid

    s = _search(
        tmp_path,
        f"{kind} save over a committed one",
        base,
        lambda: _save(kind, NEW_SEED, str(ck)),
        lambda d: _verdict_of_checkpoint(os.path.join(d, "ck")),
        allowed,
    )
    assert s.verdicts.get("old", 0) > 0 and s.verdicts.get("new", 0) > 0


@pytest.mark.parametrize("kind", ["sliced", "hf", "single"])
def test_save_into_a_fresh_directory(tmp_path: Path, kind: str) -> None:
    """A save into a new directory beside a committed checkpoint: the neighbour is never touched,
    the new directory reads as nothing (refused) or the whole new checkpoint, and once the save
    has returned the new checkpoint survives any crash (the new directory's entry is durable)."""
    base = tmp_path / "base"
    base.mkdir()
    _save(kind, OLD_SEED, str(base / "old"))

    def check(d: str) -> str:
        return f"{_verdict_of_checkpoint(os.path.join(d, 'old'))}|{_verdict_of_checkpoint(os.path.join(d, 'new'))}"

    def allowed(k: int, final: bool, v: str) -> bool:
        old, new = v.split("|")
        return old == "old" and (new == "new" if final else new in (INCOMPLETE, "new"))

    _search(
        tmp_path,
        f"{kind} save into a fresh directory",
        base,
        lambda: _save(kind, NEW_SEED, str(base / "new")),
        check,
        allowed,
    )


def test_recorder_sees_every_operation(tmp_path: Path) -> None:
    """The shadow model replayed whole equals the real tree; an operation it missed fails here."""
    base = tmp_path / "base"
    base.mkdir()
    rec = Recorder(str(base))
    with rec.recording():
        _save("sliced", NEW_SEED, str(base / "ck"))
    rec.check_against_disk()
    kinds = {op.what for op in rec.log}
    assert kinds == {"new", "entry", "data", "fsync", "dsync"}
    (base / "ck" / "stray").write_bytes(b"x")  # a write the recorder did not see
    with pytest.raises(AssertionError, match="recorder missed operations"):
        rec.check_against_disk()


def test_recorder_sees_an_fsync_before_the_flush(tmp_path: Path) -> None:
    """Bytes still in a file object's buffer are not what an ``fsync`` makes durable."""
    rec = Recorder(str(tmp_path))
    with rec.recording(), open(tmp_path / "f", "wb") as f:
        f.write(b"abc")
        fd = f.fileno()
        os.fsync(fd)
    assert rec.missed_flushes == [f"fsync of fd {fd} with 1 unflushed writes"]
    whats = [op.what for op in rec.log]
    assert whats.index("fsync") < whats.index("data")  # the write reached the kernel at close


def test_memoised_verdicts_agree_with_the_reader(tmp_path: Path) -> None:
    """Every memoised verdict of a search read again by the reader: the same verdict each time."""
    base = tmp_path / "base"
    base.mkdir()
    _save("single", OLD_SEED, str(base / "ck"))
    rec = Recorder(str(base))
    with rec.recording():
        _save("single", NEW_SEED, str(base / "ck"))
    s = explore(
        rec,
        "memo check",
        lambda d: _verdict_of_checkpoint(os.path.join(d, "ck")),
        lambda k, final, v: v in ("old", "new"),
        str(tmp_path),
        cap=CAP,
        recheck=1,
    )
    assert not s.bad and s.memo_hits > 10 and s.rechecks == s.memo_hits


def test_search_finds_a_rename_without_a_directory_fsync(tmp_path: Path, monkeypatch: Any) -> None:
    """The search is able to fail: with the directory fsyncs of the commit removed, a state after
    the save returned reads as the old checkpoint (the renames were not durable)."""
    import unickpt.store.publish as commit

    monkeypatch.setattr(commit, "fsync_dir", lambda path: None)
    base = tmp_path / "base"
    base.mkdir()
    _save("sliced", OLD_SEED, str(base / "ck"))
    rec = Recorder(str(base))
    with rec.recording():
        _save("sliced", NEW_SEED, str(base / "ck"))
    s = explore(
        rec,
        "no directory fsync",
        lambda d: _verdict_of_checkpoint(os.path.join(d, "ck")),
        lambda k, final, v: v == "new" if final else v in ("old", "new", INCOMPLETE),
        str(tmp_path),
        cap=CAP,
    )
    assert s.failing.get((True, "old"), 0) > 0, s.failing


# ----------------------------------------------------------------------------- manager steps
TRAINED = {seed: train_state(*trained(seed)) for seed in (1, 2, 3)}


def _manager_save(run: Path, step: int, seed: int, keep_last: int | None) -> None:
    from unickpt.manager import CheckpointManager

    m, opt = trained(seed)
    assert CheckpointManager(run, save_steps=1, keep_last=keep_last).save(step, m, opt)


def _manager_verdict(run: str) -> str:
    return _manager_verdict_at(run, None)


def _manager_verdict_at(run: str, storage_options: dict[str, Any] | None) -> str:
    """``latest=<step>:s<seed> steps=<step>:s<seed>,...``: what ``load()`` restores and what each
    committed step restores (bit-exact, by the seed that trained it; ``s?`` for none)."""
    from unickpt.manager import CheckpointManager

    def loaded(mgr: Any, which: Any) -> str:
        m, opt = trained(99)
        step = mgr.load(m, opt, resume_from_checkpoint=which)
        got = train_state(m, opt)
        seeds = [s for s, exp in TRAINED.items() if exp == got]
        return f"{step}:s{seeds[0] if seeds else '?'}"

    try:
        mgr = CheckpointManager(run, save_steps=1, keep_last=None, storage_options=storage_options)
        steps = ",".join(loaded(mgr, s) for s in mgr.all_steps())
        return f"latest={loaded(mgr, 'latest')} steps={steps}"
    except UnickptError as e:
        return f"error:{type(e).__name__}"
    except Exception as e:
        return f"raw-error:{type(e).__name__}:{e}"


def _committed_steps_exact(v: str, seeds: dict[int, set[int]]) -> bool:
    """Every committed step loads bit-exactly as one of the saves ``seeds`` allows for it."""
    if not v.startswith("latest="):
        return False
    listed = v.split(" steps=")[1]
    for item in filter(None, listed.split(",")):
        step, seed = item.split(":s")
        if seed == "?" or int(seed) not in seeds.get(int(step), set()):
            return False
    return True


MANAGER_CASES = {
    # name: (steps committed first as (step, seed), the save (step, seed), keep_last,
    #        allowed latest before/after, each step's possible seeds)
    "new step": ([(1, 1), (2, 2)], (3, 3), None, ("2:s2", "3:s3"), {1: {1}, 2: {2}, 3: {3}}),
    "re-save of a step": ([(1, 1), (2, 2)], (2, 3), None, ("2:s2", "2:s3"), {1: {1}, 2: {2, 3}}),
    "retention": ([(1, 1), (2, 2)], (3, 3), 2, ("2:s2", "3:s3"), {1: {1}, 2: {2}, 3: {3}}),
}


@pytest.mark.parametrize(
    "case,swap",
    [("new step", True), ("re-save of a step", True), ("re-save of a step", False), ("retention", True)],
    ids=["new-step", "re-save-exchange", "re-save-rename-aside", "retention"],
)
def test_manager_step(tmp_path: Path, case: str, swap: bool, monkeypatch: Any) -> None:
    """Every crash state of a manager save reads, through ``CheckpointManager.load``, as the
    previous ``latest`` or the new step, bit-exact, and every step ``all_steps()`` lists loads
    bit-exactly as a save of that step (retention never leaves a listed step half deleted);
    once ``save`` returned, ``load()`` restores the new step."""
    if not swap:  # the file system cannot swap: the replaced step is renamed aside first
        import unickpt.store.publish as commit_steps

        monkeypatch.setattr(commit_steps, "exchange", lambda a, b: False)
    first, (step, seed), keep, (old, new), seeds = MANAGER_CASES[case]
    base = tmp_path / "base"
    run = base / "run"
    base.mkdir()
    for s, sd in first:
        _manager_save(run, s, sd, None)

    def allowed(k: int, final: bool, v: str) -> bool:
        latest = v.split(" ")[0].removeprefix("latest=")
        if not _committed_steps_exact(v, seeds):
            return False
        if k == 0:
            return latest == old
        return latest == new if final else latest in (old, new)

    s = _search(
        tmp_path,
        f"manager {case} ({'exchange' if swap else 'rename-aside'})",
        base,
        lambda: _manager_save(run, step, seed, keep),
        lambda d: _manager_verdict(os.path.join(d, "run")),
        allowed,
    )
    assert any(v.startswith(f"latest={new}") for v in s.verdicts)


# ----------------------------------------------------------------------------- tool outputs
def _fresh_output_allowed(k: int, final: bool, v: str) -> bool:
    return v == "new" if final else v in (INCOMPLETE, "new")


def test_merge_output(tmp_path: Path) -> None:
    """``merge`` publishes a staged directory: every crash state of the output reads as nothing
    (refused) or the whole merged checkpoint, and the merge survives once it returned."""
    from unickpt.tools.merge import merge_checkpoint

    src = tmp_path / "src"
    _save("sliced", NEW_SEED, str(src))
    base = tmp_path / "base"
    base.mkdir()
    _search(
        tmp_path,
        "merge into a new directory",
        base,
        lambda: merge_checkpoint(src, base / "out" / "merged", max_shard_size=200),
        lambda d: _verdict_of_checkpoint(os.path.join(d, "out", "merged")),
        _fresh_output_allowed,
    )


def test_convert_bin_output(tmp_path: Path) -> None:
    """``convert --from bin`` output: nothing or the whole converted checkpoint, durable once returned."""
    from unickpt.tools.convert import convert_checkpoint

    src = tmp_path / "src"
    src.mkdir()
    torch.save(Tiny(NEW_SEED).state_dict(), src / "pytorch_model.bin")
    base = tmp_path / "base"
    base.mkdir()
    _search(
        tmp_path,
        "convert --from bin into a new directory",
        base,
        lambda: convert_checkpoint(src, base / "conv", source="bin", target="hf", max_shard_size=200),
        lambda d: _verdict_of_checkpoint(os.path.join(d, "conv")),
        _fresh_output_allowed,
    )


def test_convert_to_run_output(tmp_path: Path) -> None:
    """``convert --from dcp --to run``: a manager directory whose step, once listed, loads
    bit-exactly (model and optimizer) in every crash state, and survives once convert returned."""
    import torch.distributed.checkpoint as dcp

    from unickpt.manager import CheckpointManager
    from unickpt.tools.convert import convert_checkpoint

    m, opt = trained(NEW_SEED)
    folder = tmp_path / "dcp"
    states = {**m.state_dict(), "optimizer": flat_optim(opt.optim, m), "train_state": {"step": 4}}
    dcp.save(states, checkpoint_id=str(folder), no_dist=True)
    want = TRAINED[NEW_SEED]
    base = tmp_path / "base"
    base.mkdir()

    def check(d: str) -> str:
        try:
            mgr = CheckpointManager(os.path.join(d, "run"), save_steps=1)
            steps = mgr.all_steps()
            m2, opt2 = trained(99)
            step = mgr.load(m2, opt2)
        except UnickptError as e:
            return f"error:{type(e).__name__}"
        except Exception as e:
            return f"raw-error:{type(e).__name__}:{e}"
        if step == 0 and not steps:
            return "nothing"
        return "new" if (steps, step, train_state(m2, opt2)) == ([4], 4, want) else f"mix:{steps}:{step}"

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _search(
            tmp_path,
            "convert --to run into a new directory",
            base,
            lambda: convert_checkpoint(folder, base / "run", source="dcp", target="run"),
            check,
            lambda k, final, v: v == "new" if final else v in ("nothing", INCOMPLETE, "new"),
        )


# ----------------------------------------------------------------------------- object stores
def _reader_options(s3: Any) -> dict[str, Any]:
    """The readers' s3fs options: one cached client (each state is a bucket of its own, so no
    listing is ever reused across states)."""
    from s3server import client_options

    return client_options(s3.endpoint, "reader")


def _store_search(
    s3: Any,
    name: str,
    run: Callable[[], None],
    check: Callable[[str], str],
    allowed: Callable[[int, bool, str], bool],
) -> dict[str, int]:
    """Every prefix of ``run``'s completed write requests, materialised in a fresh bucket and
    read by ``check(bucket)``; returns the verdict counts."""
    from crashstore import StoreRecorder

    rec = StoreRecorder(s3, s3.bucket)
    with rec.recording():
        run()
    assert len(rec.states) > 2, rec.requests
    verdicts: dict[str, int] = {}
    bad = []
    seen: dict[Any, str] = {}
    for k, st in enumerate(rec.states):
        key = (st.objects, st.uploads)
        if key not in seen:
            seen[key] = check(rec.materialise(st))
        v = seen[key]
        verdicts[v] = verdicts.get(v, 0) + 1
        final = k == len(rec.states) - 1
        if not allowed(k, final, v):
            bad.append(f"after request {k} ({st.after}){' [save returned]' if final else ''}: {v}")
    uploads = sum(bool(st.uploads) for st in rec.states)
    print(
        f"{name}: {len(rec.requests)} write requests, {len(rec.states)} states ({uploads} with open uploads): {verdicts}"
    )
    assert not bad, f"{name}: failing states:\n" + "\n".join(bad)
    return verdicts


class Big(Tiny):
    """Tiny plus a 12.8 MB tensor: its file is uploaded in parts (multipart uploads)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.e = torch.nn.Parameter(torch.randn(3_200_000, generator=torch.Generator().manual_seed(seed)))


_slow = pytest.mark.slow


@pytest.mark.parametrize(
    "kind,big",
    [
        ("sliced", False),
        pytest.param("hf", False, marks=_slow),
        pytest.param("single", False, marks=_slow),
        pytest.param("sliced", True, marks=_slow),
        pytest.param("hf", True, marks=_slow),
    ],
)
def test_store_save_over_a_committed_checkpoint(s3: Any, kind: str, big: bool) -> None:
    """A save to s3:// over a committed checkpoint: after every prefix of its completed requests
    (open multipart uploads included) the prefix reads as the old checkpoint or the new one,
    never a mix; the new one once the save returned."""
    opts = s3.storage_options()
    url = f"s3://{s3.bucket}/ck"
    cls = Big if big else Tiny
    snaps = {"old": snapshot(cls(OLD_SEED)), "new": snapshot(cls(NEW_SEED))}

    def save(seed: int) -> None:
        io = GeneralCheckpointIO(storage_options=opts)
        save_checkpoint(url, model=cls(seed), sharded=kind == "hf", sliced=kind == "sliced", io=io)

    save(OLD_SEED)

    def check(bucket: str) -> str:
        u = f"s3://{bucket}/ck"
        try:
            r = open_checkpoint(u, storage_options=_reader_options(s3))
            r.validate_structure()
            failures = r.verify()
            if failures:
                return f"corrupt-but-committed:{failures[0]}"
            m = cls(99)
            GeneralCheckpointIO(storage_options=_reader_options(s3)).load_model(m, u, verify=True)
        except UnickptError as e:
            return f"error:{type(e).__name__}"
        except Exception as e:
            return f"raw-error:{type(e).__name__}:{e}"
        return next((n for n, snap in snaps.items() if same_state(m, snap)), "mix")

    v = _store_search(
        s3,
        f"s3 {kind}{' (multipart)' if big else ''} save over a committed one",
        lambda: save(NEW_SEED),
        check,
        lambda k, final, v: v == "new" if final else v in (("old",) if k == 0 else ("old", "new")),
    )
    assert v.get("old") and v.get("new")


@_slow
@pytest.mark.parametrize("case", ["new step", "re-save of a step", "retention"])
def test_store_manager_step(s3: Any, case: str) -> None:
    """A manager save to s3://: after every prefix of its completed requests ``load()`` restores
    the previous latest step or the new one, bit-exact, and every listed step loads bit-exactly."""
    from unickpt.manager import CheckpointManager

    opts = s3.storage_options()
    url = f"s3://{s3.bucket}/run"
    first, (step, seed), keep, (old, new), seeds = MANAGER_CASES[case]

    def save(s: int, sd: int, keep_last: int | None) -> None:
        m, opt = trained(sd)
        assert CheckpointManager(url, save_steps=1, keep_last=keep_last, storage_options=opts).save(s, m, opt)

    for s, sd in first:
        save(s, sd, None)

    def check(bucket: str) -> str:
        return _manager_verdict_at(f"s3://{bucket}/run", _reader_options(s3))

    def allowed(k: int, final: bool, v: str) -> bool:
        latest = v.split(" ")[0].removeprefix("latest=")
        if not _committed_steps_exact(v, seeds):
            return False
        if k == 0:
            return latest == old
        return latest == new if final else latest in (old, new)

    verdicts = _store_search(s3, f"s3 manager {case}", lambda: save(step, seed, keep), check, allowed)
    assert any(v.startswith(f"latest={new}") for v in verdicts)


# ----------------------------------------------------------------------------- a checkpoint of parts
def _parts_save(path: str, seed: int) -> None:
    from unickpt.integrations.lightning import UnickptCheckpointIO

    g = torch.Generator().manual_seed(seed)
    ck = {
        "state_dict": {"w": torch.randn(64, generator=g)},
        "epoch": seed,
        "optimizer_states": [{"state": {0: {"m": torch.randn(16, generator=g)}}}],
    }
    UnickptCheckpointIO(size_per_shard=1).save_checkpoint(ck, path)


def _parts_verdict(path: str) -> str:
    """'s<seed>' when the whole checkpoint of that save loads, bit for bit; else the error."""
    from unickpt.integrations.lightning import UnickptCheckpointIO

    try:
        back = UnickptCheckpointIO().load_checkpoint(path)
    except UnickptError as e:
        return f"error:{type(e).__name__}"
    except Exception as e:
        return f"raw-error:{type(e).__name__}:{e}"
    seed = back["epoch"]
    g = torch.Generator().manual_seed(seed)
    w, m = torch.randn(64, generator=g), torch.randn(16, generator=g)
    same = torch.equal(back["state_dict"]["w"], w) and torch.equal(
        back["optimizer_states"][0]["state"][0]["m"], m
    )
    return f"s{seed}" if same else f"mix:{seed}"


@pytest.mark.parametrize("swap", [True, False], ids=["exchange", "rename-aside"])
def test_trainer_checkpoint_replaced(tmp_path: Path, swap: bool, monkeypatch: Any) -> None:
    """A trainer's checkpoint of parts (``store.publish.PartsOutput``: Lightning's ``last.ckpt``
    directory, its ``model/``, ``state/`` and ``lightning.json``) saved over the previous one:
    every crash state loads as the whole old checkpoint or the whole new one, never a mix and
    never an error, with the kernel's exchange or with the old copy renamed aside (then found
    there); once the save returned, the new one."""
    pytest.importorskip("lightning.pytorch", reason="lightning is not installed (make peers)")
    if not swap:
        import unickpt.store.publish as publish

        monkeypatch.setattr(publish, "exchange", lambda a, b: False)
    base = tmp_path / "base"
    base.mkdir()
    path = str(base / "last.ckpt")
    _parts_save(path, OLD_SEED)

    def allowed(k: int, final: bool, v: str) -> bool:
        if k == 0:
            return v == f"s{OLD_SEED}"
        return v == f"s{NEW_SEED}" if final else v in (f"s{OLD_SEED}", f"s{NEW_SEED}")

    s = _search(
        tmp_path,
        f"trainer checkpoint replaced ({'exchange' if swap else 'rename-aside'})",
        base,
        lambda: _parts_save(path, NEW_SEED),
        lambda d: _parts_verdict(os.path.join(d, "last.ckpt")),
        allowed,
    )
    assert s.verdicts.get(f"s{OLD_SEED}", 0) > 0 and s.verdicts.get(f"s{NEW_SEED}", 0) > 0
