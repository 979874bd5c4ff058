"""Hostile input: every malformed or adversarial header, index and file layout is answered with a
UnickptError subclass and a clear message; never another exception, a hang, a write, or a huge allocation.

The hostile files live in tests/data/hostile/ and are written by tests/data/make_hostile.py (the
manifest there names the expected exception of each). Index cases are placed as the model index
next to a valid data file.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _reliability import INDEX, Tiny, same_state, save_checkpoint, snapshot, tree_state
from torch import nn

import unickpt.errors as errors
from unickpt import GeneralCheckpointIO
from unickpt.ckpt.reader import open_checkpoint
from unickpt.ckpt.safetensors_io import read_header
from unickpt.errors import UnickptError
from unickpt.spec.index import MAX_INDEX_BYTES, check_file_name

DATA = Path(__file__).resolve().parents[2] / "data"
HOSTILE = DATA / "hostile"
MANIFEST = json.loads((HOSTILE / "manifest.json").read_text())
ALL_CASES = sorted(n for n in MANIFEST if n != "manifest.json")
# Files that must be refused; the others ("ok") are valid checkpoints with odd contents.
ST_CASES = sorted(n for n in ALL_CASES if n.endswith(".safetensors") and MANIFEST[n]["error"] != "ok")
IX_CASES = sorted(n for n in ALL_CASES if n.endswith(".index.json") and MANIFEST[n]["error"] != "ok")


def _make_hostile():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("make_hostile", DATA / "make_hostile.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["make_hostile"] = mod
    spec.loader.exec_module(mod)
    return mod


MH = _make_hostile()


# Its own model: the tensors of the committed hostile files' good header.
class Good(nn.Module):
    """Matches GOOD_HEADER of make_hostile: w F32[2,3], n I64[4]."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((2, 3), 7.0))
        self.register_buffer("n", torch.full((4,), 9, dtype=torch.int64))


def expected(name: str) -> type[UnickptError]:
    cls = getattr(errors, MANIFEST[name]["error"])
    assert issubclass(cls, UnickptError)
    return cls  # type: ignore[no-any-return]


def test_committed_hostile_files_match_generator(tmp_path: Path) -> None:
    MH.write(tmp_path)
    got = sorted(os.listdir(tmp_path))
    assert got == sorted(os.listdir(HOSTILE)), "rerun tests/data/make_hostile.py"
    for name in got:
        assert (tmp_path / name).read_bytes() == (HOSTILE / name).read_bytes(), name
    assert len(ST_CASES) >= 55 and len(IX_CASES) >= 50 and len(ALL_CASES) >= 125


def _place_index(tmp_path: Path, name: str) -> Path:
    d = tmp_path / "ck"
    d.mkdir()
    shutil.copy(HOSTILE / MH.GOOD, d / MH.GOOD)
    shutil.copy(HOSTILE / name, d / INDEX)
    return d


