"""``unickpt upgrade``: checkpoints of the draft format versions 1 to 4 (tests/data/versions, written
by the writers of those versions) become version 5 checkpoints that verify, load bit-exact and
carry the fingerprints a fresh version 5 save of the same tensors has; readers refuse the drafts
naming the file, the version and the command; an upgrade killed before its index write leaves the
original, which upgrade reads again."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from unickpt import GeneralCheckpointIO, verify_checkpoint
from unickpt.ckpt.reader import open_checkpoint
from unickpt.cli.main import main
from unickpt.errors import IndexFileError, IntegrityError, OutputExistsError
from unickpt.spec.hashing import fingerprint_of_array
from unickpt.spec.naming import SLICED_SENTINEL
from unickpt.tools.upgrade import LONG_SLICED_SENTINEL, upgrade_checkpoint

DATA = Path(__file__).resolve().parents[2] / "data" / "versions"
EXPECTED = load_file(str(DATA / "expected.safetensors"))
KINDS = {"sliced": "model", "gathered": "model", "single.safetensors": "model", "optimizer": "optimizer"}
CASES = [(v, what) for v in (1, 2, 3, 4) for what in KINDS]
DT = {torch.float32: "F32", torch.bfloat16: "BF16", torch.int64: "I64", torch.float64: "F64"}


def _model() -> torch.nn.Module:
    m = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Linear(9, 4, bias=False))
    with torch.no_grad():
        m[1].weight.data = torch.zeros(4, 9, dtype=torch.bfloat16)
        for p in m.parameters():
            p.zero_()
    return m


def _copy(tmp_path: Path, v: int, what: str) -> Path:
    src = DATA / f"v{v}" / what
    dst = tmp_path / f"v{v}-{what}"
    if src.is_dir():
        shutil.copytree(src, dst)
    else:
        shutil.copyfile(src, dst)
    return dst


def _files(p: Path) -> dict[str, bytes]:
    if p.is_file():
        return {p.name: p.read_bytes()}
    return {f.name: f.read_bytes() for f in sorted(p.iterdir()) if f.is_file() and not f.name.startswith(".")}


def _fingerprint(name: str, t: torch.Tensor) -> str:
    raw = t.contiguous().view(torch.uint8).numpy().tobytes()
    return fingerprint_of_array(name, DT[t.dtype], raw, list(t.shape))


def _check_loads_bit_exact(p: Path, kind: str) -> None:
    io = GeneralCheckpointIO()
    m = _model()
    if kind == "model":
        io.load_model(m, p, strict=False, verify=True)
        for n, t in m.state_dict().items():
            assert t.dtype == EXPECTED[n].dtype and torch.equal(
                t.view(torch.uint8), EXPECTED[n].view(torch.uint8)
            ), n
        return
    opt = torch.optim.SGD(m.named_parameters(), lr=0.5, momentum=0.9)
    io.load_optimizer(opt, p, verify=True)
    fqn = {id(q): n for n, q in m.named_parameters()}
    seen = 0
    for q, st in opt.state.items():
        got = st["momentum_buffer"]
        want = EXPECTED[f"state.{fqn[id(q)]}.momentum_buffer"]
        assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        seen += 1
    assert seen == 3 and opt.param_groups[0]["lr"] == 0.1  # the saved hyperparameters


@pytest.mark.parametrize("v,what", CASES)
def test_a_draft_is_refused_then_upgraded_to_a_checkpoint_equal_to_a_fresh_save(
    tmp_path: Path, v: int, what: str
) -> None:
    kind = KINDS[what]
    p = _copy(tmp_path, v, what)
    data_before = {n: b for n, b in _files(p).items() if not n.endswith(".index.json")}
    where = p / f"{kind}.safetensors.index.json" if p.is_dir() else p
    with pytest.raises(IndexFileError) as e:
        open_checkpoint(p, kind=kind)
    msg = str(e.value)
    assert msg.startswith(f"{where}: format_version {v}, a draft"), msg
    assert f"`unickpt upgrade {p}`" in msg and "reads version 5 only" in msg

    report = upgrade_checkpoint(p)
    assert report.upgraded == [(str(where), v)] and not report.current

    with open_checkpoint(p, kind=kind) as r:
        assert r.block.format_version == 5
        assert all(t.compact for t in r.block.tensors.values())  # a version 5 writer's encoding
        fps = {n: t.fingerprint for n, t in r.block.tensors.items()}
    rep = verify_checkpoint(p, kind=kind)
    assert not list(rep) and rep.fingerprints == 3 and rep.hashed >= 3, rep.summary()
    _check_loads_bit_exact(p, kind)
    # The fingerprints are those of a fresh version 5 save of the same tensors.
    if kind == "model":
        fresh = tmp_path / "fresh"
        m = _model()
        m.load_state_dict({n: t for n, t in EXPECTED.items() if not n.startswith("state.")})
        GeneralCheckpointIO().save_model(m, fresh, shard=True, gather_dtensor=False)
        with open_checkpoint(fresh) as r:
            assert fps == {n: t.fingerprint for n, t in r.block.tensors.items()}
    assert fps == {n: _fingerprint(n, EXPECTED[n]) for n in fps}
    # The data files are kept as they were (a single file: its data section).
    after = _files(p)
    if p.is_dir():
        assert {n: b for n, b in after.items() if not n.endswith(".index.json")} == data_before
        text = (p / f"{kind}.safetensors.index.json").read_text()
        assert LONG_SLICED_SENTINEL not in text
        if what == "sliced":
            assert set(json.loads(text)["weight_map"].values()) == {SLICED_SENTINEL}
    else:
        old, new = data_before[p.name], after[p.name]
        assert old[-324:] == new[-324:]  # the 324 bytes of tensor data, at the end of the file
    # A second upgrade finds nothing to do and writes nothing.
    before = _files(p)
    again = upgrade_checkpoint(p)
    assert again.current == [str(where)] and not again.upgraded and _files(p) == before


def test_a_directory_with_both_kinds_and_a_copy(tmp_path: Path) -> None:
    src = tmp_path / "both"
    shutil.copytree(DATA / "v2" / "sliced", src)
    for f in (DATA / "v3" / "optimizer").iterdir():
        shutil.copyfile(f, src / f.name)
    (src / "config.json").write_text("{}")
    before = _files(src)
    dst = tmp_path / "out"
    report = upgrade_checkpoint(src, dst)
    assert sorted(report.upgraded) == [
        (str(dst / "model.safetensors.index.json"), 2),
        (str(dst / "optimizer.safetensors.index.json"), 3),
    ]
    assert _files(src) == before  # the source is never written
    assert (dst / "config.json").read_text() == "{}"
    for kind in ("model", "optimizer"):
        rep = verify_checkpoint(dst, kind=kind)
        assert not list(rep) and rep.fingerprints == 3, rep.summary()
        _check_loads_bit_exact(dst, kind)
    with pytest.raises(OutputExistsError, match="not empty"):
        upgrade_checkpoint(src, dst)
    single = tmp_path / "one.safetensors"
    upgrade_checkpoint(DATA / "v1" / "single.safetensors", single)
    assert not list(verify_checkpoint(single))
    with pytest.raises(OutputExistsError, match="exists"):
        upgrade_checkpoint(DATA / "v1" / "single.safetensors", single)


def test_version_1_data_that_does_not_match_its_index_is_refused(tmp_path: Path) -> None:
    p = _copy(tmp_path, 1, "sliced")
    idx = p / "model.safetensors.index.json"
    obj = json.loads(idx.read_text())
    # A slice without a recorded hash: only the v1 fingerprint says what its data was.
    for s in obj["unickpt"]["tensors"]["0.bias"]["slices"]:
        s.pop("xxh3", None)
    idx.write_text(json.dumps(obj, indent=2))
    key = next(s for s in obj["unickpt"]["tensors"]["0.bias"]["slices"] if s["shape"] != [0])
    f = p / key["file"]
    h = json.loads(f.read_bytes()[8 : 8 + int.from_bytes(f.read_bytes()[:8], "little")])
    n = int.from_bytes(f.read_bytes()[:8], "little")
    begin = 8 + n + h[key["key"]]["data_offsets"][0]
    raw = bytearray(f.read_bytes())
    raw[begin + 3] ^= 0x80  # the sign bit of the slice's first F32 element
    f.write_bytes(bytes(raw))
    index_before = idx.read_bytes()
    with pytest.raises(IntegrityError) as e:
        upgrade_checkpoint(p)
    assert "tensor '0.bias'" in str(e.value) and "recorded fingerprint" in str(e.value)
    assert idx.read_bytes() == index_before  # nothing written
    # A hashed slice whose bytes changed is named with its file and key.
    (tmp_path / "again").mkdir()
    p2 = _copy(tmp_path / "again", 1, "sliced")
    f2 = p2 / key["file"]
    f2.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError) as e:
        upgrade_checkpoint(p2)
    assert f"tensor '0.bias' in file {key['file']!r} (stored as {key['key']!r})" in str(e.value)


def test_other_versions_and_other_checkpoints(tmp_path: Path) -> None:
    p = _copy(tmp_path, 4, "sliced")
    idx = p / "model.safetensors.index.json"
    obj = json.loads(idx.read_text())
    obj["unickpt"]["format_version"] = 6
    idx.write_text(json.dumps(obj))
    with pytest.raises(
        IndexFileError, match=r"format_version 6 is not a version this unickpt reads .*a newer unickpt"
    ):
        open_checkpoint(p)
    with pytest.raises(
        IndexFileError, match=r"format_version 6: unickpt upgrade converts versions 1, 2, 3, 4 to 5"
    ):
        upgrade_checkpoint(p)
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    with pytest.raises(IndexFileError, match=r"no unickpt block .*nothing to upgrade"):
        upgrade_checkpoint(plain)


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = _copy(tmp_path, 3, "sliced")
    assert main(["verify", str(p)]) == 2
    assert f"`unickpt upgrade {p}`" in capsys.readouterr().err
    assert main(["upgrade", str(p)]) == 0
    assert "format_version 3 -> 5" in capsys.readouterr().out
    assert main(["verify", str(p)]) == 0


_KILL = """
import os, signal, sys
import unickpt.store.publish as commit
real = os.replace
def replace(a, b):
    if b.endswith(sys.argv[2]):
        os.kill(os.getpid(), signal.SIGKILL)
    return real(a, b)
