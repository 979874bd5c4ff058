"""Every number of the JSON state unickpt writes comes back as it was saved, or the save is refused.

inf, -inf and nan are written as Python's ``json`` writes them (``Infinity``, ``-Infinity``,
``NaN``: what Hugging Face's ``trainer_state.json`` holds, what ``json.load`` reads), never as
``null``; ``-0.0`` keeps its sign, ints past 2**53 their digits, ``1`` and ``1.0`` their types.
An int too long for any JSON reader is refused when saving, naming the file and the field.
Through every file that holds such state: ``lr_scheduler.json`` (``save_lr_scheduler`` and a
``CheckpointManager`` step), an optimizer's ``param_groups`` and ``param_state`` (a single file's
header and a sharded checkpoint's index) and the index's free-form ``metadata``.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from _reliability import INDEX, MLP

from unickpt import CheckpointManager, GeneralCheckpointIO, UnsupportedError
from unickpt.errors import IndexFileError
from unickpt.spec.index import IndexFile, index_to_json, parse_index
from unickpt.wrappers import OptimizerWrapper

# The values a state may hold that a lossy JSON writer changes: each with its exact type.
ODD: dict[str, Any] = {
    "inf": math.inf,
    "neg_inf": -math.inf,
    "nan": math.nan,
    "neg_zero": -0.0,
    "big_int": 2**60 + 1,  # past 2**53: a float would round it
    "huge_int": -(10**300) - 7,
    "one_float": 1.0,
    "one_int": 1,
    "tiny": 5e-324,
    "list": [math.inf, -0.0, 2**70, 3],
}


def same(a: Any, b: Any) -> bool:
    """Equal values of equal types; floats by their bits (nan equals nan, -0.0 is not 0.0)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b) or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
    return bool(a == b)


def test_same_tells_the_values_apart() -> None:
    assert not same(0.0, -0.0) and not same(1, 1.0) and not same(math.nan, None) and not same(2**60, 2.0**60)
    assert same(math.nan, math.nan) and same(ODD, json.loads(json.dumps(ODD)))


def _plateau(mode: str = "min") -> torch.optim.lr_scheduler.ReduceLROnPlateau:
    opt = torch.optim.SGD(MLP().parameters(), lr=0.1)
    return torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode=mode, patience=3)  # type: ignore[arg-type]


def test_reduce_lr_on_plateau_round_trips_through_save_lr_scheduler(tmp_path: Path) -> None:
    sched = _plateau()
    sd = sched.state_dict()
    assert sd["best"] == math.inf and sd["mode_worse"] == math.inf  # what made the file lossy
    io = GeneralCheckpointIO()
    path = io.save_lr_scheduler(sched, tmp_path / "ck")
    text = Path(path).read_text()
    assert '"best": Infinity' in text and "null" not in text
    assert json.loads(text)["state"]["best"] == math.inf  # as transformers and any json.load reads it
    fresh = _plateau(mode="max")  # best=-inf, mode_worse=-inf: every value differs
    io.load_lr_scheduler(fresh, tmp_path / "ck")
    assert same(fresh.state_dict(), sd)
    # After steps with metrics (best finite, num_bad_epochs counted), a second round trip.
    for metric in (3.0, 2.5, 2.6):
        sched.step(metric)
    sd = sched.state_dict()
    io.save_lr_scheduler(sched, tmp_path / "ck")
    fresh = _plateau(mode="max")
    io.load_lr_scheduler(fresh, tmp_path / "ck")
    assert same(fresh.state_dict(), sd) and fresh.state_dict()["best"] == 2.5


def test_every_odd_number_round_trips_through_an_lr_scheduler_file(tmp_path: Path) -> None:
    sched = _plateau()
    sched.extra = dict(ODD)  # type: ignore[attr-defined]  # state_dict() holds every attribute
    io = GeneralCheckpointIO()
    io.save_lr_scheduler(sched, tmp_path / "sched.json")
    fresh = _plateau(mode="max")
    io.load_lr_scheduler(fresh, tmp_path / "sched.json")
    assert same(fresh.extra, ODD)  # type: ignore[attr-defined]


def test_reduce_lr_on_plateau_resumes_through_the_manager(tmp_path: Path) -> None:
    m = MLP(seed=1)
    opt = OptimizerWrapper(torch.optim.SGD(m.parameters(), lr=0.1), m)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt.optim, patience=2)
    sched.step(4.0)
    sd = sched.state_dict()
    sd_infinite = _plateau().state_dict()
    mgr = CheckpointManager(tmp_path, save_steps=1)
    assert mgr.save(1, m, opt, sched)
    m2 = MLP(seed=2)
    opt2 = OptimizerWrapper(torch.optim.SGD(m2.parameters(), lr=0.1), m2)
    fresh = torch.optim.lr_scheduler.ReduceLROnPlateau(opt2.optim, mode="max", patience=2)
    assert CheckpointManager(tmp_path).load(m2, opt2, fresh) == 1
    assert same(fresh.state_dict(), sd) and fresh.state_dict()["mode_worse"] == math.inf
    # A scheduler that never stepped: best is inf as well.
    assert mgr.save(2, m, opt, _plateau())
    fresh = torch.optim.lr_scheduler.ReduceLROnPlateau(opt2.optim, mode="max")
    assert CheckpointManager(tmp_path).load(m2, opt2, fresh) == 2
    assert same(fresh.state_dict(), sd_infinite)