def test_control_good_index_loads(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    d.mkdir()
    shutil.copy(HOSTILE / MH.GOOD, d / MH.GOOD)
    (d / INDEX).write_bytes(MH.index())
    r = open_checkpoint(d)
    r.validate_structure()
    m = Good()
    GeneralCheckpointIO().load_model(m, d)
    assert torch.equal(m.n, torch.frombuffer(bytearray(range(24, 56)), dtype=torch.int64))


@pytest.mark.timeout(20)
@pytest.mark.parametrize("name", ST_CASES)
def test_hostile_safetensors_file(name: str, tmp_path: Path) -> None:
    cls = expected(name)
    p = tmp_path / "model.safetensors"
    shutil.copy(HOSTILE / name, p)
    before = tree_state(tmp_path)
    with pytest.raises(cls) as ei:
        r = open_checkpoint(p)
        r.validate_structure()
    msg = str(ei.value)
    assert str(p) in msg and len(msg) < 2000, msg  # says where, stays readable
    # The same answer through load_model, which leaves the model untouched and writes nothing.
    m = Good()
    snap = snapshot(m)
    with pytest.raises(cls):
        GeneralCheckpointIO().load_model(m, p)
    assert same_state(m, snap)
    with pytest.raises(cls):
        GeneralCheckpointIO().load_model(m, tmp_path)  # the directory form finds model.safetensors
    assert tree_state(tmp_path) == before


@pytest.mark.timeout(20)
@pytest.mark.parametrize("name", IX_CASES)
def test_hostile_index(name: str, tmp_path: Path) -> None:
    cls = expected(name)
    d = _place_index(tmp_path, name)
    before = tree_state(tmp_path)
    with pytest.raises(cls) as ei:
        r = open_checkpoint(d)
        r.validate_structure()
    assert len(str(ei.value)) < 3000
    m = Good()
    snap = snapshot(m)
    # load_model may see the disagreement with the model first (a shape or dtype the index lies about).
    with pytest.raises((cls, errors.StateMismatchError)):
        GeneralCheckpointIO().load_model(m, d, verify=True)
    assert same_state(m, snap)
    assert tree_state(tmp_path) == before


@pytest.mark.parametrize(
    "bad",
    [
        "/abs.safetensors",
        "../x.safetensors",
        "a/../../x.safetensors",
        "a/b.safetensors",
        "..\\x.safetensors",
        "C:\\x.safetensors",
        "\\\\server\\share\\x.safetensors",
        ".hidden.safetensors",
        "",
        "..",
        "x.safetensors/",
        "x\x00.safetensors",
        "x.safetensors\n",
        "x.pt",
        "x.pkl",
        "x.safetensors.py",
        "a" * 300 + ".safetensors",
        "\u2025.safetensors",
        "\uff0e\uff0e\uff0fx.safetensors",
    ],
)
def test_unsafe_file_names_refused(bad: str) -> None:
    with pytest.raises(errors.UnsafePathError):
        check_file_name(bad)


def test_safe_file_names_accepted() -> None:
    for ok in [
        "model.safetensors",
        "model-00001-of-00002.safetensors",
        "pytorch_model.bin",
        "w+1=2.safetensors",
    ]:
        assert check_file_name(ok) == ok


@pytest.mark.parametrize("name", ["st_huge_header_len.safetensors", "st_header_len_past_eof.safetensors"])
def test_huge_header_length_allocates_nothing(name: str) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(errors.HeaderError, match="header length"):
            read_header(HOSTILE / name)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"peak {peak} bytes allocated while refusing a {name}"


def test_oversized_index_refused_unread(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    d.mkdir()
    with open(d / INDEX, "wb") as f:  # sparse: costs no disk
        f.truncate(MAX_INDEX_BYTES + 1)
    t0 = time.monotonic()
    with pytest.raises(errors.IndexFileError, match="limit"):
        open_checkpoint(d)
    assert time.monotonic() - t0 < 2.0


def test_index_symlink_to_proc_file_is_bounded(tmp_path: Path) -> None:
    if not os.path.exists("/proc/self/status"):
        pytest.skip("no /proc")
    d = tmp_path / "ck"
    d.mkdir()
    os.symlink("/proc/self/status", d / INDEX)
    with pytest.raises(errors.IndexFileError):
        open_checkpoint(d)


@pytest.mark.timeout(20)
def test_fifo_data_file_does_not_hang(make_checkpoint: Callable[..., Path]) -> None:
    d = make_checkpoint()
    victim = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))[0]
    os.unlink(d / victim)
    os.mkfifo(d / victim)
    result: list[BaseException | None] = []

    def run() -> None:
        try:
            open_checkpoint(d).validate_structure()
            result.append(None)
        except BaseException as e:
            result.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "open_checkpoint blocked on a FIFO"
    assert isinstance(result[0], errors.HeaderError) and "regular file" in str(result[0])


def test_directory_in_place_of_data_file(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    m = save_checkpoint(d)
    victim = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))[0]
    os.unlink(d / victim)
    os.mkdir(d / victim)
    t = Tiny(1)
    snap = snapshot(t)
    with pytest.raises(errors.HeaderError, match=r"regular file|directory"):
        GeneralCheckpointIO().load_model(t, d)
    assert same_state(t, snap) and not same_state(m, snap)


