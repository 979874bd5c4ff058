"""``convert --to deepspeed``: a unickpt checkpoint as a DeepSpeed universal checkpoint (UCP).

The proof is DeepSpeed itself: tests/data/load_deepspeed_universal.py runs real DeepSpeed 0.19.8
(on CPU, gloo; one or two processes) with ``load_universal`` and records the engine's fp32 master
weights, Adam moments, steps, hyperparameters and counters after ``engine.load_checkpoint(OUT)``;
they must be the unickpt checkpoint's bit for bit. Those tests skip where DeepSpeed is not
importable (``pip install --no-deps deepspeed hjson einops msgpack py-cpuinfo`` beside torch).
The rest needs no DeepSpeed: the files are compared with DeepSpeed's own ``ds_to_universal``
output of the same checkpoint (tests/data/deepspeed/ucp_zero2_ws2), every ``.pt`` file loads
with ``torch.load(weights_only=True)``, the round trip through ``convert --from deepspeed`` is
bit-exact, and bad input is refused before anything is written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _reliability import Tied
from safetensors.torch import load_file
from torch import nn

from unickpt import CheckpointManager, GeneralCheckpointIO, OptimizerWrapper
from unickpt.ckpt.reader import open_checkpoint
from unickpt.cli.main import main as cli
from unickpt.errors import IncompleteCheckpointError, OutputExistsError, UnsupportedError
from unickpt.tools._torch import full_tensors
from unickpt.tools.convert import convert_checkpoint

DATA = Path(__file__).resolve().parents[2] / "data"
DS = DATA / "deepspeed"
LOADER = DATA / "load_deepspeed_universal.py"
NAMES = ["0.weight", "0.bias", "2.weight", "1.weight", "1.bias", "2.bias"]


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 3))
    m.register_buffer("scale", torch.tensor([1.5, 2.0, 0.5]))
    return m


def _groups(m: nn.Module) -> list[dict[str, Any]]:
    return [
        {"params": [m[0].weight, m[0].bias, m[2].weight], "weight_decay": 0.01},
        {"params": [m[1].weight, m[1].bias, m[2].bias], "weight_decay": 0.0, "lr": 5e-4},
    ]


def _trained(root: Path, steps: int = 3, sched: bool = False) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """A model and AdamW (two groups) trained ``steps`` steps, saved in the README layout
    (``root/model``, ``root/optimizer``, and ``root/lr_scheduler.json`` with ``sched``)."""
    m = _model()
    opt = torch.optim.AdamW(_groups(m), lr=1e-3, betas=(0.85, 0.95))
    lr = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if sched else None
    for i in range(steps):
        (m(torch.randn(5, 4, generator=torch.Generator().manual_seed(i))) * m.scale).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        if lr is not None:
            lr.step()
    io = GeneralCheckpointIO()
    io.save_model(m, str(root / "model"), shard=True, gather_dtensor=True, size_per_shard=0.0001)
    io.save_optimizer(OptimizerWrapper(opt, m), str(root / "optimizer"), shard=True, gather_dtensor=True)
    if lr is not None:
        io.save_lr_scheduler(lr, str(root / "lr_scheduler.json"))
    return m, opt, lr


def _unickpt(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], Any, Any]:
    """(model tensors, optimizer tensors by name, param groups, param_state) of a checkpoint dir."""
    with open_checkpoint(str(directory), "model") as r:
        model = full_tensors(r)
    with open_checkpoint(str(directory), "optimizer") as r:
        optim = {f"{r.tensors[n].param}/{r.tensors[n].state}": t for n, t in full_tensors(r).items()}
        return model, optim, r.block.param_groups, r.block.param_state


def _load(path: Path) -> Any:
    return torch.load(path, weights_only=True)


def test_files_are_what_ds_to_universal_writes(tmp_path: Path) -> None:
    """A DeepSpeed ZeRO-2 x2 run imported then exported: the per-parameter files hold DeepSpeed's
    own ds_to_universal tensors of the same run, bit for bit, under the same keys; every file
    loads with weights_only=True (plain data only)."""
    theirs = DS / "ucp_zero2_ws2" / "ckpt" / "global_step3_universal"
    uk, out = tmp_path / "uk", tmp_path / "ucp"
    assert cli(["convert", "-q", "--from", "deepspeed", str(DS / "ucp_zero2_ws2" / "ckpt"), str(uk)]) == 0
    assert cli(["convert", "-q", "--to", "deepspeed", str(uk), str(out)]) == 0
    assert (out / "latest_universal").read_text() == "global_step3_universal"
    ours = out / "global_step3_universal"
    assert sorted(os.listdir(ours / "zero")) == sorted(os.listdir(theirs / "zero"))
    for name in [*NAMES, "scale"]:
        assert sorted(os.listdir(ours / "zero" / name)) == sorted(os.listdir(theirs / "zero" / name)), name
        for f in os.listdir(theirs / "zero" / name):
            a = _load(ours / "zero" / name / f)
            b = torch.load(theirs / "zero" / name / f, weights_only=False)
            if f == "step.pt":
                assert a.dtype == b.dtype and torch.equal(a, b), name
                continue
            assert set(a) == set(b), (name, f)
            assert a["param"].dtype == b["param"].dtype and torch.equal(a["param"], b["param"]), (name, f)
            assert {k: v for k, v in a.items() if k != "param"} == {
                k: v for k, v in b.items() if k != "param"
            }
    a_opt = _load(ours / "zero" / "optimizer_state.pt")
    b_opt = torch.load(theirs / "zero" / "optimizer_state.pt", weights_only=False)
    assert a_opt["param_groups"] == b_opt["param_groups"]
    assert a_opt["ds_version"] == b_opt["ds_version"]
    a_ms = _load(ours / "mp_rank_00_model_states.pt")
    b_ms = torch.load(theirs / "mp_rank_00_model_states.pt", weights_only=False)
    for k in ("param_shapes", "buffer_names", "shared_params", "global_steps", "skipped_steps"):
        assert a_ms[k] == b_ms[k], k
    assert list(a_ms["module"]) == sorted(b_ms["module"], key=list(a_ms["module"]).index)
    for k, v in b_ms["module"].items():
        assert torch.equal(a_ms["module"][k], v), k


def test_round_trip_is_bit_exact(tmp_path: Path) -> None:
    """unickpt -> UCP -> unickpt (convert --from deepspeed of OUT itself, via latest_universal):
    every model and optimizer tensor, the groups and the step come back bit for bit."""
    _trained(tmp_path / "ck")
    out, back = tmp_path / "ucp", tmp_path / "back"
    assert cli(["convert", "-q", "--to", "deepspeed", str(tmp_path / "ck"), str(out)]) == 0
    assert (out / "latest_universal").read_text() == "global_step3_universal"  # AdamW's step count
    assert cli(["convert", "-q", "--from", "deepspeed", str(out), str(back)]) == 0
    with open_checkpoint(str(tmp_path / "ck" / "model"), "model") as r:
        model = full_tensors(r)
    with open_checkpoint(str(tmp_path / "ck" / "optimizer"), "optimizer") as r:
        optim = {f"{r.tensors[n].param}/{r.tensors[n].state}": t for n, t in full_tensors(r).items()}
        groups = r.block.param_groups
    model2, optim2, groups2, param_state2 = _unickpt(back)
    assert set(model2) == set(model) and set(optim2) == set(optim)
    for k, v in model.items():
        assert model2[k].dtype == v.dtype and torch.equal(model2[k], v), k
    for k, v in optim.items():
        assert optim2[k].dtype == v.dtype and torch.equal(optim2[k], v), k
    assert groups2 == groups and param_state2 == {}
    # and it loads back into torch's AdamW as the original state
    m, opt = _model(1), None
    opt = torch.optim.AdamW(_groups(m))
    io = GeneralCheckpointIO()
    io.load_model(m, str(back))
    io.load_optimizer(OptimizerWrapper(opt, m), str(back))
    assert opt.param_groups[1]["lr"] == 5e-4 and opt.param_groups[0]["betas"] == (0.85, 0.95)


def _engine_load(
    ckpt: Path, tmp_path: Path, world: int, stage: int, sched: bool = False
) -> tuple[dict, dict]:
    try:
        import deepspeed  # noqa: F401
    except Exception as e:  # absent, or not importable here
        pytest.skip(
            f"deepspeed is not importable ({type(e).__name__}: {e}); see tests/data/make_deepspeed.py"
        )
    res = tmp_path / "engine"
    cp = subprocess.run(
        [
            sys.executable,
            str(LOADER),
            str(ckpt),
            str(res),
            str(world),
            str(stage),
            *(["sched"] if sched else []),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1"),
    )
    assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr[-6000:]
    return load_file(f"{res}.safetensors"), json.loads(Path(f"{res}.json").read_text())


def _assert_engine_holds(ck: Path, got: dict, info: dict) -> None:
    with open_checkpoint(str(ck / "model"), "model") as r:
        model = full_tensors(r)
    with open_checkpoint(str(ck / "optimizer"), "optimizer") as r:
        optim = {f"{r.tensors[n].param}/{r.tensors[n].state}": t for n, t in full_tensors(r).items()}
        groups = r.block.param_groups
    for n in NAMES:
        assert got[f"fp32.{n}"].dtype == torch.float32 and torch.equal(got[f"fp32.{n}"], model[n]), n
        assert torch.equal(got[f"module.{n}"], model[n]), n  # the engine's weights are the masters'
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got[f"{key}.{n}"], optim[f"{n}/{key}"]), (n, key)
    assert len(info["groups"]) == 2
    for g, want in zip(info["groups"], groups, strict=True):
        assert g["step"] == float(optim[f"{want['params'][0]}/step"]) == 3.0
        assert g["lr"] == want["lr"] and g["weight_decay"] == want["weight_decay"]
        assert g["betas"] == want["betas"] == [0.85, 0.95] and g["eps"] == want["eps"]
    assert info["global_steps"] == 3 and info["skipped_steps"] == 0


# ZeRO-2 on one rank runs by default (~10 s); the other stage / world size pairs are slow.
@pytest.mark.parametrize(
    "stage,world",
    [
        (2, 1),
        pytest.param(1, 1, marks=pytest.mark.slow),
        pytest.param(1, 2, marks=pytest.mark.slow),
        pytest.param(2, 2, marks=pytest.mark.slow),
    ],
)
def test_deepspeed_engine_resumes_bit_exact(tmp_path: Path, stage: int, world: int) -> None:
    """Real DeepSpeed (load_universal) restores the master weights, Adam moments, steps and
    hyperparameters of a unickpt checkpoint, bit for bit, at world size 1 and 2."""
    _trained(tmp_path / "ck")
    out = tmp_path / "ucp"
    assert cli(["convert", "-q", "--to", "deepspeed", str(tmp_path / "ck"), str(out)]) == 0
    got, info = _engine_load(out, tmp_path, world, stage)
    _assert_engine_holds(tmp_path / "ck", got, info)


@pytest.mark.slow
def test_manager_step_with_scheduler_resumes_in_deepspeed(tmp_path: Path) -> None:
    """A CheckpointManager step: global_steps is the step number (and the tag), the LR
    scheduler's state reaches DeepSpeed's engine."""
    m, opt, lr = _trained(tmp_path / "src", sched=True)
    run = tmp_path / "run"
    assert CheckpointManager(run).save(5, m, OptimizerWrapper(opt, m), lr, force=True)
    out = tmp_path / "ucp"
    assert cli(["convert", "-q", "--to", "deepspeed", str(run / "step-5"), str(out)]) == 0
    assert (out / "latest_universal").read_text() == "global_step5_universal"
    got, info = _engine_load(out, tmp_path, 2, 2, sched=True)
    _assert_engine_holds(run / "step-5", got, {**info, "global_steps": 3})
    assert info["global_steps"] == 5
    assert info["lr_scheduler"] == json.loads(json.dumps(lr.state_dict(), default=str))


def test_global_steps_from_a_run_converted_from_deepspeed(tmp_path: Path) -> None:
    """A DeepSpeed run imported with --to run keeps the engine's counters; exported back they
    are the model states file's again (and --step overrides global_steps)."""
    run = tmp_path / "run"
    convert_checkpoint(DS / "zero1_ws2" / "ckpt", run, source="deepspeed", target="run", step=7)
    out = tmp_path / "ucp"
    convert_checkpoint(run / "step-7", out, source="unickpt", target="deepspeed")
    ms = _load(out / "global_step3_universal" / "mp_rank_00_model_states.pt")
    theirs = torch.load(
        DS / "zero1_ws2" / "ckpt" / "global_step3" / "mp_rank_00_model_states.pt", weights_only=False
    )
    for k in ("global_steps", "global_samples", "skipped_steps"):
        assert ms[k] == theirs[k], k
    convert_checkpoint(run / "step-7", tmp_path / "ucp9", source="unickpt", target="deepspeed", step=9)
    assert (tmp_path / "ucp9" / "latest_universal").read_text() == "global_step9_universal"
    assert (
        _load(tmp_path / "ucp9" / "global_step9_universal" / "mp_rank_00_model_states.pt")["global_steps"]
        == 9
    )


