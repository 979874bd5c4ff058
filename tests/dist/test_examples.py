"""Smoke tests of examples/: every script runs end to end and its checkpoints verify.

Tiny settings (2 processes, 1-2 steps) keep the module around a minute on 2 cores: one run of
``resume_with_other_parallelism.sh`` (FSDP2 x2 saves, TP x2 resumes: both training scripts),
one run of ``merge_to_hf.sh`` on its output (verify, merge, diff, transformers load). The
full ``examples/demo.sh`` (4 processes) is marked slow. Every subprocess has a timeout, so
a hung collective fails the test instead of stalling the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
EXAMPLES = REPO / "examples"


def _run(cmd: list[str], timeout_s: float, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "VENV": str(BIN.parent),
        **env,
    }
    try:
        proc = subprocess.run(
            cmd,
            cwd=REPO,
            env=full_env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            start_new_session=True,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} did not finish within {timeout_s} s:\n{e.stdout}\n{e.stderr}")
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    )
    return proc


def _verify(path: Path) -> None:
    """The checkpoint's structure is valid and every stored slice matches its hash."""
    from unickpt.tools.verify import verify_checkpoint

    assert verify_checkpoint(str(path), progress=False) == [], f"{path} does not verify"


def _latest(manager_dir: Path) -> Path:
    step = json.loads((manager_dir / "latest").read_text())["step"]
    return manager_dir / f"step-{step}"


def _eval_loss(log: str, prefix: str) -> float:
    lines = [ln for ln in log.splitlines() if ln.startswith(prefix) and "eval loss" in ln]
    assert len(lines) == 1, f"expected one {prefix!r} line in:\n{log}"
    return float(lines[0].rsplit(" ", 1)[1])


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """FSDP2 x2 trains 2 steps and saves; TP x2 resumes it and trains 1 more (one script run)."""
    work = tmp_path_factory.mktemp("examples") / "resume"
    proc = _run(
        ["bash", str(EXAMPLES / "resume_with_other_parallelism.sh"), str(work)],
        timeout_s=240,
        SAVE_NPROC="2",
        RESUME_NPROC="2",
        STEPS="1",
    )
    return work, proc.stdout


def test_resume_with_other_parallelism(resumed: tuple[Path, str]) -> None:
    work, out = resumed
    fsdp_step, tp_step = _latest(work / "fsdp2"), _latest(work / "tp")
    assert fsdp_step.name == "step-1" and tp_step.name == "step-2"
    # The TP job sees exactly the weights the FSDP2 job saved.
    fsdp_log = (work / "fsdp2.log").read_text()
    tp_log = (work / "tp.log").read_text()
    assert _eval_loss(fsdp_log, "saved step 1") == pytest.approx(
        _eval_loss(tp_log, "resumed step 1"), abs=1e-5
    )
    assert "step   2  loss" in tp_log
    for step_dir in (fsdp_step, tp_step):
        assert (step_dir / "COMMIT").is_file()
        _verify(step_dir / "model")
        _verify(step_dir / "optimizer")
    # The FSDP2 checkpoint was written by both ranks (sliced), not gathered on one.
    from unickpt.ckpt.reader import open_checkpoint

    assert len(list((fsdp_step / "model").glob("model-*-of-*.safetensors"))) == 2
    with open_checkpoint(str(fsdp_step / "model"), "model") as reader:
        emb = reader.tensors["model.embed_tokens.weight"]
        # 37 rows over 2 ranks: uneven blocks, one per rank, in two files.
        assert sorted((s.offsets[0], s.shape[0]) for s in emb.slices) == [(0, 19), (19, 18)]
        assert len({s.file for s in emb.slices}) == 2
    assert "OK: the TP x2 job resumed the FSDP2 x2 checkpoint exactly" in out


def test_merge_to_hf(resumed: tuple[Path, str]) -> None:
    work, _ = resumed
    out = work.parent / "hf"
    proc = _run(["bash", str(EXAMPLES / "merge_to_hf.sh"), str(work / "tp"), str(out)], timeout_s=120)
    assert "result: identical" in proc.stdout
    assert "lm_head tied" in proc.stdout
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    _verify(out)
    # A plain safetensors reader gets every weight, with the TP run's final eval loss.
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "model.embed_tokens.weight" in set(f.keys())
    merged_loss = _eval_loss(proc.stdout, "transformers loaded")
    assert merged_loss == pytest.approx(_eval_loss((work / "tp.log").read_text(), "saved step 2"), abs=1e-5)


def test_scripts_refuse_bad_usage(tmp_path: Path) -> None:
    proc = subprocess.run(
        ["bash", str(EXAMPLES / "merge_to_hf.sh"), str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2 and "usage:" in proc.stderr


@pytest.mark.slow
def test_demo(tmp_path: Path) -> None:
    """The full `make demo` (4 processes); slow, run with `make test-slow`."""
    proc = _run(["bash", str(EXAMPLES / "demo.sh")], timeout_s=600, DEMO_DIR=str(tmp_path / "demo"))
    assert "result: identical" in proc.stdout
    _verify(tmp_path / "demo" / "fsdp2-run" / "step-6" / "model")
    _verify(tmp_path / "demo" / "hf")


def test_train_pp_resumes_without_pipeline(tmp_path: Path) -> None:
    """train_pp.py: 2 stages train and save; one process (no pipeline) resumes the checkpoint."""
    torchrun = [str(BIN / "torchrun"), "--nproc_per_node", "2"]
    script = str(EXAMPLES / "train_pp.py")
    _run([*torchrun, script, "--steps", "1", "--save-dir", str(tmp_path / "pp")], timeout_s=180)
    _verify(_latest(tmp_path / "pp") / "model")
    _verify(_latest(tmp_path / "pp") / "optimizer")
    proc = _run(
        [sys.executable, script, "--steps", "1", "--resume-from", str(tmp_path / "pp")], timeout_s=120
    )
    assert "resumed step 1" in proc.stdout and "step   2  loss" in proc.stdout


def test_train_hybrid_saves_strided_slices(tmp_path: Path) -> None:
    """train_hybrid.py on 2 ranks (dp1 x tp2): trains, saves a sliced checkpoint that verifies."""
    cmd = [str(BIN / "torchrun"), "--nproc_per_node", "2", str(EXAMPLES / "train_hybrid.py")]
    proc = _run([*cmd, "--steps", "1", "--save-dir", str(tmp_path / "hyb")], timeout_s=180)
    assert "step   1  loss" in proc.stdout
    _verify(_latest(tmp_path / "hyb") / "model")
    _verify(_latest(tmp_path / "hyb") / "optimizer")