def test_hf_cache_symlinks_are_followed(tmp_path: Path) -> None:
    """The Hugging Face cache keeps snapshots/<rev>/<file> as symlinks to ../../blobs/<sha>."""
    src = tmp_path / "saved"
    m = save_checkpoint(src)
    repo = tmp_path / "models--x--y"
    (repo / "blobs").mkdir(parents=True)
    snap_dir = repo / "snapshots" / "abc123"
    snap_dir.mkdir(parents=True)
    for i, f in enumerate(sorted(os.listdir(src))):
        blob = repo / "blobs" / f"{i:040x}"
        shutil.copy(src / f, blob)
        os.symlink(os.path.relpath(blob, snap_dir), snap_dir / f)
    r = open_checkpoint(snap_dir)
    r.validate_structure()
    assert r.verify() == []
    t = Tiny(5)
    GeneralCheckpointIO().load_model(t, snap_dir, verify=True)
    assert same_state(t, snapshot(m))


def test_non_checkpoint_paths(tmp_path: Path) -> None:
    io = GeneralCheckpointIO()
    t = Tiny()
    with pytest.raises(errors.IncompleteCheckpointError):
        io.load_model(t, tmp_path / "nothing-here")
    with pytest.raises(errors.IncompleteCheckpointError):
        io.load_model(t, tmp_path)  # empty directory
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(UnickptError):
        io.load_model(t, tmp_path / "notes.txt")


@pytest.mark.parametrize(
    "payload",
    [
        b'{"state": {"__tensor__": {"dtype": "F32"}}}',
        b'{"state": {"x": {"__tensor__": {"dtype": "XX", "shape": [1], "data": [1]}}}}',
        b'{"state": {"x": {"__tensor__": {"dtype": "F32", "shape": [1000000000], "data": []}}}}',
        b'{"state": 5}',
        b"[" * 100_000,
        b'{"state": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5001,
        b"\xff\xfe",
        b'{"state": {"x": {"__tensor__": {"dtype": "F32", "shape": [2], "data": [1]}}}}',
        b'{"state": {"x": {"__tensor__": {"dtype": "F32", "shape": [-1], "data": [1]}}}}',
        b'{"state": {"x": {"__tensor__": {"dtype": "F32", "shape": [1], "data": [[1]]}}}}',
        b'{"state": {"x": {"__tensor__": {"dtype": "F32", "shape": [1], "data": "a"}}}}',
        b'{"state": {"x": {"__tensor__": {"dtype": "F32", "shape": [true], "data": [1]}}}}',
        b'{"state": {"x": {"__tensor__": {"dtype": "F32", "shape": [1.0], "data": [1]}}}}',
        b'{"state": {"x": {"__tensor__": {"dtype": "I8", "shape": [1], "data": [1000]}}}}',
        b'{"state": {"x": {"__tensor__": {"dtype": "I64", "shape": [1], "data": [1.5]}}}}',
        b'{"state": {"x": {"__tensor__": {"dtype": "BOOL", "shape": [1], "data": [2]}}}}',
        b'{"state": {"x": {"__tensor__": {"dtype": "F32", "shape": [1], "data": [1], "more": 1}}}}',
        b'{"state": {"x": {"__tensor__": 5}}}',
        b'{"state": {"x": {"__tensor__": {"dtype": "F32", "shape": [1], "data": [1]}, "y": 1}}}',
        b'{"state": {"x": {"__str__": 5}}}',
        b'{"state": {"__int__1": 1, "__int__01": 2}}',
        b'{"state": {"a": 1, "a": 2}}',
        b'{"state": {"a": "\\ud800"}}',
        b'{"state": ' + b"[" * 70 + b"]" * 70 + b"}",
    ],
)
def test_hostile_lr_scheduler_json(payload: bytes, tmp_path: Path) -> None:
    p = tmp_path / "lr_scheduler.json"
    p.write_bytes(payload)
    sched = torch.optim.lr_scheduler.StepLR(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0), 1)
    before = sched.state_dict()
    with pytest.raises(errors.IndexFileError) as ei:
        GeneralCheckpointIO().load_lr_scheduler(sched, p)
    assert str(p) in str(ei.value) and "\n" not in str(ei.value)
    assert sched.state_dict() == before


