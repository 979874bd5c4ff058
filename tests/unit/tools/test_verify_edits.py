"""Index edits that used to pass ``verify``: each is now found, by verify and by load_model.

Every case edits the index (or data) of a real checkpoint written by ``save_model`` and
asserts the exact error class, that the message names the file, the tensor and the finding,
the CLI exit code (docs/cli.md: 1 integrity failure, 2 unusable input), and that
``load_model`` refuses the structural ones before copying anything.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from unickpt import GeneralCheckpointIO, IndexFileError, OptimizerWrapper, merge_checkpoint, verify_checkpoint
from unickpt.ckpt.reader import open_checkpoint
from unickpt.cli.main import main as cli
from unickpt.spec.hashing import slice_hash
from unickpt.spec.index import as_listed as listed
from unickpt.spec.index import hex_to_b64
from unickpt.spec.naming import SLICED_SENTINEL
from unickpt.tools import verify as verify_mod
from unickpt.tools.verify import FingerprintFailure, MissingHash

INDEX = "model.safetensors.index.json"


def _model() -> torch.nn.Module:
    torch.manual_seed(7)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 3))
    m.register_buffer("grid", torch.arange(5 * 7 * 3, dtype=torch.float32).reshape(5, 7, 3))
    return m


def _save(tmp_path: Path, gather: bool, name: str = "ck") -> Path:
    return Path(
        GeneralCheckpointIO().save_model(_model(), tmp_path / name, shard=True, gather_dtensor=gather)
    )


def _edit(d: Path, change: Callable[[dict[str, Any]], None]) -> None:
    p = d / INDEX
    obj = listed(json.loads(p.read_text()))  # slices listed: their hashes in hex
    change(obj)
    p.write_text(json.dumps(obj))


def _zeros() -> torch.nn.Module:
    m = _model()
    with torch.no_grad():
        for t in m.state_dict().values():
            t.zero_()
    return m


def _refused(d: Path, match: str, capsys: pytest.CaptureFixture[str]) -> None:
    """verify raises IndexFileError matching ``match``; the CLI exits 2; load_model copies nothing."""
    with pytest.raises(IndexFileError, match=match):
        verify_checkpoint(d)
    capsys.readouterr()
    assert cli(["verify", "-q", str(d)]) == 2
    assert re.search(match, capsys.readouterr().err)
    m = _zeros()
    with pytest.raises(IndexFileError, match=match):
        GeneralCheckpointIO().load_model(m, str(d), strict=False)
    assert all(not t.any() for t in m.state_dict().values()), "load_model copied data before refusing"


def _slice(obj: dict[str, Any], name: str, k: int = 0) -> dict[str, Any]:
    s: dict[str, Any] = obj["unickpt"]["tensors"][name]["slices"][k]
    return s


def test_untouched_checkpoints_verify_and_say_what_was_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for gather in (True, False):
        d = _save(tmp_path, gather, f"ck{gather}")
        report = verify_checkpoint(d)
        assert report == [] and report.hashed == report.slices == 7 and report.fingerprints == 7
        assert report.unhashed == 0
        assert cli(["verify", str(d)]) == 0
        out = capsys.readouterr().out
        assert "7 of 7 slices rehashed" in out and "7 of 7 fingerprints recomputed from the data" in out


def test_two_slices_naming_one_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = _save(tmp_path, gather=False)

    def dup(obj: dict[str, Any]) -> None:
        # 1.weight now reads 0.weight's stored block: same shape, hash and all.
        a, b = _slice(obj, "0.weight"), _slice(obj, "1.weight")
        b.update(key=a["key"], file=a["file"], xxh3=a["xxh3"])

    _edit(d, dup)
    _refused(
        d,
        r"key '0\.weight@0' of file 'model-\S+' is named by two slices: tensor '0\.weight' slice 0 "
        r"and tensor '1\.weight' slice 0",
        capsys,
    )


def test_a_slice_listed_twice_in_one_tensor(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = _save(tmp_path, gather=False)

    def twice(obj: dict[str, Any]) -> None:
        t = obj["unickpt"]["tensors"]["grid"]
        s = dict(t["slices"][0])
        t["shape"] = [10, 7, 3]
        s2 = dict(s, offsets=[5, 0, 0])
        t["slices"] = [s, s2]  # rows duplicated on load: the same block at rows 0-4 and 5-9

    _edit(d, twice)
    _refused(
        d,
        r"key 'grid@0' of file '\S+' is named by two slices: tensor 'grid' slice 0 and tensor 'grid' "
        r"slice 1",
        capsys,
    )


def test_key_no_slice_references(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = _save(tmp_path, gather=False)

    def drop(obj: dict[str, Any]) -> None:
        del obj["unickpt"]["tensors"]["2.bias"]
        del obj["weight_map"]["2.bias"]

    _edit(d, drop)
    match = r"model-\S+\.safetensors: holds 1 key\(s\) that no slice of the index references: '2\.bias@0'"
    with pytest.raises(IndexFileError, match=match):
        verify_checkpoint(d)
    with pytest.raises(IndexFileError, match=match):
        merge_checkpoint(str(d), str(tmp_path / "merged"))
    assert not (tmp_path / "merged").exists()
    assert cli(["verify", "-q", str(d)]) == 2
    m = _zeros()
    with pytest.raises(IndexFileError, match=match):
        GeneralCheckpointIO().load_model(m, str(d), strict=False)
    assert all(not t.any() for t in m.state_dict().values())


@pytest.mark.parametrize(
    "case",
    ["other_file", "missing_name", "extra_name", "sentinel_in_gathered", "layout_says_sliced"],
)
def test_gathered_weight_map_disagrees(tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str) -> None:
    d = _save(tmp_path, gather=True)
    idx = listed(json.loads((d / INDEX).read_text()))
    real = idx["weight_map"]["1.weight"]
    stale = "model-00002-of-00002.safetensors"
    shutil.copy(d / real, d / stale)  # a stale file a Hugging Face loader would read instead

    edits: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
        "other_file": (
            lambda o: o["weight_map"].update({"1.weight": stale}),
            rf"weight_map puts tensor '1\.weight' in '{stale}' but the unickpt block stores it in '{real}'",
        ),
        "missing_name": (
            lambda o: o["weight_map"].pop("1.weight"),
            r"tensor\(s\) '1\.weight' are in the unickpt block but not in weight_map",
        ),
        "extra_name": (
            lambda o: o["weight_map"].update({"3.weight": real}),
            r"weight_map names '3\.weight', which the unickpt block does not hold",
        ),
        "sentinel_in_gathered": (
            lambda o: o["weight_map"].update({"0.bias": SLICED_SENTINEL}),
            r"weight_map mixes the sliced-checkpoint sentinel \(e\.g\. tensor '0\.bias'\) with real files",
        ),
        "layout_says_sliced": (
            lambda o: o["unickpt"]["layout"].update({"gathered": False}),
            r"weight_map describes a gathered checkpoint but unickpt\.layout\.gathered is false",
        ),
    }
    change, match = edits[case]
    _edit(d, change)
    _refused(d, re.escape(str(d / INDEX)) + ": " + match, capsys)


def test_real_file_in_sliced_index(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = _save(tmp_path, gather=False)
    idx = listed(json.loads((d / INDEX).read_text()))
    file = _slice(idx, "2.bias")["file"]
    _edit(d, lambda o: o["weight_map"].update({"2.bias": file}))
    _refused(
        d,
        rf"weight_map mixes the sliced-checkpoint sentinel \(e\.g\. tensor '\S+'\) with real files "
        rf"\(e\.g\. tensor '2\.bias' -> '{file}'\)",
        capsys,
    )
    # All real files: the index says gathered, the slices are not.
    _edit(d, lambda o: o["weight_map"].update({n: file for n in o["weight_map"]}))
    _refused(d, r"weight_map describes a gathered checkpoint but unickpt\.layout\.gathered is false", capsys)
    _edit(d, lambda o: o["unickpt"]["layout"].update({"gathered": True}))
    _refused(
        d,
        r"tensor '\S+' is stored as key '\S+@0' at offsets \[0(, 0)*\] with shape \[[0-9, ]+\] in a "
        r"gathered checkpoint, which stores each tensor whole under its own name",
        capsys,
    )


@pytest.mark.parametrize("gather", [True, False])
def test_fingerprint_that_no_longer_matches_the_data(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], gather: bool
) -> None:
    d = _save(tmp_path, gather=gather)
    _edit(d, lambda o: o["unickpt"]["tensors"]["grid"].update(fingerprint=hex_to_b64("0123456789abcdef")))
    report = verify_checkpoint(d)
    assert [type(f) for f in report] == [FingerprintFailure]
    f = report[0]
    assert f.tensor == "grid" and f.expected == "0123456789abcdef" and f.found != f.expected
    assert cli(["verify", "-q", str(d)]) == 1
    err = capsys.readouterr().err
    assert (
        "tensor 'grid' (in model-" in err and "recorded fingerprint 0123456789abcdef, the data gives" in err
    )


def test_data_edited_with_its_slice_hash_is_caught_by_the_fingerprint(tmp_path: Path) -> None:
    """A tool that rewrites data and its slice hash (not the fingerprint) no longer passes."""
    d = _save(tmp_path, gather=False)
    r = open_checkpoint(d)
    s = r.tensors["grid"].slices[0]
    path, off, n = r.key_location(s.file, s.key)
    r.close()
    raw = bytearray(Path(path).read_bytes())
    raw[off : off + 4], raw[off + 4 : off + 8] = (
        raw[off + 4 : off + 8],
        raw[off : off + 4],
    )  # swap two elements
    Path(path).write_bytes(bytes(raw))
    new_hash = slice_hash(bytes(raw[off : off + n]))
    _edit(d, lambda o: _slice(o, "grid").update(xxh3=new_hash))
    report = verify_checkpoint(d)
    assert [(type(f), f.tensor) for f in report] == [(FingerprintFailure, "grid")]


def test_fingerprints_recomputed_in_small_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks that straddle rows and columns give the same fingerprints (bounded memory)."""
    for gather in (True, False):
        d = _save(tmp_path, gather, f"c{gather}")
        for chunk in (4, 8, 20, 28, 44):
            monkeypatch.setattr(verify_mod, "_CHUNK", chunk)
            report = verify_checkpoint(d)
            assert report == [] and report.fingerprints == 7, chunk
    # And a changed element is still found with chunks of one element.
    monkeypatch.setattr(verify_mod, "_CHUNK", 4)
    _edit(d, lambda o: o["unickpt"]["tensors"]["grid"].update(fingerprint=hex_to_b64("f" * 16)))
    assert [f.tensor for f in verify_checkpoint(d)] == ["grid"]


