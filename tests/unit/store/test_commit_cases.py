"""The commit protocol's named cases: layout changes, two kinds in one directory, the save id, racing
readers, leftovers of killed saves, merge/convert outputs (docs/format.md, section 6)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from _reliability import TINY_SHARD_MB, Tiny, header_of, run_child, same_state, save_checkpoint, snapshot
from safetensors import safe_open

from unickpt import GeneralCheckpointIO
from unickpt.ckpt.reader import CheckpointReader, open_checkpoint
from unickpt.errors import CheckpointChangedError, IncompleteCheckpointError, IndexFileError
from unickpt.spec.index import parse_index
from unickpt.store.lock import LOCK_NAME
from unickpt.store.publish import SAVE_ID_KEY, parse_temp_name, temp_name
from unickpt.tools._common import OutputExistsError
from unickpt.tools.merge import merge_checkpoint

IDX = "model.safetensors.index.json"


def _hf_state(d: Path) -> dict[str, torch.Tensor]:
    """What transformers loads: ``model.safetensors`` first, else the index's weight_map."""
    out: dict[str, torch.Tensor] = {}
    if (d / "model.safetensors").exists():
        with safe_open(str(d / "model.safetensors"), framework="pt") as h:
            return {k: h.get_tensor(k) for k in h.keys()}  # noqa: SIM118 - safe_open has no __iter__
    wm = json.loads((d / IDX).read_text())["weight_map"]
    for name, f in wm.items():
        with safe_open(str(d / f), framework="pt") as h:
            out[name] = h.get_tensor(name)
    return out


def _loads_as(d: Path, seed: int) -> None:
    m = Tiny(99)
    GeneralCheckpointIO().load_model(m, d, verify=True)
    assert same_state(m, snapshot(Tiny(seed)))
    hf = _hf_state(d)
    want = snapshot(Tiny(seed))
    assert set(hf) == set(want) and all(torch.equal(hf[k], want[k]) for k in want)


@pytest.mark.parametrize("first", ["sharded", "single"])
def test_the_last_save_wins_whatever_the_layouts(tmp_path: Path, first: str) -> None:
    """Issue 14.2: sharded then single made load_model read the old shards while transformers read the new file."""
    io = GeneralCheckpointIO()
    d = tmp_path / "ck"
    save_checkpoint(d, 1, sharded=first == "sharded", io=io)
    save_checkpoint(d, 2, sharded=first != "sharded", io=io)
    _loads_as(d, 2)
    names = sorted(os.listdir(d))
    if first == "sharded":
        assert names == ["model.safetensors"]  # index and old shards removed
    else:
        assert "model.safetensors" not in names and IDX in names
    # Re-saves of the same layout with fewer shard files leave none of the old ones behind.
    save_checkpoint(d, 3, shard_mb=1.0, io=io)
    _loads_as(d, 3)
    assert sorted(os.listdir(d)) == sorted([IDX, "model-00001-of-00001.safetensors"])