def test_loading_never_unpickles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Model, optimizer and scheduler checkpoints (single file and sharded) load with pickle disabled."""
    import pickle

    from unickpt import OptimizerWrapper

    m = Tiny(1)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, 3)
    io = GeneralCheckpointIO()
    io.save_model(m, tmp_path / "single.safetensors")
    io.save_model(m, tmp_path / "sharded", shard=True, size_per_shard=1)
    io.save_optimizer(OptimizerWrapper(opt, m), tmp_path / "optim", shard=True)
    io.save_lr_scheduler(sched, tmp_path / "sched.json")

    def boom(*a: object, **k: object) -> None:
        raise AssertionError("pickle invoked while loading a checkpoint")

    for mod, name in [(pickle, "loads"), (pickle, "load"), (pickle, "Unpickler"), (torch, "load")]:
        monkeypatch.setattr(mod, name, boom)
    m2 = Tiny(2)
    opt2 = torch.optim.AdamW(m2.parameters(), lr=0.5)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, 3)
    io.load_model(m2, tmp_path / "single.safetensors", verify=True)
    io.load_model(m2, tmp_path / "sharded", verify=True)
    assert same_state(m2, snapshot(m))
    io.load_optimizer(OptimizerWrapper(opt2, m2), tmp_path / "optim", verify=True)
    io.load_lr_scheduler(sched2, tmp_path / "sched.json")
    for p in [tmp_path / "single.safetensors", tmp_path / "sharded"]:
        r = open_checkpoint(p)
        r.validate_structure()
        assert r.verify() == []
    assert sched2.last_epoch == sched.last_epoch
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


# ------------------------------------------------------------------------------------------------
# Every hostile file through every reader and tool, and the command line.


def _place(tmp_path: Path, name: str) -> Path:
    """The case as a checkpoint directory: a safetensors case as model.safetensors, an index case as
    the model index next to the good data file."""
    d = tmp_path / "ck"
    d.mkdir()
    if name.endswith(".safetensors"):
        shutil.copy(HOSTILE / name, d / "model.safetensors")
    else:
        shutil.copy(HOSTILE / MH.GOOD, d / MH.GOOD)
        shutil.copy(HOSTILE / name, d / INDEX)
    return d


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    from unickpt.cli.main import main

    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ALL_CASES)
def test_hostile_file_through_every_tool(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """open_checkpoint, verify, inspect, diff (plain and --deep), merge, load_model and the CLI each
    answer with the manifest's class (or succeed on an "ok" case); nothing is written on refusal."""
    from unickpt.tools.diff import diff_checkpoints
    from unickpt.tools.inspect import format_report, inspect_checkpoint
    from unickpt.tools.merge import merge_checkpoint
    from unickpt.tools.verify import verify_checkpoint

    d = _place(tmp_path, name)
    want = MANIFEST[name]["error"]
    before = tree_state(tmp_path)
    index_level = True  # the index (or the single file's header) alone shows the problem
    try:
        open_checkpoint(d).close()
    except UnickptError:
        pass
    else:
        index_level = want == "ok"
    data_tools = {
        "open+validate": lambda: open_checkpoint(d).validate_structure(),
        "verify": lambda: verify_checkpoint(d),
        "diff --deep": lambda: diff_checkpoints(d, d, deep=True),
        "merge": lambda: merge_checkpoint(d, tmp_path / "merged"),
    }
    index_tools = {
        "inspect": lambda: format_report(inspect_checkpoint(d), verbose=True),
        "diff --index-only": lambda: diff_checkpoints(d, d, index_only=True),
    }
    if want == "ok":
        for _tool, fn in {**data_tools, **index_tools}.items():
            fn()  # a valid checkpoint: no error at all
        assert verify_checkpoint(d) == []
        merged = open_checkpoint(tmp_path / "merged")
        assert sorted(merged.tensors) == sorted(open_checkpoint(d).tensors)
        assert merged.verify() == []
        assert diff_checkpoints(d, tmp_path / "merged", deep=True).identical
        shutil.rmtree(tmp_path / "merged")
    else:
        cls = expected(name)
        for _tool, fn in data_tools.items():
            with pytest.raises(cls):
                fn()
        for _tool, fn in index_tools.items():
            if index_level:
                with pytest.raises(cls):
                    fn()
            else:
                fn()  # reads only the index, which is fine
        # diff reads the data of tensors without fingerprints only: the index's refusal, or none
        with contextlib.suppress(cls):
            diff_checkpoints(d, d)
        assert not (tmp_path / "merged").exists()
    # load_model: the model's names differ from the odd ones, so a mismatch; never anything else.
    m = Good()
    snap = snapshot(m)
    if want == "ok":
        with contextlib.suppress(errors.StateMismatchError):
            GeneralCheckpointIO().load_model(m, d, verify=True)
    else:
        with pytest.raises((expected(name), errors.StateMismatchError)):
            GeneralCheckpointIO().load_model(m, d, verify=True)
        assert same_state(m, snap)
    capsys.readouterr()
    # The command line: documented exit codes, one line on stderr, never a traceback.
    code_of = {"ok": 0}
    for argv in (
        ["inspect", str(d)],
        ["inspect", "--json", "--slices", str(d)],
        ["verify", "-q", str(d)],
        ["diff", "--deep", str(d), str(d)],
        ["merge", "-q", str(d), str(tmp_path / "merged-cli")],
    ):
        code, out, err = _cli(argv, capsys)
        index_only = argv[0] == "inspect"
        if want == "ok" or (index_only and not index_level):
            assert code == code_of.get(want, 0), (argv, err)
            if argv[1] == "--json":
                json.loads(out)
        else:
            assert code == 2, (argv, code, err)
            assert err.startswith(f"unickpt {argv[0]}: error: ") and err.count("\n") == 1, err
        assert "Traceback" not in err
    shutil.rmtree(tmp_path / "merged-cli", ignore_errors=True)
    assert tree_state(tmp_path) == before