def test_require_hashes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = _save(tmp_path, gather=True)
    _edit(d, lambda o: _slice(o, "0.bias").pop("xxh3"))
    report = verify_checkpoint(d)
    assert report == [] and report.unhashed == 1 and report.hashed == 6
    assert cli(["verify", str(d)]) == 0
    out = capsys.readouterr().out
    assert "6 of 7 slices rehashed" in out and "1 slice(s) carry no hash" in out
    report = verify_checkpoint(d, require_hashes=True)
    assert [(type(f), f.tensor) for f in report] == [(MissingHash, "0.bias")]
    assert cli(["verify", "-q", "--require-hashes", str(d)]) == 1
    err = capsys.readouterr().err
    assert "tensor '0.bias' in file 'model-" in err and "no xxh3-64 recorded" in err


def test_unhashed_checkpoint_says_structure_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = Path(
        GeneralCheckpointIO(hashes=False, fingerprints=False).save_model(_model(), tmp_path / "n", shard=True)
    )
    report = verify_checkpoint(d)
    assert report == [] and report.hashed == 0 and report.unhashed == 7 and report.fingerprints == 0
    assert cli(["verify", str(d)]) == 0
    out = capsys.readouterr().out
    assert "every stored slice matches its hash" not in out
    assert "7 slice(s) carry no hash" in out and "structure only: no stored byte was checked" in out
    assert cli(["verify", "--require-hashes", "-q", str(d)]) == 1