def _optimizer(lr: float, odd: dict[str, Any]) -> tuple[MLP, OptimizerWrapper]:
    m = MLP(seed=3)
    opt = torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9)
    opt.param_groups[0].update(odd)
    m(torch.ones(2, 4)).sum().backward()
    opt.step()
    return m, OptimizerWrapper(opt, m)


@pytest.mark.parametrize("shard", [False, True], ids=["single-file", "sharded"])
def test_param_groups_and_param_state_keep_every_number(tmp_path: Path, shard: bool) -> None:
    m, opt = _optimizer(0.1, ODD)
    p = m.a.weight
    opt.optim.state[p].update(best=math.inf, worst=-math.inf, unset=math.nan, zero=-0.0, count=2**61 + 3)
    io = GeneralCheckpointIO()
    io.save_optimizer(opt, tmp_path / "opt", shard=shard)
    if shard:  # the index, as transformers reads it (json.load): the literals, never null
        obj = json.loads((tmp_path / "opt" / "optimizer.safetensors.index.json").read_text())
        group = obj["unickpt"]["param_groups"][0]
        assert same({k: group[k] for k in ODD}, ODD)
        assert same(obj["unickpt"]["param_state"]["a.weight"]["best"], math.inf)
    # The live optimizer has the same keys (as the code that built it sets them) with other values.
    live_odd = {k: v for k, v in ODD.items() if not isinstance(v, float) or not math.isfinite(v)}
    other = {
        k: (0 if type(v) is int else 0.5 if type(v) is float else [0.0, 0.0, 0, 0]) for k, v in ODD.items()
    }
    m2, opt2 = _optimizer(0.7, {**other, **live_odd})
    # Scalar state fills the slots the live optimizer has (as its own code makes them).
    opt2.optim.state[m2.a.weight].update(best=0.0, worst=0.0, unset=0.0, zero=0.0, count=0)
    io.load_optimizer(opt2, tmp_path / "opt")
    group = opt2.optim.param_groups[0]
    assert same({k: group[k] for k in ODD}, ODD)
    assert group["lr"] == 0.1
    st = opt2.optim.state[m2.a.weight]
    assert same(
        {k: st[k] for k in ("best", "worst", "unset", "zero", "count")},
        {"best": math.inf, "worst": -math.inf, "unset": math.nan, "zero": -0.0, "count": 2**61 + 3},
    )
    assert same(st["momentum_buffer"], opt.optim.state[p]["momentum_buffer"])


def test_index_metadata_keeps_every_number(tmp_path: Path) -> None:
    index = IndexFile.model_validate(
        {"metadata": {"total_size": 4, **ODD}, "weight_map": {"w": "m.safetensors"}}
    )
    raw = index_to_json(index)
    assert b"Infinity" in raw and b"null" not in raw
    back = parse_index(raw, str(tmp_path / INDEX))
    assert same({k: getattr(back.metadata, k) for k in ODD}, ODD)


def test_an_int_too_long_for_json_is_refused_at_save_naming_the_field(tmp_path: Path) -> None:
    io = GeneralCheckpointIO()
    sched = _plateau()
    sched.seed = 10**4300  # type: ignore[attr-defined]  # 4301 digits
    with pytest.raises(UnsupportedError) as e:
        io.save_lr_scheduler(sched, tmp_path / "ck")
    assert "lr_scheduler.json: state.seed: an integer of 14285 bits has more than 4300 decimal digits" in str(
        e.value
    )
    assert not (tmp_path / "ck" / "lr_scheduler.json").exists()
    sched.seed = 10**4300 - 1  # type: ignore[attr-defined]  # 4300 digits: kept
    io.save_lr_scheduler(sched, tmp_path / "ck")
    fresh = _plateau()
    io.load_lr_scheduler(fresh, tmp_path / "ck")
    assert fresh.seed == 10**4300 - 1  # type: ignore[attr-defined]

    _, opt = _optimizer(0.1, {"seed": -(10**4400)})
    with pytest.raises(UnsupportedError, match=r"param_groups\[0\]\['seed'\]: an integer of 14617 bits"):
        io.save_optimizer(opt, tmp_path / "opt", shard=True)
    assert not (tmp_path / "opt").exists()


def test_a_number_literal_too_long_is_refused_when_reading(tmp_path: Path) -> None:
    """A hand-made file with a 5,000-digit number: refused by the parser, naming the file."""
    path = tmp_path / "lr_scheduler.json"
    path.write_text('{"unickpt_lr_scheduler": 1, "state": {"best": ' + "9" * 5000 + "}}")
    with pytest.raises(IndexFileError, match=r"lr_scheduler\.json: LR scheduler state is not valid JSON"):
        GeneralCheckpointIO().load_lr_scheduler(_plateau(), path)