def test_corpus_covers_every_class_and_valid_oddities() -> None:
    found = {MANIFEST[n]["error"] for n in ALL_CASES}
    assert {"HeaderError", "IndexFileError", "UnsafePathError", "IncompleteCheckpointError", "ok"} <= found
    assert sum(MANIFEST[n]["error"] == "ok" for n in ALL_CASES) >= 14


# ------------------------------------------------------------------------------------------------
# File-system oddities: a directory, FIFO, device or symlink loop where a file should be.


def _fs_case(kind: str, root: Path) -> tuple[Path, type[UnickptError], str]:
    """Build the case under ``root``; return (path to open, expected class, words of the message)."""
    d = root / "ck"
    if kind == "index_is_dir":
        (d / INDEX).mkdir(parents=True)
        return d, errors.IndexFileError, "is a directory"
    if kind == "single_is_dir":
        (d / "model.safetensors").mkdir(parents=True)
        return d, errors.HeaderError, "is a directory"
    if kind == "index_symlink_loop":
        d.mkdir()
        os.symlink(INDEX, d / INDEX)
        return d, errors.IndexFileError, "symbolic link loop"
    if kind == "single_symlink_loop":
        d.mkdir()
        os.symlink("model.safetensors", d / "model.safetensors")
        return d, errors.HeaderError, "symbolic link loop"
    if kind == "index_symlink_to_own_dir":
        d.mkdir()
        os.symlink(".", d / INDEX)
        return d, errors.IndexFileError, "is a directory"
    if kind == "data_file_symlink_loop":
        save_checkpoint(d)
        victim = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))[0]
        os.unlink(d / victim)
        os.symlink(victim, d / victim)
        return d, errors.HeaderError, "symbolic link loop"
    if kind == "path_is_fifo":
        d.mkdir()
        os.mkfifo(d / "model.safetensors")
        return d / "model.safetensors", errors.HeaderError, "is a FIFO"
    if kind == "dir_holds_fifo":
        d.mkdir()
        os.mkfifo(d / "model.safetensors")
        return d, errors.HeaderError, "is a FIFO"
    assert kind == "path_is_device"
    return Path("/dev/null"), errors.HeaderError, "is a device"


