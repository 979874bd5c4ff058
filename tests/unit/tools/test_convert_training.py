"""unickpt convert: whole DCP / torchtitan training checkpoints in, and unickpt back out to DCP.

The DCP checkpoints are written by torch's own ``dcp.save`` of ``get_state_dict(model,
optimizer)``. torchtitan 0.3.0 installs here only without its dependencies (tyro, torchdata,
torch_checkpointing, datasets, ... are absent), so its ``CheckpointManager`` cannot run; the
torchtitan-layout checkpoints below are built with DCP exactly as its
``checkpointer/dcp.py`` does (model tensors at the top level, ``optimizer`` flattened by
``get_flat_optim_state_dict``, ``lr_scheduler`` = ``{"last_epoch"}``, ``train_state`` =
``{"step", "ntokens_seen"}``, ``dataloader`` = ``{"dp_rank_0": pickle bytes, "world_size"}``),
and where torchtitan is installed (``pip install --no-deps torchtitan``) its own flattening
function is checked against ours.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _reliability import dcp_model, dcp_optimizer, dcp_train, flat_optim
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from unickpt import CheckpointManager, GeneralCheckpointIO
from unickpt.cli.main import main
from unickpt.errors import CheckpointFormatError, IntegrityError, UnsupportedError
from unickpt.tools.convert import convert_checkpoint
from unickpt.wrappers import OptimizerWrapper

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")


def _fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    m = dcp_model()
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
    return m, dcp_optimizer(m)


def _assert_same_training(a: tuple[torch.nn.Module, torch.optim.Optimizer], b: tuple[Any, Any]) -> None:
    """Models, optimizer state and hyperparameters bit-exact, then one more step stays bit-exact."""
    for (k, v), v2 in zip(a[0].state_dict().items(), b[0].state_dict().values(), strict=True):
        assert torch.equal(v, v2), k
    sa, sb = a[1].state_dict(), b[1].state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for pid, st in sa["state"].items():
        for k, v in st.items():
            assert torch.equal(v, sb["state"][pid][k]), (pid, k)
    dcp_train(a[0], a[1], 1, seed=99)
    dcp_train(b[0], b[1], 1, seed=99)
    for (k, v), v2 in zip(a[0].state_dict().items(), b[0].state_dict().values(), strict=True):
        assert torch.equal(v, v2), f"after one more step: {k}"


def test_dcp_training_checkpoint_imports_model_optimizer_scheduler(tmp_path: Path, dcp_run: Any) -> None:
    src, m, opt, sched = dcp_run
    out = tmp_path / "u"
    assert main(["convert", "-q", "--from", "dcp", str(src), str(out)]) == 0
    assert sorted(os.listdir(out)) == [
        "lr_scheduler.json",
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
        "optimizer-00001-of-00001.safetensors",
        "optimizer.safetensors.index.json",
    ]
    m2, opt2 = _fresh()
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=7, gamma=0.1)
    io_ = GeneralCheckpointIO()
    io_.load_model(m2, out, verify=True)
    io_.load_optimizer(OptimizerWrapper(opt2, m2), out, verify=True)
    io_.load_lr_scheduler(sched2, out)
    assert sched2.state_dict() == sched.state_dict()
    index = json.loads((out / "optimizer.safetensors.index.json").read_text())["unickpt"]
    assert [g["params"] for g in index["param_groups"]] == [
        ["0.weight", "2.weight"],
        ["0.bias", "1.weight", "1.bias", "2.bias"],
    ]
    _assert_same_training((m, opt), (m2, opt2))


def test_dcp_round_trip_dcp_unickpt_dcp(tmp_path: Path, dcp_run: Any) -> None:
    src, m, opt, _ = dcp_run
    convert_checkpoint(src, tmp_path / "u", source="dcp")
    back = tmp_path / "back"
    assert main(["convert", "-q", "--to", "dcp", str(tmp_path / "u"), str(back)]) == 0
    # torch's own load reads it, into a fresh model and optimizer
    m2, opt2 = _fresh()
    torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)  # as a resuming run builds it (initial_lr)
    dcp_train(m2, opt2, 1, seed=5)  # any state; replaced by the load
    msd, osd = get_state_dict(m2, opt2)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(back), no_dist=True)
    set_state_dict(m2, opt2, model_state_dict=msd, optim_state_dict=osd)
    _assert_same_training((m, opt), (m2, opt2))
    # and it converts to the same unickpt checkpoint again: identical fingerprints
    convert_checkpoint(back, tmp_path / "u2", source="dcp")
    from unickpt import diff_checkpoints

    assert diff_checkpoints(tmp_path / "u", tmp_path / "u2").identical


def test_unickpt_to_dcp_to_unickpt(tmp_path: Path) -> None:
    m = dcp_model()
    opt = dcp_optimizer(m)
    dcp_train(m, opt, 2)
    io_ = GeneralCheckpointIO()
    ck = tmp_path / "ck"
    io_.save_model(m, ck, shard=True, gather_dtensor=True, size_per_shard=0.0001)
    io_.save_optimizer(OptimizerWrapper(opt, m), ck, shard=True, size_per_shard=0.0001)
    convert_checkpoint(ck, tmp_path / "d", source="unickpt", target="dcp")
    convert_checkpoint(tmp_path / "d", tmp_path / "u", source="dcp")
    m2, opt2 = _fresh()
    io_.load_model(m2, tmp_path / "u", verify=True)
    io_.load_optimizer(OptimizerWrapper(opt2, m2), tmp_path / "u", verify=True)
    _assert_same_training((m, opt), (m2, opt2))


@pytest.mark.parametrize("given", ["ckpt", "ckpt/model"])
def test_export_of_the_readme_layout_takes_the_optimizer(tmp_path: Path, given: str) -> None:
    """``save_model(m, "ckpt/model")`` + ``save_optimizer(o, "ckpt/optimizer")`` (+ the scheduler):
    ``convert --to dcp ckpt`` and ``convert --to dcp ckpt/model`` export all three, which
    ``dcp.load`` and ``set_state_dict`` restore bit for bit."""
    m = dcp_model()
    opt = dcp_optimizer(m)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    dcp_train(m, opt, 3)
    sched.step()
    io_ = GeneralCheckpointIO()
    io_.save_model(m, tmp_path / "ckpt" / "model", shard=True)
    io_.save_optimizer(OptimizerWrapper(opt, m), tmp_path / "ckpt" / "optimizer", shard=True)
    io_.save_lr_scheduler(sched, tmp_path / "ckpt" / "lr_scheduler.json")
    out = tmp_path / "dcp"
    assert main(["convert", "-q", "--to", "dcp", str(tmp_path / given), str(out)]) == 0
    md = dcp.FileSystemReader(str(out)).read_metadata()
    assert {k.split(".")[0] for k in md.state_dict_metadata} == {"model", "optim", "lr_scheduler"}
    m2, opt2 = _fresh()
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    msd, osd = get_state_dict(m2, opt2)
    holder = {"model": msd, "optim": osd, "lr_scheduler": sched2.state_dict()}
    dcp.load(holder, checkpoint_id=str(out), no_dist=True)
    set_state_dict(m2, opt2, model_state_dict=msd, optim_state_dict=osd)
    sched2.load_state_dict(holder["lr_scheduler"])
    assert sched2.state_dict() == sched.state_dict()
    _assert_same_training((m, opt), (m2, opt2))


def test_export_refuses_a_damaged_checkpoint(tmp_path: Path) -> None:
    m = dcp_model()
    io_ = GeneralCheckpointIO()
    io_.save_model(m, tmp_path / "ck", shard=True)
    f = next(p for p in (tmp_path / "ck").iterdir() if p.name.endswith(".safetensors"))
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 0x10
    f.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match=r"0\.weight|2\.weight|bias"):
        convert_checkpoint(tmp_path / "ck", tmp_path / "d", source="unickpt", target="dcp")
    assert not (tmp_path / "d").exists()


# ---------------------------------------------------------------- torchtitan layout
def _torchtitan_step(folder: Path, step: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    m = dcp_model()
    opt = dcp_optimizer(m)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    for _ in range(step):
        dcp_train(m, opt, 1)
        sched.step()
    states = {
        **m.state_dict(),
        "optimizer": flat_optim(opt, m),
        "lr_scheduler": {"last_epoch": sched.last_epoch},
        "train_state": {"step": step, "ntokens_seen": 1536 * step},
        "dataloader": {"dp_rank_0": pickle.dumps({"sample": 12}), "world_size": 1},
    }
    dcp.save(states, checkpoint_id=str(folder / f"step-{step}"), no_dist=True)
    return m, opt, sched


class _TrainState:
    def __init__(self) -> None:
        self.state: dict[str, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.state = dict(sd)


def test_torchtitan_folder_becomes_a_manager_run(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "checkpoint"
    _torchtitan_step(folder, 2)
    m, opt, sched = _torchtitan_step(folder, 4)
    run = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="unickpt"):
        assert main(["convert", "-q", "--from", "dcp", "--to", "run", str(folder), str(run)]) == 0
    assert "dataloader.dp_rank_0" in caplog.text  # skipped, never unpickled
    assert sorted(os.listdir(run)) == ["latest", "step-4"]  # the latest step of the folder
    assert sorted(os.listdir(run / "step-4")) == [
        "COMMIT",
        "lr_scheduler.json",
        "model",
        "optimizer",
        "train_state",
    ]
    m2, opt2 = _fresh()
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 1.0 / (1 + s))
    ts = _TrainState()
    mgr = CheckpointManager(run)
    assert mgr.all_steps() == [4]
    with caplog.at_level(logging.WARNING, logger="unickpt"):
        assert mgr.load(m2, OptimizerWrapper(opt2, m2), sched2, train_state=ts) == 4
    assert "no RNG states" in caplog.text
    assert ts.state == {"step": 4, "ntokens_seen": 6144}
    assert sched2.last_epoch == sched.last_epoch == 4
    # torchtitan's per-parameter hyperparameters regroup into the optimizer's two groups
    groups = json.loads((run / "step-4" / "optimizer" / "optimizer.safetensors.index.json").read_text())
    assert sorted(len(g["params"]) for g in groups["unickpt"]["param_groups"]) == [2, 4]
    _assert_same_training((m, opt), (m2, opt2))
    # --step overrides; a DCP checkpoint without train_state.step needs it
    convert_checkpoint(folder / "step-2", tmp_path / "run2", source="dcp", target="run", step=20)
    assert CheckpointManager(tmp_path / "run2").all_steps() == [20]


def test_run_layout_names_match_the_manager() -> None:
    from unickpt import manager
    from unickpt.ckpt import run_layout

    assert run_layout.COMMIT_NAME == manager.COMMIT_NAME
    assert run_layout.LATEST_NAME == manager.LATEST_NAME
    assert run_layout.TRAIN_STATE_DIR == manager.TRAIN_STATE_DIR
    assert run_layout.STATE_VERSION == manager._STATE_VERSION


@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="torchtitan not installed")
def test_our_torchtitan_layout_matches_torchtitans_flattening() -> None:
    """``pip install --no-deps torchtitan``: its optimizer/utils.py imports only torch."""
    spec = importlib.util.find_spec("torchtitan")
    assert spec is not None and spec.submodule_search_locations
    path = os.path.join(next(iter(spec.submodule_search_locations)), "components", "optimizer", "utils.py")
    mod_spec = importlib.util.spec_from_file_location("_tt_optim_utils", path)
    assert mod_spec is not None and mod_spec.loader is not None
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    m = dcp_model()
    named = dict(m.named_parameters())
    opt = torch.optim.AdamW(
        [
            {"params": [("0.weight", named["0.weight"]), ("2.weight", named["2.weight"])], "lr": 1e-2},
            {
                "params": [(n, p) for n, p in named.items() if n.endswith("bias") or n.startswith("1.")],
                "lr": 3e-3,
            },
        ]
    )
    dcp_train(m, opt, 1)
    theirs = mod.get_flat_optim_state_dict(opt)
    ours = flat_optim(opt, m)
    assert theirs.keys() == ours.keys()
    for k, v in theirs.items():
        assert torch.equal(v, ours[k]) if isinstance(v, torch.Tensor) else v == ours[k], k


# ---------------------------------------------------------------- nothing is unpickled
class _Boom:
    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, ("touch /tmp/unickpt-pwned",))


def test_hostile_dcp_metadata_runs_no_code(tmp_path: Path, dcp_run: Any) -> None:
    src = dcp_run.src
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self) -> tuple[Any, tuple[str]]:
            return (os.system, (f"touch {marker}",))

    (src / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(UnsupportedError, match=r"\.metadata: refers to (posix|os)\.system"):
        convert_checkpoint(src, tmp_path / "u", source="dcp")
    assert not marker.exists() and not (tmp_path / "u").exists()
    assert main(["convert", "-q", "--from", "dcp", str(src), str(tmp_path / "u")]) == 2
    # a name the metadata module imports (os, Enum, dataclass) is not one of its classes
    for ref in (b"os", b"Enum", b"field"):
        (src / ".metadata").write_bytes(b"ctorch.distributed.checkpoint.metadata\n" + ref + b"\n.")
        with pytest.raises(UnsupportedError, match=r"which is not a metadata class"):
            convert_checkpoint(src, tmp_path / "u", source="dcp")
    (src / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(CheckpointFormatError, match=r"\.metadata: not a readable DCP metadata file"):
        convert_checkpoint(src, tmp_path / "u", source="dcp")


def test_hostile_dcp_bytes_entry_is_not_unpickled(tmp_path: Path) -> None:
    m = dcp_model()
    opt = dcp_optimizer(m)
    dcp_train(m, opt, 1)
    msd, osd = get_state_dict(m, opt)
    src = tmp_path / "dcp"
    # a scheduler "state" holding an object: DCP pickles it into a bytes entry
    dcp.save(
        {"model": msd, "optim": osd, "lr_scheduler": {"fn": _Boom()}}, checkpoint_id=str(src), no_dist=True
    )
    with pytest.raises(UnsupportedError, match=r"'lr_scheduler\.fn'.*weights_only=True"):
        convert_checkpoint(src, tmp_path / "u", source="dcp")
    assert not os.path.exists("/tmp/unickpt-pwned")
    assert not (tmp_path / "u").exists()


def test_optimizer_state_dict_with_integer_params_is_refused(tmp_path: Path) -> None:
    m = dcp_model()
    opt = dcp_optimizer(m)
    dcp_train(m, opt, 1)
    src = tmp_path / "dcp"
    # the optimizer's own state_dict() (integer ids), not get_state_dict's FQN-keyed one
    dcp.save({"model": m.state_dict(), "optim": opt.state_dict()}, checkpoint_id=str(src), no_dist=True)
    with pytest.raises(CheckpointFormatError, match=r"optim\.param_groups\.0\.params.*get_state_dict"):
        convert_checkpoint(src, tmp_path / "u", source="dcp")


def test_bad_source_target_pairs(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedError, match="--from unickpt --to dcp"):
        convert_checkpoint(tmp_path, tmp_path / "o", source="bin", target="dcp")
    with pytest.raises(UnsupportedError, match="--to run"):
        convert_checkpoint(tmp_path, tmp_path / "o", source="bin", target="run")


# ---------------------------------------------------------------- Colossal-AI
COLO = Path(__file__).resolve().parents[2] / "data" / "colossalai"


def _colo_expected(case: str) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    from safetensors.torch import load_file

    return load_file(COLO / case / "expected.safetensors"), json.loads(
        (COLO / case / "expected.json").read_text()
    )["param_groups"]


def _colo_model_opt(two_groups: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3), torch.nn.Linear(3, 2))
    if two_groups:
        opt = torch.optim.AdamW(
            [
                {"params": [m[0].weight, m[0].bias, m[2].weight], "lr": 1e-3},
                {"params": [m[1].weight, m[1].bias, m[2].bias], "lr": 5e-4, "weight_decay": 0.0},
            ],
            betas=(0.8, 0.95),
        )
    else:
        opt = torch.optim.AdamW(m.parameters(), lr=2e-3, betas=(0.85, 0.9))
    return m, opt


def _check_colo(case: str, out: Path, m: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    exp, groups = _colo_expected(case)
    m.load_state_dict({k[len("model.") :]: v for k, v in exp.items() if k.startswith("model.")})
    GeneralCheckpointIO().load_optimizer(OptimizerWrapper(opt, m), out, verify=True)
    sd = opt.state_dict()
    for pid, st in sd["state"].items():
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(st[k], exp[f"state.{pid}.{k}"]), (pid, k)
    got = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in sd["param_groups"]]
    assert got == groups


def test_colossalai_optimizer_with_the_model_checkpoint_beside_it(tmp_path: Path) -> None:
    """tests/data/colossalai/ is real Colossal-AI 0.5.0 output (tests/data/make_colossalai.py)."""
    out = tmp_path / "opt"
    assert (
        main(["convert", "-q", "--from", "colossalai", str(COLO / "one_group" / "optimizer"), str(out)]) == 0
    )
    _check_colo("one_group", out, *_colo_model_opt(False))


def test_colossalai_real_checkpoint_converts_bit_exact_through_the_api(tmp_path: Path) -> None:
    out = tmp_path / "out"
    convert_checkpoint(COLO / "one_group" / "optimizer", out, source="colossalai")
    _check_colo("one_group", out, *_colo_model_opt(False))


def test_colossalai_optimizer_with_groups_in_another_order(tmp_path: Path) -> None:
    src = COLO / "two_groups" / "optimizer"
    # the model checkpoint's order is not the optimizer's: refused, naming id, FQN and shapes
    with pytest.raises(
        CheckpointFormatError, match=r"id 2 has shape \(2, 3\), but id 2 maps to '1\.weight' of shape \(3,\)"
    ):
        convert_checkpoint(src, tmp_path / "bad", source="colossalai")
    assert not (tmp_path / "bad").exists()
    m, opt = _colo_model_opt(True)
    convert_checkpoint(src, tmp_path / "opt", source="colossalai", model=m, optimizer=opt)
    _check_colo("two_groups", tmp_path / "opt", *_colo_model_opt(True))


def test_colossalai_errors(tmp_path: Path) -> None:
    import shutil

    with pytest.raises(UnsupportedError, match="give the model"):
        shutil.copytree(COLO / "one_group" / "optimizer", tmp_path / "alone" / "opt")
        convert_checkpoint(tmp_path / "alone" / "opt", tmp_path / "o", source="colossalai")
    bad = tmp_path / "bad" / "optimizer"
    shutil.copytree(COLO / "one_group", tmp_path / "bad")
    torch.save({"x": _Boom()}, bad / "pytorch_optim_group.bin")
    with pytest.raises(
        UnsupportedError, match=r"pytorch_optim_group\.bin: torch\.load\(weights_only=True\) refused"
    ):
        convert_checkpoint(bad, tmp_path / "o", source="colossalai")
    with pytest.raises(CheckpointFormatError, match="6 parameter ids but the model gives 3"):
        m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2), torch.nn.ReLU())
        m[1].bias = None  # type: ignore[assignment]
        convert_checkpoint(COLO / "one_group" / "optimizer", tmp_path / "o", source="colossalai", model=m)


def test_colossalai_live_output(tmp_path: Path) -> None:
    """Against Colossal-AI itself: ``.venv/bin/pip install --no-deps colossalai psutil peft accelerate``.

    (``tests/data/colossalai`` can make a bare ``colossalai`` namespace package importable, so the
    skip tests the real modules.)"""
    warnings.simplefilter("ignore")
    try:
        from colossalai.checkpoint_io import GeneralCheckpointIO as ColoIO
        from colossalai.interface import OptimizerWrapper as ColoWrapper
    except Exception as e:  # absent, or not importable beside this torch
        pytest.skip(f"colossalai is not importable ({type(e).__name__}: {e})")

    m, opt = _colo_model_opt(True)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        m(torch.randn(2, 4, generator=g)).sum().backward()
        opt.step()
        opt.zero_grad()
    ColoIO().save_optimizer(ColoWrapper(opt), str(tmp_path / "colo"), shard=True, size_per_shard=1)
    convert_checkpoint(tmp_path / "colo", tmp_path / "u", source="colossalai", model=m, optimizer=opt)
    m2, opt2 = _colo_model_opt(True)
    m2.load_state_dict(m.state_dict())
    GeneralCheckpointIO().load_optimizer(OptimizerWrapper(opt2, m2), tmp_path / "u", verify=True)
    a, b = opt.state_dict(), opt2.state_dict()
    assert a["param_groups"] == b["param_groups"]
    for pid, st in a["state"].items():
        for k, v in st.items():
            assert torch.equal(v, b["state"][pid][k]), (pid, k)


# ---------------------------------------------------------------- HuggingFaceStorageWriter(save_distributed=True)
def _hf_shards(d: Path, full: dict[str, torch.Tensor], cut: int) -> None:
    """Two rank files as torch's HF writer lays them out (rows split at ``cut``); the real
    2-rank output is tested in tests/dist/test_migrate_dist.py."""
    from safetensors.torch import save_file

    d.mkdir()
    for r, rows in enumerate((slice(0, cut), slice(cut, None))):
        part = {k: v[rows].contiguous() for k, v in full.items()}
        info = {k: {"saved_offsets": [rows.start] + [0] * (v.dim() - 1)} for k, v in full.items()}
        save_file(
            part,
            str(d / f"shard-0000{r + 1}-model-00001-of-00001.safetensors"),
            metadata={"format": "pt", "DCP_VERSION": "1.0", "DCP_SHARDING_INFO": json.dumps(info)},
        )


def test_hf_distributed_layout_loads_and_refuses_a_missing_rank(tmp_path: Path) -> None:
    from unickpt.errors import IndexFileError

    m = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 7))
    _hf_shards(tmp_path / "hf", dict(m.state_dict()), 3)
    m2 = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 7))
    GeneralCheckpointIO().load_model(m2, tmp_path / "hf")
    for k, v in m.state_dict().items():
        assert torch.equal(v, m2.state_dict()[k]), k
    convert_checkpoint(tmp_path / "hf", tmp_path / "u", source="dcp")
    m3 = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 7))
    GeneralCheckpointIO().load_model(m3, tmp_path / "u", verify=True)
    for k, v in m.state_dict().items():
        assert torch.equal(v, m3.state_dict()[k]), k
    # rank 1's file gone: the rows it held are missing, refused before anything is copied
    (tmp_path / "hf" / "shard-00001-model-00001-of-00001.safetensors").unlink()
    before = {k: v.clone() for k, v in m2.state_dict().items()}
    with pytest.raises(IndexFileError, match=r"tensor '0\.(weight|bias)'"):
        GeneralCheckpointIO().load_model(m2, tmp_path / "hf")
    assert all(torch.equal(v, m2.state_dict()[k]) for k, v in before.items())


def test_hf_distributed_layout_bad_offsets(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    d = tmp_path / "hf"
    d.mkdir()
    save_file(
        {"w": torch.zeros(2, 3)},
        str(d / "shard-00001-model-00001-of-00001.safetensors"),
        metadata={"DCP_SHARDING_INFO": json.dumps({"w": {"saved_offsets": [0]}})},
    )
    with pytest.raises(
        CheckpointFormatError, match=r"tensor 'w' has no valid saved_offsets.*expected 2 .*found \[0\]"
    ):
        GeneralCheckpointIO().load_model(torch.nn.Linear(3, 2), d)


def test_dcp_metadata_without_planner_data(tmp_path: Path, dcp_run: Any) -> None:
    """Older or hand-made DCP metadata may lack planner_data (the nested paths of each key):
    the keys are then cut with the model's FQNs, and the import is the same."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    src, m, opt, _ = dcp_run
    md = FileSystemReader(str(src)).read_metadata()  # test code: our own file
    md.planner_data = None
    (src / ".metadata").write_bytes(pickle.dumps(md))
    convert_checkpoint(src, tmp_path / "u", source="dcp")
    m2, opt2 = _fresh()
    GeneralCheckpointIO().load_model(m2, tmp_path / "u", verify=True)
    GeneralCheckpointIO().load_optimizer(OptimizerWrapper(opt2, m2), tmp_path / "u", verify=True)
    index = json.loads((tmp_path / "u" / "optimizer.safetensors.index.json").read_text())["unickpt"]
    assert index["layout"]["plugin"] == "dcp"
    _assert_same_training((m, opt), (m2, opt2))