def test_total_size_is_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = _save(tmp_path, gather=True)
    _edit(d, lambda o: o["metadata"].update(total_size=5))
    with pytest.raises(
        IndexFileError, match=r"metadata\.total_size says 5 bytes, the tensors of the index hold 640"
    ):
        verify_checkpoint(d)
    assert cli(["verify", "-q", str(d)]) == 2
    GeneralCheckpointIO().load_model(_zeros(), str(d))  # harmless for loading


def test_optimizer_param_and_state_fields(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    io = GeneralCheckpointIO()
    d = Path(io.save_optimizer(OptimizerWrapper(opt, m), tmp_path / "o", shard=True))
    idx = d / "optimizer.safetensors.index.json"
    obj = listed(json.loads(idx.read_text()))
    obj["unickpt"]["tensors"]["state.0.weight.exp_avg"]["param"] = "1.weight"
    idx.write_text(json.dumps(obj))
    match = (
        r"optimizer tensor 'state\.0\.weight\.exp_avg' says it is state 'exp_avg' of parameter '1\.weight', "
        r"which is named 'state\.1\.weight\.exp_avg'"
    )
    with pytest.raises(IndexFileError, match=match):
        verify_checkpoint(d, kind="optimizer")
    assert cli(["verify", "-q", "--kind", "optimizer", str(d)]) == 2
    with pytest.raises(IndexFileError, match=match):
        io.load_optimizer(OptimizerWrapper(torch.optim.AdamW(m.parameters(), lr=1e-3), m), str(d))
    # A parameter name of a megabyte is named cut, in the name it gives and in the one it implies.
    obj["unickpt"]["tensors"]["state.0.weight.exp_avg"]["param"] = "p" * 10**6
    idx.write_text(json.dumps(obj))
    with pytest.raises(IndexFileError) as e:
        verify_checkpoint(d, kind="optimizer")
    msg = str(e.value)
    assert len(msg) < 2000, len(msg)
    assert msg.count("(1000000 characters)") == 1 and msg.count("(1000014 characters)") == 1, msg


def test_plain_safetensors_inspect_claims_nothing(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    from unickpt.tools.inspect import format_report, inspect_checkpoint

    save_file({"w": np.ones((2, 3), dtype=np.float32)}, str(tmp_path / "model.safetensors"))
    info = inspect_checkpoint(tmp_path)
    assert info["created_by"] is None and info["layout"] is None and info["unickpt_block"] is False
    text = format_report(info)
    assert "plain safetensors file checkpoint: no unickpt block" in text
    assert "created by" not in text and "plugin=" not in text


@pytest.mark.parametrize(
    "case",
    ["listed_twice", "state_of_unlisted", "params_not_names", "param_state_unlisted"],
)
def test_optimizer_param_groups_claims(tmp_path: Path, case: str) -> None:
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    io = GeneralCheckpointIO()
    d = Path(io.save_optimizer(OptimizerWrapper(opt, m), tmp_path / "o", shard=True))
    idx = d / "optimizer.safetensors.index.json"
    obj = listed(json.loads(idx.read_text()))
    groups = obj["unickpt"]["param_groups"]
    if case == "listed_twice":
        groups.append(dict(groups[0], params=["0.bias"]))
        match = r"parameter '0\.bias' is listed in param_groups\[0\] and param_groups\[1\]"
    elif case == "state_of_unlisted":
        groups[0]["params"].remove("1.weight")
        match = (
            r"optimizer tensor 'state\.1\.weight\.momentum_buffer' is state of parameter '1\.weight', "
            r"which no param_group lists"
        )
    elif case == "params_not_names":
        groups[0]["params"] = 5
        match = r"param_groups\[0\]\.params must be a list of parameter names \(FQNs\), found int"
    else:
        obj["unickpt"]["param_state"]["9.weight"] = {"k": 1}
        match = r"param_state holds state of parameter '9\.weight', which no param_group lists"
    idx.write_text(json.dumps(obj))
    with pytest.raises(IndexFileError, match=re.escape(str(idx)) + ": " + match):
        verify_checkpoint(d, kind="optimizer")
    assert cli(["verify", "-q", "--kind", "optimizer", str(d)]) == 2
    opt2 = torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9)
    with pytest.raises(IndexFileError, match=match):
        io.load_optimizer(OptimizerWrapper(opt2, m), str(d))
    assert opt2.param_groups[0]["lr"] == 0.5 and not opt2.state
