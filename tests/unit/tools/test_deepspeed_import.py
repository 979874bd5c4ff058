"""``convert --from deepspeed``: DeepSpeed ZeRO stage 1/2/3 checkpoints in, bit-exact, no code run.

The fixtures under tests/data/deepspeed/ were written by real DeepSpeed 0.19.8 on CPU (ZeRO 1,
2 and 3, world size 1 and 2 over gloo) by tests/data/make_deepspeed.py, whose docstring says how
to install DeepSpeed (``pip install --no-deps deepspeed hjson einops msgpack py-cpuinfo``) and
run it. Beside each checkpoint, ``expected.safetensors`` holds what DeepSpeed's own
``get_fp32_state_dict_from_zero_checkpoint`` returned (``model.*``) and the live optimizer's
Adam state per parameter (``state.*``); ``expected.json`` the param groups. These tests need no
DeepSpeed; ``test_live_zero_to_fp32_agrees`` runs DeepSpeed's reader too and skips without it.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from unickpt import CheckpointManager, GeneralCheckpointIO, OptimizerWrapper, UnickptError
from unickpt.cli.main import main as cli
from unickpt.errors import CheckpointFormatError, IncompleteCheckpointError, UnsafePathError, UnsupportedError
from unickpt.io.jsonstate import to_json_value
from unickpt.tools.convert import convert_checkpoint
from unickpt.tools.convert_deepspeed import read_deepspeed

DATA = Path(__file__).resolve().parents[2] / "data" / "deepspeed"
CASES = ["zero1_ws1", "zero1_ws2", "zero2_ws1", "zero2_ws2", "zero3_ws1", "zero3_ws2"]
# bf16 runs with ZeRO stage 1: DeepSpeed's BF16_Optimizer, bf16_zero_pp_rank_* files.
BF16_CASES = ["bf16_zero1_ws1", "bf16_zero1_ws2"]


def _stage(case: str) -> int:
    return int(case.removeprefix("bf16_")[4])


def _model() -> nn.Module:
    m = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 3))
    m.register_buffer("scale", torch.zeros(3))
    return m


def _optimizer(m: nn.Module, expected: dict) -> torch.optim.Optimizer:
    named = dict(m.named_parameters())
    groups = []
    for g in expected["param_groups"]:
        hyper = {k: v for k, v in g.items() if k not in ("params", "amsgrad", "foreach", "fused")}
        hyper["betas"] = tuple(hyper["betas"])
        groups.append({"params": [named[n] for n in g["params"]], **hyper})
    return torch.optim.AdamW(groups, lr=1.0)


def _expected(case: str) -> tuple[dict[str, torch.Tensor], dict]:
    return load_file(DATA / case / "expected.safetensors"), json.loads(
        (DATA / case / "expected.json").read_text()
    )


def _assert_restored(m: nn.Module, opt: torch.optim.Optimizer, case: str) -> None:
    tensors, expected = _expected(case)
    sd = m.state_dict()
    model_keys = {k[len("model.") :] for k in tensors if k.startswith("model.")}
    assert model_keys == set(sd)
    for k in model_keys:
        want = tensors[f"model.{k}"]
        assert sd[k].dtype == want.dtype and torch.equal(sd[k], want), k
    names = {id(p): n for n, p in m.named_parameters()}
    seen = 0
    for p, st in opt.state.items():
        n = names[id(p)]
        for key in ("exp_avg", "exp_avg_sq", "step"):
            want = tensors[f"state.{n}.{key}"]
            assert torch.equal(st[key], want.reshape(st[key].shape)), (n, key)
        seen += 1
    assert seen == len(names)
    got = [{k: to_json_value(v, k) for k, v in g.items() if k != "params"} for g in opt.param_groups]
    for g, want in zip(got, expected["param_groups"], strict=True):
        for k, v in want.items():
            if k != "params":
                assert g[k] == v, k
    assert [[names[id(p)] for p in g["params"]] for g in opt.param_groups] == [
        g["params"] for g in expected["param_groups"]
    ]


@pytest.mark.parametrize("case", CASES + BF16_CASES)
def test_reassembly_is_bit_exact(case: str) -> None:
    tensors, expected = _expected(case)
    ck = read_deepspeed(str(DATA / case / "ckpt"))
    assert ck.world_size == int(case[-1]) and ck.zero_stage == _stage(case) and ck.step == expected["step"]
    for k, want in tensors.items():
        kind, _, rest = k.partition(".")
        if kind == "model":
            got = ck.model[rest]
        elif kind == "state":
            fqn, key = rest.rsplit(".", 1)
            got = ck.state[fqn][key]
        else:
            continue
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), k
    # the module's own weights (what the engine trained with) are the master weights (an fp32
    # run), or their rounding (bf16: the master weights are what training continues from)
    for k, v in tensors.items():
        if k.startswith("module."):
            master = ck.model[k[len("module.") :]]
            assert master.dtype == torch.float32
            assert torch.equal(master.to(v.dtype), v), k
    if case in BF16_CASES:
        assert any(t.dtype == torch.bfloat16 for k, t in tensors.items() if k.startswith("module."))


@pytest.mark.parametrize("case", CASES + BF16_CASES)
def test_convert_then_load_model_and_optimizer(case: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert cli(["convert", "-q", "--from", "deepspeed", str(DATA / case / "ckpt"), str(out)]) == 0
    m = _model()
    opt = _optimizer(m, _expected(case)[1])
    io = GeneralCheckpointIO()
    io.load_model(m, str(out))
    io.load_optimizer(OptimizerWrapper(opt, m), str(out))
    _assert_restored(m, opt, case)
    assert cli(["verify", str(out)]) == 0


def test_convert_to_run_resumes_with_the_manager(tmp_path: Path) -> None:
    case = "zero2_ws2"
    run = tmp_path / "run"
    convert_checkpoint(DATA / case / "ckpt", run, source="deepspeed", target="run")
    mgr = CheckpointManager(run)
    assert mgr.all_steps() == [3]

    class TrainState:
        def __init__(self) -> None:
            self.state: dict = {}

        def state_dict(self) -> dict:
            return self.state

        def load_state_dict(self, sd: dict) -> None:
            self.state = sd

    m = _model()
    opt = _optimizer(m, _expected(case)[1])
    ts = TrainState()
    assert mgr.load(m, OptimizerWrapper(opt, m), train_state=ts) == 3
    assert ts.state == {"global_steps": 3, "global_samples": 12, "skipped_steps": 0}
    _assert_restored(m, opt, case)
    convert_checkpoint(DATA / case / "ckpt", tmp_path / "run2", source="deepspeed", target="run", step=30)
    assert CheckpointManager(tmp_path / "run2").all_steps() == [30]


def test_step_directory_given_directly(tmp_path: Path) -> None:
    ck = read_deepspeed(str(DATA / "zero2_ws1" / "ckpt" / "global_step3"))
    assert ck.step == 3


class _System:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def _copy(tmp_path: Path, case: str = "zero2_ws2") -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(DATA / case / "ckpt", dst)
    return dst


@pytest.mark.parametrize(
    "victim", ["zero_pp_rank_1_mp_rank_00_optim_states.pt", "mp_rank_00_model_states.pt"]
)
def test_pickle_calling_os_system_is_refused(tmp_path: Path, victim: str) -> None:
    ck = _copy(tmp_path)
    marker = tmp_path / "PWNED"
    torch.save({"optimizer_state_dict": _System(marker), "module": {}}, ck / "global_step3" / victim)
    with pytest.raises(UnsupportedError, match="system"):
        convert_checkpoint(ck, tmp_path / "out", source="deepspeed")
    assert not marker.exists()
    assert not (tmp_path / "out").exists()
    assert cli(["convert", "-q", "--from", "deepspeed", str(ck), str(tmp_path / "out")]) != 0
    assert not marker.exists()


def test_other_globals_are_refused(tmp_path: Path) -> None:
    """A class the allowlist does not name, even from deepspeed or torch, is never resolved."""
    ck = _copy(tmp_path)
    path = ck / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"

    class Engine:
        pass

    Engine.__module__ = "deepspeed.runtime.engine"
    Engine.__qualname__ = "DeepSpeedEngine"
    import sys
    import types

    fake = types.ModuleType("deepspeed.runtime.engine")
    fake.DeepSpeedEngine = Engine  # type: ignore[attr-defined]
    saved = {k: sys.modules.get(k) for k in ("deepspeed", "deepspeed.runtime", "deepspeed.runtime.engine")}
    sys.modules.update(
        {"deepspeed": types.ModuleType("deepspeed"), "deepspeed.runtime": types.ModuleType("x")}
    )
    sys.modules["deepspeed.runtime.engine"] = fake
    try:
        torch.save({"optimizer_state_dict": Engine()}, path)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    with pytest.raises(UnsupportedError, match=r"deepspeed\.runtime\.engine\.DeepSpeedEngine"):
        read_deepspeed(str(ck))
    path.write_bytes(pickle.dumps({"x": print}))
    with pytest.raises(UnickptError):
        read_deepspeed(str(ck))


def test_damaged_and_incomplete_checkpoints(tmp_path: Path) -> None:
    ck = _copy(tmp_path)
    (ck / "latest").write_text("../../etc")
    with pytest.raises(UnsafePathError):
        read_deepspeed(str(ck))
    (ck / "latest").write_text("global_step9")
    with pytest.raises(IncompleteCheckpointError):
        read_deepspeed(str(ck))
    (ck / "latest").write_text("global_step3")
    (ck / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(IncompleteCheckpointError, match="2 ranks"):
        read_deepspeed(str(ck))
    (ck / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"not a zip")
    with pytest.raises(UnickptError):
        read_deepspeed(str(ck))
    with pytest.raises(IncompleteCheckpointError):
        read_deepspeed(str(tmp_path / "nothing"))


def test_wrong_structure_is_a_format_error(tmp_path: Path) -> None:
    ck = _copy(tmp_path, "zero1_ws1")
    path = ck / "global_step3" / "mp_rank_00_model_states.pt"
    ms = torch.load(path, weights_only=True)
    ms["param_shapes"] = [{"0.weight": "six by four", "0.bias": [6], "2.weight": [3, 6]}]
    torch.save(ms, path)
    with pytest.raises(
        CheckpointFormatError, match=r"shape of parameter '0\.weight' of group 0 is 'six by four'"
    ):
        read_deepspeed(str(ck))
    ms["param_shapes"] = [{"0.weight": [600, 4], "0.bias": [6], "2.weight": [3, 6]}]
    torch.save(ms, path)
    with pytest.raises(CheckpointFormatError, match="ends past"):
        read_deepspeed(str(ck))


def test_live_zero_to_fp32_agrees(tmp_path: Path) -> None:
    """DeepSpeed's own reader on the fixture (and on a copy) gives exactly unickpt's model."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except Exception as e:  # absent, or not importable here
        pytest.skip(
            f"deepspeed is not importable ({type(e).__name__}: {e}); see tests/data/make_deepspeed.py"
        )
    for case in CASES:
        theirs = get_fp32_state_dict_from_zero_checkpoint(str(DATA / case / "ckpt"))
        ours = read_deepspeed(str(DATA / case / "ckpt")).model
        assert set(theirs) == set(ours)
        for k, v in theirs.items():
            assert torch.equal(v.contiguous(), ours[k]), (case, k)


