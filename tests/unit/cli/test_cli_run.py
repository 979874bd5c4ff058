"""``unickpt inspect``/``verify`` on a CheckpointManager run directory and its ``step-N`` directories.

One real run (three committed steps, model + optimizer + scheduler + dataloader-free train
state) is written once per module; each test copies it and damages the copy.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import xxhash

from unickpt import CheckpointManager
from unickpt.ckpt import run_layout
from unickpt.cli.main import main
from unickpt.tools.run import verify_run


class _Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, object]:
        return {"n": self.n, "t": torch.arange(3) + self.n}

    def load_state_dict(self, sd: dict[str, object]) -> None:
        self.n = int(sd["n"])  # type: ignore[call-overload]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("run") / "run"
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))
    opt = torch.optim.AdamW(m.named_parameters(), lr=1e-3)  # no OptimizerWrapper needed
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    mgr = CheckpointManager(d, save_steps=1, keep_last=None)
    counter = _Counter()
    for step in (1, 2, 3):
        m(torch.randn(2, 4)).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        counter.n = step
        mgr.save(step, m, opt, sched, counter=counter)
    return d


@pytest.fixture
def run(run_dir: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(run_dir, dst)
    return dst


def _flip(path: Path, at: int = -1) -> None:
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x20
    path.write_bytes(bytes(raw))


def test_manager_records_hashes_of_what_it_wrote(run: Path) -> None:
    step = run / "step-3"
    rec = json.loads((step / "train_state" / "rank-00000.hashes.json").read_text())
    assert rec["unickpt_hashes"] == 1
    assert sorted(rec["xxh3"]) == [
        "lr_scheduler.json",
        "train_state/rank-00000.json",
        "train_state/rank-00000.safetensors",
    ]
    for rel, digest in rec["xxh3"].items():
        assert xxhash.xxh3_64_hexdigest((step / rel).read_bytes()) == digest, rel


def test_inspect_run_lists_committed_steps(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (run / ".step-4.staging-0123456789ab").mkdir()  # a save killed before its commit
    assert main(["inspect", str(run)]) == 0
    out = capsys.readouterr().out
    assert "committed  : 3 step(s); latest (resumed by CheckpointManager.load): step 3" in out
    assert "uncommitted: .step-4.staging-0123456789ab (never loaded)" in out
    rows = [ln.split() for ln in out.splitlines() if ln[:1].isdigit()]
    assert [r[0] for r in rows] == ["1", "2", "3"]
    assert all("general" in r and "world_size=1" in r for r in rows)
    assert main(["inspect", "--json", str(run)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert [s["step"] for s in info["steps"]] == [1, 2, 3] and info["latest"] == 3
    total = sum(f.stat().st_size for f in (run / "step-2").rglob("*") if f.is_file())
    assert info["steps"][1]["bytes"] == total


def test_inspect_step_summarises_every_part(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--json", str(run / "step-2")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["step"] == 2 and info["plugin"] == "general" and info["world_size"] == 1
    assert info["model"]["tensors"] == 4 and info["model"]["hashed_slices"] == 4
    assert info["optimizer"]["params_with_state"] == 4
    assert info["optimizer"]["param_groups"][0]["params"] == 4
    assert info["lr_scheduler"]["last_epoch"] == 2
    assert info["train_state"] == {
        "ranks": [0],
        "hashed_ranks": [0],
        "step": 2,
        "world_size": 1,
        "dataloader": False,
        "extra": ["counter"],
    }
    assert info["hf"] is None
    assert main(["inspect", str(run / "step-2")]) == 0
    out = capsys.readouterr().out
    assert "step       : 2" in out and "last_epoch=2" in out
    assert "train state: 1 rank file(s), hashed; step=2 world_size=1 dataloader=no extra=['counter']" in out


def test_verify_intact_run_and_step(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(run)]) == 0
    out = capsys.readouterr().out
    assert "step 3 train_state: OK" in out and "step 1" not in out  # the latest step only
    assert "OK: " in out
    assert main(["verify", "--all", str(run)]) == 0
    out = capsys.readouterr().out
    assert all(f"step {s} optimizer  : OK" in out for s in (1, 2, 3))
    assert main(["verify", str(run / "step-1")]) == 0


@pytest.mark.parametrize(
    "rel",
    [
        "train_state/rank-00000.safetensors",
        "train_state/rank-00000.json",
        "lr_scheduler.json",
        "model/model-00001-of-00001.safetensors",
        "optimizer/optimizer-00001-of-00001.safetensors",
    ],
)
def test_verify_fails_on_any_damaged_byte(run: Path, rel: str, capsys: pytest.CaptureFixture[str]) -> None:
    _flip(run / "step-3" / rel)
    assert main(["verify", str(run / "step-3")]) == 1
    err = capsys.readouterr().err
    assert "FAILED" in err and os.path.basename(rel) in err
    # verify RUN checks the latest step, which is the damaged one; step 2 stays clean.
    assert main(["verify", "-q", str(run)]) == 1
    assert main(["verify", "-q", str(run / "step-2")]) == 0


def test_verify_fails_on_an_unreadable_commit_marker(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (run / "step-3" / "COMMIT").write_bytes(b'{"unickpt_commit": 1, "st')
    assert main(["verify", str(run / "step-3")]) == 1
    assert "COMMIT: unreadable" in capsys.readouterr().err


def test_verify_all_finds_damage_in_an_older_step(run: Path) -> None:
    _flip(run / "step-1" / "train_state" / "rank-00000.safetensors")
    assert main(["verify", "-q", str(run)]) == 0
    assert main(["verify", "-q", "--all", str(run)]) == 1


def test_older_step_without_hashes_is_checked_for_structure(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    step = run / "step-3"
    (step / "train_state" / "rank-00000.hashes.json").unlink()
    assert main(["verify", str(step)]) == 0
    out = capsys.readouterr().out
    assert (
        "note: 3 file(s) carry no hash (saved before unickpt hashed train state): structure checked only"
        in out
    )
    results = verify_run(step, require_hashes=True)
    assert [r.part for r in results if r.failures] == ["train_state"]
    # Unhashed, a damaged JSON is still caught when it no longer parses.
    (step / "train_state" / "rank-00000.json").write_bytes(b'{"unickpt_train_state": 1')
    assert main(["verify", str(step)]) == 1
    assert "rank-00000.json: unreadable" in capsys.readouterr().err


def test_missing_rank_file_and_hostile_hashes_file(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    step = run / "step-3"
    hp = step / "train_state" / "rank-00000.hashes.json"
    rec = json.loads(hp.read_text())
    rec["xxh3"]["../../outside"] = "0" * 16
    hp.write_text(json.dumps(rec))
    assert main(["verify", str(step)]) == 1
    assert "refuses to check '../../outside'" in capsys.readouterr().err
    (step / "train_state" / "rank-00000.safetensors").unlink()
    assert main(["verify", str(step)]) == 1
    assert "rank-00000.safetensors: cannot be read" in capsys.readouterr().err


def test_uncommitted_step_and_empty_run_hold_no_committed_checkpoint(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (run / "step-3" / "COMMIT").unlink()
    for cmd in ("inspect", "verify"):
        assert main([cmd, str(run / "step-3")]) == 2
        err = capsys.readouterr().err
        assert "holds no committed checkpoint" in err and "COMMIT marker" in err
    # The run's latest committed step is now 2 (its `latest` record names the uncommitted 3).
    assert run_layout.latest_step(run) == 2
    assert main(["verify", str(run)]) == 0
    assert "step 2 model" in capsys.readouterr().out
    empty = tmp_path / "empty_run"
    (empty / ".step-5.staging-0123456789ab").mkdir(parents=True)
    (empty / "latest").write_text('{"step": 5}')
    for cmd in ("inspect", "verify"):
        assert main([cmd, str(empty)]) == 2
        assert "without any committed step" in capsys.readouterr().err


def test_a_checkpoint_directory_named_step_n_is_still_a_checkpoint(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The model directory of a step, copied under a step-<N> name, is inspected as a checkpoint.
    d = tmp_path / "step-7"
    shutil.copytree(run / "step-3" / "model", d)
    assert main(["inspect", "--json", str(d)]) == 0
    assert json.loads(capsys.readouterr().out)["kind"] == "model"


def test_run_inspect_and_verify_never_import_torch(run: Path) -> None:
    code = f"""
import sys, contextlib, io
import unickpt.cli.main as m
with contextlib.redirect_stdout(io.StringIO()):
    assert m.main(["inspect", {str(run)!r}]) == 0
    assert m.main(["inspect", "--json", {str(run / "step-2")!r}]) == 0
    assert m.main(["verify", "--all", {str(run)!r}]) == 0
bad = sorted(k for k in sys.modules if k == "torch" or k.startswith("torch."))
assert not bad, bad
print("CLEAN")
"""
    root = Path(__file__).resolve().parents[3]
    env = dict(os.environ, PYTHONPATH=str(root))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("CLEAN")