os.replace = replace
from unickpt.tools.upgrade import upgrade_checkpoint
upgrade_checkpoint(sys.argv[1])
"""


@pytest.mark.parametrize("v,what", [(1, "sliced"), (3, "optimizer"), (2, "single.safetensors")])
def test_an_upgrade_killed_before_its_index_write_leaves_the_original(
    tmp_path: Path, v: int, what: str
) -> None:
    kind = KINDS[what]
    p = _copy(tmp_path, v, what)
    target = f"{kind}.safetensors.index.json" if p.is_dir() else p.name
    before = _files(p)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_KILL), str(p), target],
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert run.returncode == -9, run.stderr.decode()
    assert _files(p) == before  # the committed files are untouched; a staged copy at most
    with pytest.raises(IndexFileError, match=f"format_version {v}, a draft"):
        open_checkpoint(p, kind=kind)
    assert upgrade_checkpoint(p).upgraded  # upgrade reads the original again
    assert not list(verify_checkpoint(p, kind=kind))
    _check_loads_bit_exact(p, kind)


_KILL_COPY = """
import os, signal, sys
real = os.rename
def rename(a, b):
    if b == sys.argv[2]:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(a, b)
os.rename = rename
from unickpt.tools.upgrade import upgrade_checkpoint
upgrade_checkpoint(sys.argv[1], sys.argv[2])
"""


def test_a_copy_killed_before_it_is_published_leaves_nothing_and_runs_again(tmp_path: Path) -> None:
    src = _copy(tmp_path, 1, "sliced")
    before = _files(src)
    dst = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_KILL_COPY), str(src), str(dst)],
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert run.returncode == -9, run.stderr.decode()
    assert not dst.exists() and _files(src) == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.tmp-")]  # the dead staging dir
    upgrade_checkpoint(src, dst)  # removes the dead run's staging directory, publishes the copy
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.tmp-")]
    assert not list(verify_checkpoint(dst)) and _files(src) == before


def test_version_1_slices_read_in_small_chunks_give_the_same_fingerprints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks that end mid-row (bounded memory per slice) sum the same v1 and v2 partials."""
    import unickpt.tools.upgrade as up

    whole = _copy(tmp_path, 1, "sliced")
    upgrade_checkpoint(whole)
    (tmp_path / "small").mkdir()
    small = _copy(tmp_path / "small", 1, "sliced")
    monkeypatch.setattr(up, "_CHUNK", 12)  # 3 F32 elements, 6 BF16: rows of 6 and 9 are cut
    upgrade_checkpoint(small)
    assert (small / "model.safetensors.index.json").read_bytes() == (
        whole / "model.safetensors.index.json"
    ).read_bytes()