def test_saved_lr_scheduler_becomes_lr_scheduler_json(tmp_path: Path) -> None:
    """DeepSpeed stores the scheduler's ``state_dict`` in the model states file; it comes along."""
    ck = _copy(tmp_path, "zero1_ws1")
    path = ck / "global_step3" / "mp_rank_00_model_states.pt"
    ms = torch.load(path, weights_only=True)
    m = _model()
    opt = _optimizer(m, _expected("zero1_ws1")[1])
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(3):
        opt.step()
        sched.step()
    ms["lr_scheduler"] = sched.state_dict()
    torch.save(ms, path)
    run = tmp_path / "run"
    convert_checkpoint(ck, run, source="deepspeed", target="run")
    assert (run / "step-3" / "lr_scheduler.json").is_file()
    m2 = _model()
    opt2 = _optimizer(m2, _expected("zero1_ws1")[1])
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1)
    assert CheckpointManager(run).load(m2, OptimizerWrapper(opt2, m2), sched2) == 3
    assert sched2.state_dict() == sched.state_dict()
    out = tmp_path / "out"
    convert_checkpoint(ck, out, source="deepspeed")
    sched3 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1)
    GeneralCheckpointIO().load_lr_scheduler(sched3, str(out))
    assert sched3.state_dict() == sched.state_dict()


