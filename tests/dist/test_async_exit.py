"""An async save that is a script's last statement is committed before the process exits.

Real processes (``_async_exit_worker.py``): one process, and a 2-rank gloo world under DDP,
save with ``CheckpointManager(async_save=True)`` or ``save_model(use_async=True)`` and end
without waiting. The step must be committed and load bit-exact (``verify=True``); a save that
cannot finish at exit (an injected failure in the background write, or a process group the
script destroyed) must make every process exit non-zero, saying on stderr that the save was
not committed, and leave nothing committed.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from unickpt.io import GeneralCheckpointIO

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
pytestmark = pytest.mark.timeout(240)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(mode: str, root: Path, world: int, faults: str = "") -> list[tuple[int, str]]:
    """Run the script on ``world`` ranks; (exit code, stderr) of each."""
    port = _port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
        env.pop("UNICKPT_FAULTS", None)
        if faults:
            env["UNICKPT_FAULTS"] = faults
        if world > 1:
            env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world),
                LOCAL_WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    str(HERE / "_async_exit_worker.py"),
                    mode,
                    str(root),
                    str(root) + ".expected",
                ],
                env=env,
                cwd=str(REPO),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        )
    out = []
    try:
        for p in procs:
            _, err = p.communicate(timeout=180)
            out.append((p.returncode, err.decode(errors="replace")))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    return out


def _fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(123)
    net = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256))
    with torch.no_grad():
        for p in net.parameters():
            p.fill_(7.0)
    opt = torch.optim.AdamW(list(net.named_parameters()), lr=1e-2)
    return net, opt


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _check_loads(model_dir: Path, optim_dir: Path | None, expected: Path) -> None:
    exp = load_file(str(expected))
    net, opt = _fresh()
    io = GeneralCheckpointIO()
    io.load_model(net, str(model_dir), verify=True)
    for k, v in net.state_dict().items():
        assert _bits(v) == _bits(exp[f"model.{k}"]), k
    if optim_dir is None:
        return
    io.load_optimizer(opt, str(optim_dir), verify=True)
    names = {id(p): n for n, p in net.named_parameters()}
    seen = 0
    for p, s in opt.state.items():
        for k, v in s.items():
            assert _bits(torch.as_tensor(v)) == _bits(exp[f"optim.{names[id(p)]}.{k}"]), (names[id(p)], k)
            seen += 1
    assert seen == 12  # 4 parameters x (step, exp_avg, exp_avg_sq)


@pytest.mark.parametrize("world", [1, 2])
def test_manager_async_save_at_exit_is_committed(tmp_path: Path, world: int) -> None:
    root = tmp_path / "ckpt"
    results = _run("manager", root, world)
    for rc, err in results:
        assert rc == 0, err
        assert "cannot schedule" not in err and "NOT committed" not in err, err
    assert json.loads((root / "latest").read_text()) == {"step": 1}
    step = root / "step-1"
    assert step.is_dir()
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-1"]
    _check_loads(step / "model", step / "optimizer", Path(str(root) + ".expected"))


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_io_async_save_model_at_exit_is_committed(tmp_path: Path, world: int) -> None:
    root = tmp_path / "ckpt"
    results = _run("io", root, world)
    for rc, err in results:
        assert rc == 0, err
    assert (root / "model" / "model.safetensors.index.json").is_file()
    _check_loads(root / "model", None, Path(str(root) + ".expected"))


@pytest.mark.parametrize(
    ("world", "faults", "mode"),
    [
        (1, "manager.commit@0", "manager"),
        pytest.param(2, "manager.train_state@1", "manager", marks=pytest.mark.slow),
        pytest.param(1, "save.commit@0", "io", marks=pytest.mark.slow),
        (2, "save.write@1", "io"),
    ],
)
def test_async_save_that_fails_at_exit_exits_nonzero(
    tmp_path: Path, world: int, faults: str, mode: str
) -> None:
    root = tmp_path / "ckpt"
    results = _run(mode, root, world, faults)
    for rank, (rc, err) in enumerate(results):
        assert rc == 1, (rank, rc, err)
        assert "unickpt: the async save" in err and "was NOT committed" in err, (rank, err)
        assert "injected fault" in err or "DistributedError" in err, (rank, err)
    if mode == "manager":
        assert not (root / "step-1").exists()
        assert not (root / "latest").exists()
    else:
        assert not (root / "model" / "model.safetensors.index.json").exists()


def test_async_save_with_process_group_destroyed_is_committed_or_reported(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    results = _run("manager-destroy", root, 2)
    if (root / "step-1").is_dir():  # the background group outlives destroy_process_group()
        for rank, (rc, err) in enumerate(results):
            assert rc == 0, (rank, err)
        _check_loads(root / "step-1" / "model", root / "step-1" / "optimizer", Path(str(root) + ".expected"))
    else:  # never lost in silence
        for rank, (rc, err) in enumerate(results):
            assert rc == 1 and "was NOT committed" in err, (rank, rc, err)
        # The rank that found its group gone says why; a peer may see only the other's exit.
        assert any("destroy_process_group" in err for _, err in results), results
