"""The COMMIT record carries the xxh3-64 of a step's side files (config.json and
generation_config.json beside the model and in hf/, lr_scheduler.json); ``unickpt verify`` on a
run rehashes them, and checks steps committed before the table existed for structure only."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import xxhash

from unickpt import CheckpointManager
from unickpt.cli.main import main


class _Config:
    def __init__(self, text: str) -> None:
        self.text = text

    def to_json_string(self) -> str:
        return self.text


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("side") / "run"
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))
    m.config = _Config('{"model_type": "tiny", "hidden_size": 5}')  # type: ignore[assignment]
    m.generation_config = _Config('{"max_length": 7}')  # type: ignore[assignment]
    opt = torch.optim.AdamW(m.named_parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched.step()
    CheckpointManager(d, save_steps=1, save_hf=True).save(1, m, opt, sched)
    return d


@pytest.fixture
def run(saved: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(saved, dst)
    return dst


SIDE = [
    "hf/config.json",
    "hf/generation_config.json",
    "lr_scheduler.json",
    "model/config.json",
    "model/generation_config.json",
]


def _verify(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["verify", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_commit_records_the_side_files_and_verify_rehashes_them(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    step = run / "step-1"
    rec = json.loads((step / "COMMIT").read_text())
    assert rec["step"] == 1 and sorted(rec["xxh3"]) == SIDE
    for rel, digest in rec["xxh3"].items():
        assert xxhash.xxh3_64_hexdigest((step / rel).read_bytes()) == digest, rel
    assert (step / "hf" / "config.json").read_text() == '{"model_type": "tiny", "hidden_size": 5}'
    code, out, err = _verify(capsys, str(run))
    assert (code, err) == (0, "")
    assert "step 1 model      : OK     4 tensors, 4 slice(s) rehashed, 2 side file(s) rehashed" in out
    assert "step 1 hf         : OK     4 tensors, 4 slice(s) rehashed, 2 side file(s) rehashed" in out
    assert "note" not in out


@pytest.mark.parametrize(
    ("rel", "part"),
    [("model/config.json", "model"), ("hf/generation_config.json", "hf"), ("hf/config.json", "hf")],
)
def test_verify_names_a_flipped_byte_in_a_side_file(
    run: Path, capsys: pytest.CaptureFixture[str], rel: str, part: str
) -> None:
    f = run / "step-1" / rel
    raw = bytearray(f.read_bytes())
    raw[3] ^= 0x01  # still valid JSON: only the hash can tell
    f.write_bytes(bytes(raw))
    json.loads(raw)
    code, _, err = _verify(capsys, str(run))
    assert code == 1
    want = xxhash.xxh3_64_hexdigest(bytes(raw))
    assert f"  step 1 {part}: {f}: expected xxh3-64 " in err and f", found {want}" in err
    assert err.count("expected xxh3-64") == 1


def test_a_missing_side_file_fails(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (run / "step-1" / "model" / "generation_config.json").unlink()
    code, _, err = _verify(capsys, str(run / "step-1"))
    assert code == 1
    gen = run / "step-1" / "model" / "generation_config.json"
    assert f"  step 1 model: {gen}: cannot be read (No such file or directory)" in err


def _strip_table(run: Path) -> None:
    commit = run / "step-1" / "COMMIT"
    rec = json.loads(commit.read_text())
    del rec["xxh3"]
    commit.write_text(json.dumps(rec))


def test_a_step_committed_before_the_table_is_checked_for_structure(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _strip_table(run)
    code, out, err = _verify(capsys, str(run))
    assert (code, err) == (0, "")
    assert (
        "    note: model/config.json, model/generation_config.json, hf/config.json, "
        "hf/generation_config.json: no hash in COMMIT (committed before unickpt hashed side files): "
        "structure checked only"
    ) in out
    assert "side file(s) rehashed" not in out
    code, _, err = _verify(capsys, str(run), "--require-hashes")
    assert code == 1 and "no hash in COMMIT" in err
    cfg = run / "step-1" / "hf" / "config.json"
    cfg.write_text('["not", "an", "object"]')
    code, _, err = _verify(capsys, str(run))
    assert code == 1 and f"  step 1 hf: {cfg}: not a JSON object" in err
    cfg.write_text("{truncated")
    code, _, err = _verify(capsys, str(run))
    assert code == 1 and f"  step 1 hf: {cfg}: unreadable (" in err


@pytest.mark.parametrize(
    ("table", "message"),
    [
        (["model/config.json"], "COMMIT: 'xxh3' must map relative paths to hex digests"),
        (
            {"../../etc/passwd": "00"},
            "COMMIT: refuses to check '../../etc/passwd' (not a path inside the step)",
        ),
        ({"/etc/passwd": "00"}, "COMMIT: refuses to check '/etc/passwd' (not a path inside the step)"),
        ({"model/../../x": "00"}, "COMMIT: refuses to check 'model/../../x' (not a path inside the step)"),
        ({"model/.hidden": "00"}, "COMMIT: refuses to check 'model/.hidden' (not a path inside the step)"),
        ({"model\\..\\x": "00"}, "COMMIT: refuses to check 'model\\\\..\\\\x' (not a path inside the step)"),
    ],
)
def test_a_malformed_or_hostile_table_fails(
    run: Path, capsys: pytest.CaptureFixture[str], table: object, message: str
) -> None:
    commit = run / "step-1" / "COMMIT"
    rec = json.loads(commit.read_text())
    rec["xxh3"] = table
    commit.write_text(json.dumps(rec))
    code, _, err = _verify(capsys, str(run))
    assert code == 1 and message in err