def test_a_save_of_one_kind_never_touches_the_other(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    io = GeneralCheckpointIO()
    m = Tiny(1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    from unickpt import OptimizerWrapper

    io.save_optimizer(OptimizerWrapper(opt, m), str(d), shard=True, size_per_shard=TINY_SHARD_MB)
    before = {f: (d / f).read_bytes() for f in os.listdir(d)}
    save_checkpoint(d, 2, io=io)
    save_checkpoint(d, 3, sharded=False, io=io)
    for f, data in before.items():
        assert (d / f).read_bytes() == data, f
    _loads_as(d, 3)


def test_every_data_file_names_the_save_of_its_index(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    save_checkpoint(d, 1)
    idx = json.loads((d / IDX).read_text())
    sid = idx["unickpt"]["save_id"]
    assert len(sid) == 32 and int(sid, 16) >= 0
    files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
    assert len(files) >= 3
    for f in files:
        h, _ = header_of(d / f)
        assert h["__metadata__"] == {"format": "pt", SAVE_ID_KEY: sid}
    save_checkpoint(d, 1)
    assert json.loads((d / IDX).read_text())["unickpt"]["save_id"] != sid  # a new id per save
    single = tmp_path / "one.safetensors"
    save_checkpoint(single, 1, sharded=False)
    meta = header_of(single)[0]["__metadata__"]
    assert meta[SAVE_ID_KEY] == json.loads(meta["unickpt"])["save_id"]


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        ("0123456789abcdef0123456789abcdef", True),
        (None, True),
        ("0123456789ABCDEF0123456789ABCDEF", False),
        ("0123", False),
        (12, False),
        ("g" * 32, False),
    ],
)
def test_save_id_fast_and_schema_parsers_agree(value: object, ok: bool) -> None:
    idx = {
        "metadata": {"total_size": 4},
        "weight_map": {"a": "model.safetensors"},
        "unickpt": {
            "kind": "model",
            "tensors": {
                "a": {
                    "dtype": "F32",
                    "shape": [1],
                    "slices": [{"file": "model.safetensors", "key": "a", "offsets": [0], "shape": [1]}],
                }
            },
            "save_id": value,
        },
    }
    raw = json.dumps(idx).encode()
    if ok:
        assert parse_index(raw, "i").unickpt.save_id == value  # type: ignore[union-attr]
    else:
        with pytest.raises(IndexFileError, match=r"unickpt\.save_id: expected null or a string matching"):
            parse_index(raw, "i")


def test_a_reader_racing_an_in_place_save_never_mixes(tmp_path: Path) -> None:
    """Issue 14.4: a reader holding the old index reads a data file after a save replaced it."""
    d = tmp_path / "ck"
    io = GeneralCheckpointIO()
    save_checkpoint(d, 1, io=io)
    r = open_checkpoint(d)
    files = r.files
    r.header(files[0])  # this file is now open: its old bytes stay readable
    old_sid = r.block.save_id
    save_checkpoint(d, 2, io=io)  # same names, new files
    new_sid = open_checkpoint(d).block.save_id
    first = next(t for t in r.tensors.values() if t.slices[0].file == files[0])
    assert r.verify([n for n, t in r.tensors.items() if t.slices[0].file == files[0]]) == []
    del first
    with pytest.raises(CheckpointChangedError) as e:
        r.header(files[1])
    msg = str(e.value)
    assert (
        files[1] in msg and f"save {new_sid}" in msg and f"save {old_sid}" in msg and "load it again" in msg
    )
    r.close()
    # A reader whose data files change between its index read and its pin re-reads the index once.
    calls = {"n": 0}
    orig = CheckpointReader.pin

    def pin_after_a_save(self: CheckpointReader) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            save_checkpoint(d, 3, io=io)
        orig(self)

    CheckpointReader.pin = pin_after_a_save  # type: ignore[method-assign]
    try:
        m = Tiny(99)
        io.load_model(m, d, verify=True)
    finally:
        CheckpointReader.pin = orig  # type: ignore[method-assign]
    assert calls["n"] == 2 and same_state(m, snapshot(Tiny(3)))


def test_a_vanished_data_file_after_a_commit_is_a_changed_checkpoint(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    io = GeneralCheckpointIO()
    save_checkpoint(d, 1, io=io)
    r = open_checkpoint(d)
    save_checkpoint(d, 2, sharded=False, io=io)  # the shards are removed after the commit
    with pytest.raises(CheckpointChangedError, match="vanished"):
        r.header(r.files[0])
    # Without a new commit, a missing file is a damaged checkpoint, as before.
    save_checkpoint(d, 2, io=io)
    r = open_checkpoint(d)
    os.unlink(d / r.files[0])
    with pytest.raises(IncompleteCheckpointError, match="missing"):
        r.header(r.files[0])


def test_killed_single_file_saves_leave_nothing_after_the_next_save(tmp_path: Path) -> None:
    """Issue 14.7: 30 kills mid-write leaked their staging files forever."""
    d = tmp_path / "ck"
    io = GeneralCheckpointIO()
    save_checkpoint(d, 1, sharded=False, io=io)
    (d / "notes.tmp-0123456789ab").write_text("user file")  # not a staging name: kept
    (d / ".mine.tmp-0123456789ab").write_text("user file")  # a staging name of a non-checkpoint file, no pid
    killed = 0
    for k in range(2, 32):
        sig = run_child(k, lambda: save_checkpoint(d, 2, sharded=False), tmp_path / "log.json")
        killed += sig == signal.SIGKILL
    leftovers = [
        f for f in os.listdir(d) if (p := parse_temp_name(f)) is not None and p[0] == "model.safetensors"
    ]
    # Kills before the staging file exists or after its rename leave none; the rest leave one each.
    assert killed >= 20 and len(leftovers) >= 5
    save_checkpoint(d, 3, sharded=False, io=io)
    assert sorted(os.listdir(d)) == sorted(
        ["model.safetensors", "notes.tmp-0123456789ab", ".mine.tmp-0123456789ab"]
    )
    _loads_as(d, 3)
    # The same for the other layouts: a sharded save cleans what killed single-file saves left.
    for k in (5, 9, 13):
        run_child(k, lambda: save_checkpoint(d, 2, sharded=False), tmp_path / "log.json")
    save_checkpoint(d, 4, io=io)
    assert not [f for f in os.listdir(d) if parse_temp_name(f) and f != ".mine.tmp-0123456789ab"]
    assert LOCK_NAME not in os.listdir(d)


def test_merge_into_a_directory_of_leftovers_and_beside_dead_staging(tmp_path: Path) -> None:
    src = tmp_path / "src"
    save_checkpoint(src, 1)
    out = tmp_path / "out"
    out.mkdir()
    (out / ".model-00001-of-00002.safetensors.tmp-0123456789ab").write_bytes(b"partial")
    (out / LOCK_NAME).write_text("999999999\n")  # a dead save's lock
    dead = temp_name(str(out)).replace(f"-{os.getpid()}-", "-999999999-")
    os.mkdir(dead)
    merge_checkpoint(src, out)
    assert sorted(os.listdir(out)) == ["model.safetensors"]
    assert not os.path.exists(dead)
    _loads_as(out, 1)
    with pytest.raises(OutputExistsError):
        merge_checkpoint(src, out)  # a checkpoint is never replaced by a merge
    _loads_as(out, 1)


def test_indexes_of_older_writers_and_plain_hugging_face_indexes(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    save_checkpoint(d, 1)
    idx = json.loads((d / IDX).read_text())
    # A unickpt index without a save id (an older writer) never names files of a save.
    old = json.loads(json.dumps(idx))
    del old["unickpt"]["save_id"]
    (d / IDX).write_text(json.dumps(old))
    r = open_checkpoint(d)
    with pytest.raises(CheckpointChangedError, match="records no save id"):
        r.header(r.files[0])
    r.close()
    # A plain Hugging Face index (no unickpt block) says nothing about saves: it loads.
    plain = {"metadata": idx["metadata"], "weight_map": idx["weight_map"]}
    (d / IDX).write_text(json.dumps(plain))
    m = Tiny(99)
    GeneralCheckpointIO().load_model(m, d)
    assert same_state(m, snapshot(Tiny(1)))