def _rewrite_optimizer(ck: Path, mutate: Any) -> None:
    """Re-save ``ck/optimizer`` from a live AdamW changed by ``mutate(model, opt)``."""
    import shutil

    m = _model()
    opt = torch.optim.AdamW(_groups(m))
    io = GeneralCheckpointIO()
    io.load_model(m, str(ck / "model"))
    io.load_optimizer(OptimizerWrapper(opt, m), str(ck / "optimizer"))
    mutate(m, opt)
    shutil.rmtree(ck / "optimizer")
    io.save_optimizer(OptimizerWrapper(opt, m), str(ck / "optimizer"), shard=True, gather_dtensor=True)


def test_refusals_name_the_problem_and_write_nothing(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    m, _, _ = _trained(ck)
    # no optimizer beside the model
    GeneralCheckpointIO().save_model(m, str(tmp_path / "alone" / "model"), shard=True, gather_dtensor=True)
    with pytest.raises(IncompleteCheckpointError, match=r"alone.*holds no optimizer checkpoint"):
        convert_checkpoint(tmp_path / "alone", tmp_path / "o1", source="unickpt", target="deepspeed")
    assert not (tmp_path / "o1").exists()
    # the output exists
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(OutputExistsError, match="full already exists"):
        convert_checkpoint(ck, tmp_path / "full", source="unickpt", target="deepspeed")
    # --to deepspeed from another source
    with pytest.raises(UnsupportedError, match="--from dcp --to deepspeed"):
        convert_checkpoint(ck, tmp_path / "o2", source="dcp", target="deepspeed")

    def uneven_steps(m: nn.Module, opt: torch.optim.Optimizer) -> None:
        opt.state[m[0].bias]["step"] = torch.tensor(2.0)

    ck = tmp_path / "ck3"
    _trained(ck)
    _rewrite_optimizer(ck, uneven_steps)
    with pytest.raises(
        UnsupportedError,
        match=r"in param group 0, '0\.weight' has state \['exp_avg', 'exp_avg_sq', 'fp32'\] at step 3\.0 but "
        r"'0\.bias' has .* at step 2\.0; DeepSpeed keeps one",
    ):
        convert_checkpoint(ck, tmp_path / "o3", source="unickpt", target="deepspeed")
    assert not (tmp_path / "o3").exists()

    def odd_state(m: nn.Module, opt: torch.optim.Optimizer) -> None:
        for p in m.parameters():
            opt.state[p]["note"] = "hi"

    ck = tmp_path / "ck4"
    _trained(ck)
    _rewrite_optimizer(ck, odd_state)
    with pytest.raises(UnsupportedError, match=r"optimizer state 'note' of '0\.weight' is a str"):
        convert_checkpoint(ck, tmp_path / "o4", source="unickpt", target="deepspeed")

    def short_state(m: nn.Module, opt: torch.optim.Optimizer) -> None:
        for p in m.parameters():
            opt.state[p]["note"] = opt.state[p]["exp_avg"]
        opt.state[m[2].bias]["note"] = torch.zeros(2)

    ck = tmp_path / "ck5"
    _trained(ck)
    _rewrite_optimizer(ck, short_state)
    with pytest.raises(UnsupportedError, match=r"state 'note' of '2\.bias' has 2 elements, its parameter 3"):
        convert_checkpoint(ck, tmp_path / "o5", source="unickpt", target="deepspeed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alone", "ck", "ck3", "ck4", "ck5", "full"]


def test_names_that_cannot_be_directories_are_refused(tmp_path: Path) -> None:
    """zero/<fqn>/ is a directory: a name with a path separator is refused, nothing written."""
    m = nn.Module()
    m.register_parameter("a/w", nn.Parameter(torch.ones(2)))
    opt = torch.optim.AdamW(m.parameters())
    m.get_parameter("a/w").sum().backward()
    opt.step()
    io = GeneralCheckpointIO()
    io.save_model(m, str(tmp_path / "ck" / "model"), shard=True, gather_dtensor=True)
    io.save_optimizer(
        OptimizerWrapper(opt, m), str(tmp_path / "ck" / "optimizer"), shard=True, gather_dtensor=True
    )
    with pytest.raises(UnsupportedError, match=r"parameter name 'a/w' cannot be a directory of a DeepSpeed"):
        convert_checkpoint(tmp_path / "ck", tmp_path / "out", source="unickpt", target="deepspeed")
    assert not (tmp_path / "out").exists()


def test_tied_weights_are_shared_params(tmp_path: Path) -> None:
    """A tied weight has one zero/<fqn>/ (the name the optimizer lists), the other name in
    ``shared_params`` and ``module``; imported again, the model ties it back."""

    m = Tied(vocab=5, dim=3, proj=0)
    opt = torch.optim.AdamW(m.parameters())
    m(torch.tensor([1, 2])).sum().backward()
    opt.step()
    io = GeneralCheckpointIO()
    io.save_model(m, str(tmp_path / "ck" / "model"), shard=True, gather_dtensor=True)
    io.save_optimizer(
        OptimizerWrapper(opt, m), str(tmp_path / "ck" / "optimizer"), shard=True, gather_dtensor=True
    )
    convert_checkpoint(tmp_path / "ck", tmp_path / "ucp", source="unickpt", target="deepspeed")
    step_dir = tmp_path / "ucp" / "global_step1_universal"
    assert sorted(os.listdir(step_dir / "zero")) == ["emb.weight", "optimizer_state.pt"]
    ms = _load(step_dir / "mp_rank_00_model_states.pt")
    assert ms["shared_params"] == {"head.weight": "emb.weight"} and ms["buffer_names"] == []
    assert torch.equal(ms["module"]["head.weight"], m.emb.weight.detach())
    convert_checkpoint(tmp_path / "ucp", tmp_path / "back", source="deepspeed")
    m2 = Tied(vocab=5, dim=3, proj=0)
    io.load_model(m2, str(tmp_path / "back"))
    assert torch.equal(m2.emb.weight, m.emb.weight) and m2.head.weight is m2.emb.weight