def test_universal_checkpoint_reads_like_the_zero_one(tmp_path: Path) -> None:
    """DeepSpeed's ds_to_universal output (whole tensors per parameter) of a ZeRO-2 x2 run: the
    same model, moments, steps and groups as the ZeRO files it was made from, bit for bit."""
    case = "ucp_zero2_ws2"
    universal = DATA / case / "ckpt" / "global_step3_universal"
    zero = read_deepspeed(str(DATA / case / "ckpt"))
    ucp = read_deepspeed(str(universal))
    assert zero.world_size == 2 and ucp.world_size == 1 and ucp.step == zero.step == 3
    assert list(ucp.model) == list(zero.model) and ucp.param_groups == zero.param_groups
    for k, v in zero.model.items():
        assert ucp.model[k].dtype == v.dtype and torch.equal(ucp.model[k], v), k
    for fqn, st in zero.state.items():
        assert set(ucp.state[fqn]) == set(st), fqn
        for key, v in st.items():
            assert torch.equal(torch.as_tensor(ucp.state[fqn][key]), torch.as_tensor(v)), (fqn, key)
    tensors, _ = _expected(case)
    for k, want in tensors.items():
        if k.startswith("model."):
            assert torch.equal(ucp.model[k[len("model.") :]], want), k
    out = tmp_path / "out"
    assert cli(["convert", "-q", str(universal), str(out)]) == 0  # --from deepspeed told from the files
    m = _model()
    opt = _optimizer(m, _expected(case)[1])
    io = GeneralCheckpointIO()
    io.load_model(m, str(out))
    io.load_optimizer(OptimizerWrapper(opt, m), str(out))
    _assert_restored(m, opt, case)


def test_universal_checkpoint_with_an_escaping_name_is_refused(tmp_path: Path) -> None:
    from unickpt.errors import UnsafePathError

    ck = tmp_path / "u"
    shutil.copytree(DATA / "ucp_zero2_ws2" / "ckpt" / "global_step3_universal", ck)
    model = ck / "mp_rank_00_model_states.pt"
    ms = torch.load(model, weights_only=True)
    first = ms["param_shapes"][0]
    name = next(iter(first))
    ms["param_shapes"][0] = {f"../{name}": first[name], **{k: v for k, v in first.items() if k != name}}
    torch.save(ms, model)
    with pytest.raises(UnsafePathError, match=r"parameter name '\.\./"):
        read_deepspeed(str(ck))
