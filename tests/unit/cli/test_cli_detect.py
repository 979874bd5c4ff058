"""What the CLI and the reader say of other tools' checkpoints, and ``convert`` without ``--from``.

Real files written by the peers themselves (``torch.save``, ``dcp.save``, DeepSpeed and
Colossal-AI fixtures under tests/data): ``inspect``, ``verify`` and ``load_model`` name what the
file is and the command that reads it; ``convert`` picks the importer itself and gives the same
checkpoint as with ``--from``; ``verify --json`` reports what was checked and every failure.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from _reliability import MLP

from unickpt import GeneralCheckpointIO
from unickpt.ckpt.foreign import foreign_dir, foreign_file
from unickpt.cli.main import main
from unickpt.errors import HeaderError, IncompleteCheckpointError, UnsupportedError
from unickpt.tools.detect import detect_source

DATA = Path(__file__).resolve().parents[2] / "data"


@pytest.fixture(scope="module")
def peers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("peers")
    m = MLP(seed=0)
    torch.save(m.state_dict(), root / "pytorch_model.bin")
    torch.save(m.state_dict(), root / "legacy.bin", _use_new_zipfile_serialization=False)
    (root / "bin_dir").mkdir()
    torch.save(m.state_dict(), root / "bin_dir" / "pytorch_model.bin")
    dcp.save(m.state_dict(), checkpoint_id=str(root / "dcp"), no_dist=True)
    for step in (10, 20):
        dcp.save(m.state_dict(), checkpoint_id=str(root / "titan" / f"step-{step}"), no_dist=True)
    GeneralCheckpointIO().save_model(m, str(root / "ours"), shard=True)
    # the top of a universal checkpoint as ``convert --to deepspeed`` and DeepSpeed name it
    (root / "ucp" / "global_step7_universal" / "zero").mkdir(parents=True)
    (root / "ucp" / "latest_universal").write_text("global_step7_universal")
    return {
        "ucp": root / "ucp",
        "bin": root / "pytorch_model.bin",
        "legacy": root / "legacy.bin",
        "bin_dir": root / "bin_dir",
        "dcp": root / "dcp",
        "titan": root / "titan",
        "ours": root / "ours",
        "deepspeed": DATA / "deepspeed" / "zero2_ws2" / "ckpt",
        "colossalai": DATA / "colossalai" / "one_group" / "optimizer",
    }


@pytest.mark.parametrize(
    ("name", "source"),
    [
        ("bin", "bin"),
        ("legacy", "bin"),
        ("bin_dir", "bin"),
        ("dcp", "dcp"),
        ("titan", "dcp"),
        ("deepspeed", "deepspeed"),
        ("ucp", "deepspeed"),
        ("colossalai", "colossalai"),
    ],
)
def test_detect_source_of_peer_files(peers: dict[str, Path], name: str, source: str) -> None:
    assert detect_source(peers[name]) == source


def test_detect_refuses_what_it_cannot_tell(peers: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(UnsupportedError, match="already a unickpt"):
        detect_source(peers["ours"])
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("x")
    with pytest.raises(UnsupportedError, match=r"cannot tell what .*junk holds.*give --from"):
        detect_source(tmp_path / "junk")
    with pytest.raises(UnsupportedError, match="does not exist"):
        detect_source(tmp_path / "nothing")


def test_rules_are_not_fooled_by_safetensors() -> None:
    # A real safetensors file starts with its header length, then '{': never taken for a pickle.
    import numpy as np
    from safetensors.numpy import save

    assert foreign_file(save({"x": np.zeros(3, np.float32)})[:16]) is None
    assert foreign_file(b"") is None
    assert foreign_dir(["model.safetensors"]) is None
    listing = {"step-4": ["COMMIT", "model"], "step-10": [".metadata", "__0_0.distcp"]}
    assert foreign_dir(["step-3", "step-4"], listing.__getitem__) is None  # a manager run
    # the latest step (by number, not by name) says what the folder is
    assert foreign_dir(["step-4", "step-10"], listing.__getitem__).source == "dcp"  # type: ignore[union-attr]


@pytest.mark.parametrize("name", ["bin", "legacy"])
def test_load_inspect_verify_of_a_bin_name_convert(
    peers: dict[str, Path], name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(peers[name])
    with pytest.raises(
        HeaderError, match=rf"{path} is a .*not safetensors: read it with `unickpt convert --from bin"
    ):
        GeneralCheckpointIO().load_model(MLP(seed=0), path)
    for cmd in ("inspect", "verify"):
        assert main([cmd, path]) == 2
        err = capsys.readouterr().err
        assert f"`unickpt convert --from bin {path} OUT`" in err, err


@pytest.mark.parametrize(
    ("name", "what"), [("dcp", "DCP checkpoint"), ("titan", "torchtitan checkpoint folder")]
)
def test_inspect_of_a_dcp_folder_names_convert(
    peers: dict[str, Path], name: str, what: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(peers[name])
    for cmd in ("inspect", "verify"):
        assert main([cmd, path]) == 2
        err = capsys.readouterr().err
        assert what in err and f"`unickpt convert --from dcp {path} OUT`" in err, err
    with pytest.raises(IncompleteCheckpointError, match=f"unickpt convert --from dcp {path} OUT"):
        GeneralCheckpointIO().load_model(MLP(seed=0), path)


@pytest.mark.parametrize("name", ["bin", "bin_dir", "dcp", "titan"])
def test_convert_without_from_matches_convert_with_it(
    peers: dict[str, Path], name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = {"bin": "bin", "bin_dir": "bin", "dcp": "dcp", "titan": "dcp"}[name]
    assert main(["convert", "-q", str(peers[name]), str(tmp_path / "auto")]) == 0
    assert main(["convert", "-q", "--from", source, str(peers[name]), str(tmp_path / "given")]) == 0
    capsys.readouterr()
    assert main(["diff", "--deep", str(tmp_path / "auto"), str(tmp_path / "given")]) == 0
    a, b = MLP(seed=0), MLP(seed=0)
    with torch.no_grad():
        for p in a.parameters():
            p.zero_()
    GeneralCheckpointIO().load_model(a, str(tmp_path / "auto"))
    for k, v in b.state_dict().items():
        assert torch.equal(a.state_dict()[k].view(torch.uint8), v.view(torch.uint8)), k


def test_verify_json(peers: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ck = tmp_path / "ck"
    shutil.copytree(peers["ours"], ck)
    assert main(["verify", "--json", str(ck)]) == 0
    ok = json.loads(capsys.readouterr().out)
    assert (
        ok["ok"] is True and ok["failures"] == [] and ok["tensors"] == 4 and ok["hashed"] == ok["slices"] == 4
    )
    data = next(p for p in ck.iterdir() if p.suffix == ".safetensors")
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0x10  # the last byte of the last tensor in the file
    data.write_bytes(bytes(raw))
    assert main(["verify", "--json", str(ck)]) == 1
    bad = json.loads(capsys.readouterr().out)
    assert bad["ok"] is False
    kinds = {f["what"] for f in bad["failures"]}
    assert kinds == {"hash"}, bad["failures"]
    (hit,) = [f for f in bad["failures"] if f["what"] == "hash"]
    assert hit["file"] == data.name and hit["expected"] != hit["found"]