FS_CASES = [
    "index_is_dir",
    "single_is_dir",
    "index_symlink_loop",
    "single_symlink_loop",
    "index_symlink_to_own_dir",
    "data_file_symlink_loop",
    "path_is_fifo",
    "dir_holds_fifo",
    "path_is_device",
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FS_CASES)
def test_file_system_oddities_refused_by_every_tool(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from unickpt.tools.diff import diff_checkpoints
    from unickpt.tools.inspect import inspect_checkpoint
    from unickpt.tools.merge import merge_checkpoint
    from unickpt.tools.verify import verify_checkpoint

    if kind == "path_is_device" and not os.path.exists("/dev/null"):
        pytest.skip("no /dev/null")
    p, cls, words = _fs_case(kind, tmp_path)
    before = tree_state(tmp_path)
    calls = {
        "open": lambda: open_checkpoint(p).validate_structure(),
        "load_model": lambda: GeneralCheckpointIO().load_model(Tiny(), p),
        "verify": lambda: verify_checkpoint(p),
        "inspect": lambda: inspect_checkpoint(p),
        "diff --deep": lambda: diff_checkpoints(p, p, deep=True),
        "merge": lambda: merge_checkpoint(p, tmp_path / "out"),
    }
    for tool, fn in calls.items():
        if kind == "data_file_symlink_loop" and tool == "inspect":
            fn()  # inspect reads the index only
            continue
        with pytest.raises(cls, match=words):
            fn()
    for argv in (["verify", "-q", str(p)], ["merge", "-q", str(p), str(tmp_path / "out2")]):
        code, _, err = _cli(argv, capsys)
        assert code == 2 and words in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out2").exists()
    assert tree_state(tmp_path) == before


# ------------------------------------------------------------------------------------------------
# A single file is read under any name; a directory is never guessed from its data files.


@pytest.mark.parametrize(
    "new_name",
    [
        "mymodel.safetensors",
        "pytorch_model.safetensors",
        "my model (final) \u00e9t\u00e9.safetensors",
        "weights.bin.x",
    ],
)
def test_renamed_single_file_read_by_every_tool(tmp_path: Path, new_name: str) -> None:
    from unickpt import OptimizerWrapper
    from unickpt.tools.diff import diff_checkpoints
    from unickpt.tools.inspect import inspect_checkpoint
    from unickpt.tools.merge import merge_checkpoint
    from unickpt.tools.verify import verify_checkpoint

    io = GeneralCheckpointIO()
    m = Tiny(3)
    opt = torch.optim.AdamW(m.parameters(), lr=0.25)
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    io.save_model(m, tmp_path / "a" / "model.safetensors")
    io.save_optimizer(OptimizerWrapper(opt, m), tmp_path / "a" / "optimizer.safetensors")
    model_file = tmp_path / "a" / new_name
    optim_file = tmp_path / "a" / ("optim-" + new_name)
    os.rename(tmp_path / "a" / "model.safetensors", model_file)
    os.rename(tmp_path / "a" / "optimizer.safetensors", optim_file)
    t = Tiny(4)
    io.load_model(t, model_file, verify=True)
    assert same_state(t, snapshot(m))
    opt2 = torch.optim.AdamW(t.parameters(), lr=0.5)
    io.load_optimizer(OptimizerWrapper(opt2, t), optim_file, verify=True)
    assert opt2.param_groups[0]["lr"] == 0.25
    assert verify_checkpoint(model_file) == [] and verify_checkpoint(optim_file) == []
    assert inspect_checkpoint(model_file)["kind"] == "model"
    assert inspect_checkpoint(optim_file)["kind"] == "optimizer"  # from its metadata, not its name
    assert diff_checkpoints(model_file, model_file, deep=True).identical
    merge_checkpoint(model_file, tmp_path / "merged")
    merge_checkpoint(optim_file, tmp_path / "merged-optim")
    assert os.listdir(tmp_path / "merged-optim") == ["optimizer.safetensors"]
    assert diff_checkpoints(model_file, tmp_path / "merged").identical
    # Asking for the other kind is refused by name, never loaded as it.
    with pytest.raises(errors.IndexFileError, match=r"of kind 'optimizer' .*expected 'model'"):
        io.load_model(Tiny(), optim_file)


def test_directory_with_one_oddly_named_file_is_not_a_checkpoint(tmp_path: Path) -> None:
    """A directory is a checkpoint through its index or model.safetensors only (data files of an
    interrupted save are never guessed at); the message names the file to pass instead."""
    io = GeneralCheckpointIO()
    io.save_model(Tiny(1), tmp_path / "d" / "model.safetensors")
    os.rename(tmp_path / "d" / "model.safetensors", tmp_path / "d" / "mymodel.safetensors")
    with pytest.raises(
        errors.IncompleteCheckpointError, match=r"'mymodel\.safetensors'.*pass the path of the file"
    ):
        io.load_model(Tiny(), tmp_path / "d")
    io.load_model(Tiny(), tmp_path / "d" / "mymodel.safetensors")


def test_json_state_values_round_trip_and_odd_valid_ones() -> None:
    from unickpt.io.jsonstate import from_json_value, to_json_value

    for v in [
        torch.tensor(2.5),
        torch.zeros(0, 3),
        torch.tensor([True, False]),
        torch.arange(6).reshape(2, 3),
    ]:
        back = from_json_value(json.loads(json.dumps(to_json_value(v, "x"))))
        assert torch.equal(back, v) and back.dtype == v.dtype
    nan = from_json_value({"__tensor__": {"dtype": "F32", "shape": [2], "data": [float("nan"), -0.0]}})
    assert torch.isnan(nan[0]) and str(nan[1].item()) == "-0.0"
    assert from_json_value({"__int__-3": [1, {"a": None}]}) == {-3: [1, {"a": None}]}


# ------------------------------------------------------------------------------------------------
# The command line never crashes on names, and never exits 1 for a bug.


def test_cli_prints_unprintable_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import io as _io

    d = _place(tmp_path, "st_name_controls.safetensors")
    # A terminal that cannot show the names: escaped, not a UnicodeEncodeError.
    ascii_out = _io.TextIOWrapper(_io.BytesIO(), encoding="ascii")
    saved = sys.stdout
    sys.stdout = ascii_out
    try:
        from unickpt.cli.main import main

        assert main(["inspect", "--slices", str(_place_rtl(tmp_path))]) == 0
        assert main(["inspect", str(d)]) == 0
        ascii_out.flush()
        text = ascii_out.buffer.getvalue().decode("ascii")  # type: ignore[attr-defined]
    finally:
        sys.stdout = saved
    assert "\\u202e" in text


def _place_rtl(tmp_path: Path) -> Path:
    d = tmp_path / "rtl"
    d.mkdir()
    shutil.copy(HOSTILE / "st_name_rtl.safetensors", d / "model.safetensors")
    return d


def test_cli_internal_error_is_one_line_and_exit_3(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from unickpt.cli.main import EXIT_INTERNAL, main
    from unickpt.tools import inspect as inspect_mod

    def boom(*a: object, **k: object) -> None:
        raise KeyError("simulated bug\nsecond line")

    monkeypatch.setattr(inspect_mod, "inspect_checkpoint", boom)
    code, _, err = _cli(["inspect", str(tmp_path)], capsys)
    assert code == EXIT_INTERNAL == 3
    assert err.count("\n") == 1 and "Traceback" not in err and "KeyError" in err and "bug in unickpt" in err
    monkeypatch.setenv("UNICKPT_TRACEBACK", "1")
    with pytest.raises(KeyError):
        main(["inspect", str(tmp_path)])


@pytest.mark.parametrize(
    ("index", "cls"),
    [
        (b'{"weight_map": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", errors.CheckpointFormatError),
        (
            b'{"weight_map": {"a": "pytorch_model.bin", "a": "pytorch_model.bin"}}',
            errors.CheckpointFormatError,
        ),
        (b'\xef\xbb\xbf{"weight_map": {"a": "pytorch_model.bin"}}', errors.CheckpointFormatError),
        (b'{"weight_map": {"\xff": "pytorch_model.bin"}}', errors.CheckpointFormatError),
        (b'{"weight_map": {"a": "\\ud800.bin"}}', errors.CheckpointFormatError),
        (b'{"weight_map": [1]}', errors.CheckpointFormatError),
        (b'{"weight_map": {"a": 5}}', errors.CheckpointFormatError),
        (b"[]", errors.CheckpointFormatError),
        (b"", errors.CheckpointFormatError),
        (b'{"weight_map": {"a": "../pytorch_model.bin"}}', errors.UnsafePathError),
        (b'{"weight_map": {"a": "pytorch_model-00002-of-00002.bin"}}', errors.IncompleteCheckpointError),
    ],
)
def test_hostile_bin_index_refused_by_convert(index: bytes, cls: type[UnickptError], tmp_path: Path) -> None:
    from unickpt.cli.main import main
    from unickpt.tools.convert import convert_checkpoint

    src = tmp_path / "src"
    src.mkdir()
    torch.save({"a": torch.ones(2)}, src / "pytorch_model.bin")
    (src / "pytorch_model.bin.index.json").write_bytes(index)
    with pytest.raises(cls):
        convert_checkpoint(src, tmp_path / "out", source="bin")
    assert main(["convert", "--from", "bin", "-q", str(src), str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "edit",
    [
        lambda b: b["param_state"].update(x={"k": json.loads("[" * 60 + "]" * 60)}),
        lambda b: b["param_groups"][0].update(extra=json.loads("[" * 60 + "]" * 60)),
        lambda b: b["param_state"].update(x={"k": "\ud800"}),
        lambda b: b.update(format_version=True),
    ],
)
def test_hostile_optimizer_block_refused_before_anything_changes(edit: Any, tmp_path: Path) -> None:
    from unickpt import OptimizerWrapper

    m = Tiny(1)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    io = GeneralCheckpointIO()
    d = tmp_path / "optim"
    io.save_optimizer(OptimizerWrapper(opt, m), d, shard=True)
    idx = d / "optimizer.safetensors.index.json"
    obj = json.loads(idx.read_text())
    obj["unickpt"].setdefault("param_state", {})
    edit(obj["unickpt"])
    idx.write_text(json.dumps(obj))  # ensure_ascii: a lone surrogate is written as its escape
    m2 = Tiny(2)
    opt2 = torch.optim.AdamW(m2.parameters(), lr=0.5)
    before = json.dumps(opt2.state_dict(), default=str)
    with pytest.raises(errors.IndexFileError):
        io.load_optimizer(OptimizerWrapper(opt2, m2), d)
    assert json.dumps(opt2.state_dict(), default=str) == before


@pytest.mark.parametrize("case", ["st_name_controls.safetensors", "st_name_rtl.safetensors"])
def test_tables_escape_control_and_bidi_characters(case: str, tmp_path: Path) -> None:
    """A tensor name holding a newline, an ANSI escape or a right-to-left override is printed
    escaped: one table row per tensor, nothing the terminal would act on."""
    from unickpt.tools.diff import diff_checkpoints
    from unickpt.tools.inspect import format_report, inspect_checkpoint

    d = _place(tmp_path, case)
    info = inspect_checkpoint(d, slices=True)
    table = format_report(info, verbose=True)
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(HOSTILE / "st_no_tensors.safetensors", other / "model.safetensors")
    report = diff_checkpoints(d, other).format()  # every odd name listed as only in A
    for out in (table, report):
        assert all(c.isprintable() for line in out.split("\n") for c in line), ascii(out)[:300]
    weird = [n for n in info["tensors"] if not n.isprintable()]
    assert weird and all(ascii(n)[1:-1] in table and ascii(n)[1:-1] in report for n in weird)
    rows = 8 + len(info["tensors"]) + sum(len(t["slices"]) for t in info["tensors"].values())
    assert len(table.split("\n")) == rows
