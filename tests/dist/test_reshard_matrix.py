"""Save under one parallel layout, load under another: bit-exact, for model and optimizer.

Layouts: single process, DDP x2, FSDP2 x2, FSDP2 x4, TP x2, TP x4; both ``gather_dtensor``
values (``True`` as one ``model.safetensors`` file, or as a directory of gathered shard files
for DDP x2, TP x2 and FSDP2 x4; ``False`` as a directory of per-rank slices in small files). Five jobs run in turn on persistent worlds (sizes 1, 2, 4, 2, 1; the
world of 4 does both phases, as it runs after every other save):

1. every layout of a world size trains the tiny ``Net`` two steps (the same batch on every
   rank, so replicated state agrees everywhere), saves model and optimizer both ways, and
   writes the full tensors it saved as the reference. It also runs the training-continuity
   check within its own layout: an uninterrupted run of four steps against two steps, save,
   load into fresh objects (model, optimizer, LR scheduler), two more steps: bit-exact.
2. once every save exists, every layout of every world size loads every checkpoint into a
   freshly initialised model and optimizer (different seed and learning rates) and compares
   the full tensors with the reference bit for bit, then resumes the cross-layout continuity
   pairs (losses close to the saving layout's uninterrupted run).

By hand (after the save phases): ``OMP_NUM_THREADS=1 PYTHONPATH=.:tests/dist
.venv/bin/torchrun --nproc_per_node 2 tests/dist/harness.py test_reshard_matrix:save_phase /tmp/m 2``
then ``... test_reshard_matrix:load_phase /tmp/m 2``.
"""

from __future__ import annotations

import functools
import itertools
import json
from pathlib import Path
from typing import Any

import pytest
from harness import CaseResult, WorldError, WorldPool, run_cases

SAVE_STEPS = 2
CONT_STEPS = 4
# Per job; a hung collective fails its job after this long. The module-wide pytest timeout
# covers every job running into it in turn.
WORLD_TIMEOUT_S = 240.0
pytestmark = pytest.mark.timeout(5 * WORLD_TIMEOUT_S + 60)

# name -> (plugin kind, world size)
LAYOUTS: dict[str, tuple[str, int]] = {
    "single": ("none", 1),
    "ddp2": ("ddp", 2),
    "fsdp2x2": ("fsdp2", 2),
    "tp2": ("tp", 2),
    "fsdp2x4": ("fsdp2", 4),
    "tp4": ("tp", 4),
}
GATHER = (True, False)
# Layouts whose gather_dtensor=True saves are sharded directories (the others: one file).
GATHERED_SHARDED = ("ddp2", "tp2", "fsdp2x4")
# Layouts that also save an SGD (momentum) optimizer, loaded under every layout.
SGD_SAVERS = ("fsdp2x2", "tp4")
# (save layout, resume layout) pairs for training continuity across layouts.
CROSS_PAIRS = [
    ("single", "fsdp2x4"),
    ("fsdp2x4", "tp2"),
    ("tp2", "single"),
    ("ddp2", "tp4"),
    ("tp4", "fsdp2x2"),
    ("fsdp2x2", "ddp2"),
]
WORLD_ORDER = [(1, "save"), (2, "save"), (4, "save_load"), (2, "load"), (1, "load")]

# Cases that fail because of a known bug outside tests/dist, as {case id: reason}; each is
# marked xfail(strict=True) so the fix shows up as an unexpected pass.
KNOWN_BUGS: dict[str, str] = {}


def _layouts_of(ws: int) -> list[str]:
    return [name for name, (_, n) in LAYOUTS.items() if n == ws]


def _ckpt(root: Path, layout: str, gather: bool, what: str) -> Path:
    return root / layout / ("gathered" if gather else "sharded") / what


# -- worker side ------------------------------------------------------------------------------


def _boost(
    layout: str, seed: int, lr_scale: float = 1.0, opt_kind: str = "adamw", **model_kw: Any
) -> tuple[Any, Any, Any, Any, Any]:
    """A fresh model, optimizer and scheduler boosted for ``layout``: (booster, plugin, m, o, s)."""
    import torch
    from conftest import make_model, make_optimizer, make_plugin

    from unickpt.booster import Booster

    plugin = make_plugin(LAYOUTS[layout][0])
    booster = Booster(plugin)
    model = make_model(seed, **model_kw)
    optim = make_optimizer(model, opt_kind)
    for g in optim.param_groups:
        g["lr"] *= lr_scale
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0 / (1 + s))
    m, o, _, _, s = booster.boost(model, optim, lr_scheduler=sched)
    return booster, plugin, m, o, s


def _train(m: Any, o: Any, s: Any, booster: Any, steps: range) -> list[float]:
    """Train on the full global batch on every rank (replicated state stays identical)."""
    from conftest import batch, loss_fn

    losses = []
    for step in steps:
        x, y = batch(step)
        loss = loss_fn(m(x), y)
        booster.backward(loss, o)
        o.step()
        o.zero_grad()
        s.step()
        losses.append(float(loss.detach()))
    return losses


def _save_reference(path: Path, m: Any, o: Any) -> None:
    import torch
    import torch.distributed as dist
    from conftest import full_model_state, full_optim_state

    ref = {"model": full_model_state(m), "optim": full_optim_state(m, o)}
    if dist.get_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(ref, path)
    dist.barrier()


def save_layout(root: Path, layout: str) -> dict[str, Any]:
    booster, _, m, o, s = _boost(layout, seed=0)
    losses = _train(m, o, s, booster, range(SAVE_STEPS))
    for gather in GATHER:
        # Gathered saves: one file for some layouts, several gathered shard files for others.
        shard = not gather or layout in GATHERED_SHARDED
        kw: dict[str, Any] = {"shard": shard, "gather_dtensor": gather}
        if shard:
            kw["size_per_shard"] = 0.004  # about 4 KB: several files per save
        booster.save_model(m, str(_ckpt(root, layout, gather, "model")), **kw)
        booster.save_optimizer(o, str(_ckpt(root, layout, gather, "optim")), **kw)
    _save_reference(root / layout / "ref.pt", m, o)
    if layout in SGD_SAVERS:
        booster, _, m, o, s = _boost(layout, seed=0, opt_kind="sgd")
        _train(m, o, s, booster, range(SAVE_STEPS))
        booster.save_optimizer(o, str(root / layout / "sgd"), shard=True, gather_dtensor=False)
        _save_reference(root / layout / "sgd_ref.pt", m, o)
    return {"losses": losses}


def sgd_case(root: Path, saved: str, layout: str) -> dict[str, Any]:
    """SGD momentum buffers and per-group hyperparameters reshard bit for bit."""
    from conftest import assert_local_state_matches, live_optim_state

    ref = _reference(root / saved / "sgd_ref.pt")["optim"]
    booster, _, m, o, _ = _boost(layout, seed=1, lr_scale=3.0, opt_kind="sgd")
    booster.load_optimizer(o, str(root / saved / "sgd"))
    got = live_optim_state(m, o)
    assert got["state"], "no optimizer state after the load"
    assert all(set(st) == {"momentum_buffer"} for st in got["state"].values()), got["state"].keys()
    assert_local_state_matches(got["state"], ref["state"], "sgd.state")
    assert got["param_groups"] == ref["param_groups"], (got["param_groups"], ref["param_groups"])
    return {}


def continuity_same_layout(root: Path, layout: str) -> dict[str, Any]:
    """Uninterrupted run vs save at step 2 + resume into fresh objects: bit-exact losses."""
    import torch.distributed as dist

    booster, _, m, o, s = _boost(layout, seed=0)
    full = _train(m, o, s, booster, range(CONT_STEPS))
    booster, _, m, o, s = _boost(layout, seed=0)
    first = _train(m, o, s, booster, range(SAVE_STEPS))
    cdir = root / "cont" / layout
    booster.save_model(m, str(cdir / "model"), shard=True, gather_dtensor=False)
    booster.save_optimizer(o, str(cdir / "optim"), shard=True, gather_dtensor=False)
    booster.save_lr_scheduler(s, str(cdir / "sched.json"))
    if dist.get_rank() == 0:
        (cdir / "losses.json").write_text(json.dumps(full))
    dist.barrier()
    booster, _, m, o, s = _boost(layout, seed=7, lr_scale=3.0)
    booster.load_model(m, str(cdir / "model"))
    booster.load_optimizer(o, str(cdir / "optim"))
    booster.load_lr_scheduler(s, str(cdir / "sched.json"))
    rest = _train(m, o, s, booster, range(SAVE_STEPS, CONT_STEPS))
    assert first == full[:SAVE_STEPS], "two identical runs diverged: training is not deterministic"
    assert rest == full[SAVE_STEPS:], f"resumed losses {rest} differ from uninterrupted {full[SAVE_STEPS:]}"
    return {"losses": full}


def continuity_cross(root: Path, saved: str, layout: str) -> dict[str, Any]:
    """Resume ``saved``'s step-2 checkpoint under ``layout``: losses close to the uninterrupted run."""
    cdir = root / "cont" / saved
    full = json.loads((cdir / "losses.json").read_text())
    booster, _, m, o, s = _boost(layout, seed=7, lr_scale=3.0)
    booster.load_model(m, str(cdir / "model"))
    booster.load_optimizer(o, str(cdir / "optim"))
    booster.load_lr_scheduler(s, str(cdir / "sched.json"))
    rest = _train(m, o, s, booster, range(SAVE_STEPS, CONT_STEPS))
    assert rest == pytest.approx(full[SAVE_STEPS:], rel=1e-4, abs=1e-5), (rest, full[SAVE_STEPS:])
    return {"losses": rest}


@functools.cache
def _reference(path: Path) -> dict[str, Any]:
    import torch

    ref: dict[str, Any] = torch.load(path, weights_only=True)
    return ref


def load_case(root: Path, saved: str, gather: bool, layout: str) -> dict[str, str]:
    """Load ``saved``'s checkpoint into ``layout``; compare with the saved tensors bit for bit.

    Each rank checks the blocks it holds against the full reference (no collectives), so a
    failed check cannot leave ranks out of step. Returns ``{"model": error or "", "optim":
    error or ""}``; both parts always run.
    """
    import traceback

    from conftest import assert_local_state_matches, live_model_state, live_optim_state

    ref = _reference(root / saved / "ref.pt")
    booster, _, m, o, _ = _boost(layout, seed=1, lr_scale=3.0)
    out: dict[str, str] = {}
    try:
        with pytest.raises(AssertionError):  # the fresh model must differ, or the check proves nothing
            assert_local_state_matches(live_model_state(m), ref["model"], "fresh")
        report = booster.load_model(m, str(_ckpt(root, saved, gather, "model")))
        assert not report.missing and not report.unexpected, report
        assert_local_state_matches(live_model_state(m), ref["model"], "model")
        inner = m.unwrap()
        assert inner.head.weight is inner.emb.weight, "loading untied the tied weights"
        out["model"] = ""
    except Exception:
        out["model"] = traceback.format_exc()
    try:
        booster.load_optimizer(o, str(_ckpt(root, saved, gather, "optim")))
        got = live_optim_state(m, o)
        assert_local_state_matches(got["state"], ref["optim"]["state"], "optim.state")
        assert got["param_groups"] == ref["optim"]["param_groups"], (
            got["param_groups"],
            ref["optim"]["param_groups"],
        )
        out["optim"] = ""
    except Exception:
        out["optim"] = traceback.format_exc()
    return out


def mismatch_case(root: Path, layout: str) -> dict[str, Any]:
    """A checkpoint that does not fit: the same clear error on every rank, the model untouched;
    ``strict=False`` loads the names that fit and reports the rest."""
    import torch.distributed as dist
    from conftest import assert_local_state_matches, live_model_state

    from unickpt.errors import StateMismatchError

    saved = "fsdp2x2"
    ckpt = str(_ckpt(root, saved, False, "model"))
    booster, _, m, _, _ = _boost(layout, seed=1, vocab=34)
    before = {k: v.clone() for k, v in live_model_state(m).items()}
    with pytest.raises(StateMismatchError) as info:
        booster.load_model(m, ckpt)
    message = str(info.value)
    assert "emb.weight" in message and "34" in message and "33" in message, message
    messages: list[str] = [""] * dist.get_world_size()
    dist.all_gather_object(messages, message)
    assert len(set(messages)) == 1, f"ranks raised different errors: {messages}"
    assert_local_state_matches(live_model_state(m), before, "after a refused load")

    ref = _reference(root / saved / "ref.pt")["model"]
    booster, _, m, _, _ = _boost(layout, seed=1, n_blocks=1)
    with pytest.raises(StateMismatchError):
        booster.load_model(m, ckpt)  # strict by default: blocks.1.* are unexpected
    report = booster.load_model(m, ckpt, strict=False)
    expected_unexpected = sorted(k for k in ref if k.startswith("blocks.1."))
    assert sorted(report.unexpected) == expected_unexpected, report.unexpected
    assert report.missing == []
    live = live_model_state(m)
    assert_local_state_matches(live, {k: ref[k] for k in live}, "strict=False")
    return {"unexpected": len(report.unexpected)}


def save_phase(root: str, world_size: int | str) -> dict[str, CaseResult]:
    ws = int(world_size)
    rootp = Path(root)
    cases: list[tuple[str, Any]] = []
    for layout in _layouts_of(ws):
        cases.append((f"save:{layout}", functools.partial(save_layout, rootp, layout)))
        cases.append((f"cont:{layout}->{layout}", functools.partial(continuity_same_layout, rootp, layout)))
    return run_cases(cases)


def load_phase(root: str, world_size: int | str) -> dict[str, CaseResult]:
    ws = int(world_size)
    rootp = Path(root)
    cases: list[tuple[str, Any]] = []
    for layout in _layouts_of(ws):
        for saved, gather in itertools.product(LAYOUTS, GATHER):
            cases.append(
                (_load_id(saved, gather, layout), functools.partial(load_case, rootp, saved, gather, layout))
            )
    for layout in _layouts_of(ws):
        cases.append((f"mismatch:{layout}", functools.partial(mismatch_case, rootp, layout)))
        for saved in SGD_SAVERS:
            cases.append((f"sgd:{saved}->{layout}", functools.partial(sgd_case, rootp, saved, layout)))
    for saved, layout in CROSS_PAIRS:
        if LAYOUTS[layout][1] == ws:
            cases.append(
                (f"cont:{saved}->{layout}", functools.partial(continuity_cross, rootp, saved, layout))
            )
    return run_cases(cases)


def save_load_phase(root: str, world_size: int | str) -> dict[str, CaseResult]:
    results = save_phase(root, world_size)
    results.update(load_phase(root, world_size))
    return results


def _load_id(saved: str, gather: bool, layout: str) -> str:
    return f"{saved}-{'gather' if gather else 'nogather'}->{layout}"


# -- parent side ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory, world_pool: WorldPool) -> dict[str, Any]:
    """Run the phases once; map case id -> CaseResult (or the WorldError of its world)."""
    root = tmp_path_factory.mktemp("reshard")
    results: dict[str, Any] = {"root": root}
    for ws, phase in WORLD_ORDER:
        target = f"test_reshard_matrix:{phase}_phase"
        try:
            results.update(world_pool.run(ws, target, str(root), ws, timeout=WORLD_TIMEOUT_S)[0])
        except WorldError as e:
            results[f"world:{ws}:{phase}"] = e
    return results


def _get(matrix: dict[str, Any], case: str, ws: int) -> CaseResult:
    if case not in matrix:
        for key, err in matrix.items():
            if key.startswith(f"world:{ws}:"):
                raise err
        pytest.fail(f"case {case} did not run")
    res: CaseResult = matrix[case]
    return res


def _params(ids: list[str]) -> list[Any]:
    return [
        pytest.param(i, marks=pytest.mark.xfail(strict=True, reason=KNOWN_BUGS[i])) if i in KNOWN_BUGS else i
        for i in ids
    ]


SAVE_IDS = [f"save:{layout}" for layout in LAYOUTS]
LOAD_IDS = [_load_id(s, g, t) for t in LAYOUTS for s in LAYOUTS for g in GATHER]
CONT_IDS = [f"cont:{layout}->{layout}" for layout in LAYOUTS] + [f"cont:{a}->{b}" for a, b in CROSS_PAIRS]


@pytest.mark.parametrize("case", _params(SAVE_IDS))
def test_save(matrix: dict[str, Any], case: str) -> None:
    layout = case.split(":")[1]
    res = _get(matrix, case, LAYOUTS[layout][1])
    if not res.ok:
        pytest.fail(res.error, pytrace=False)
    assert len(res.value["losses"]) == SAVE_STEPS


def _load_result(matrix: dict[str, Any], case: str, part: str) -> None:
    layout = case.split("->")[1]
    res = _get(matrix, case, LAYOUTS[layout][1])
    if not res.ok:
        pytest.fail(res.error, pytrace=False)
    if res.value[part]:
        pytest.fail(f"{part} under {case}:\n{res.value[part]}", pytrace=False)


@pytest.mark.parametrize("case", _params([f"model:{i}" for i in LOAD_IDS]))
def test_model_roundtrip_bit_exact(matrix: dict[str, Any], case: str) -> None:
    _load_result(matrix, case.split(":", 1)[1], "model")


@pytest.mark.parametrize("case", _params([f"optim:{i}" for i in LOAD_IDS]))
def test_optimizer_roundtrip_bit_exact(matrix: dict[str, Any], case: str) -> None:
    _load_result(matrix, case.split(":", 1)[1], "optim")


@pytest.mark.parametrize(
    "case", _params([f"sgd:{saved}->{layout}" for layout in LAYOUTS for saved in SGD_SAVERS])
)
def test_sgd_momentum_roundtrip_bit_exact(matrix: dict[str, Any], case: str) -> None:
    res = _get(matrix, case, LAYOUTS[case.split("->")[1]][1])
    if not res.ok:
        pytest.fail(res.error, pytrace=False)


@pytest.mark.parametrize("case", _params([f"mismatch:{layout}" for layout in LAYOUTS]))
def test_mismatch_refused_on_every_rank(matrix: dict[str, Any], case: str) -> None:
    res = _get(matrix, case, LAYOUTS[case.split(":")[1]][1])
    if not res.ok:
        pytest.fail(res.error, pytrace=False)


@pytest.mark.parametrize("case", _params(CONT_IDS))
def test_training_continuity(matrix: dict[str, Any], case: str) -> None:
    layout = case.split("->")[1]
    res = _get(matrix, case, LAYOUTS[layout][1])
    if not res.ok:
        pytest.fail(res.error, pytrace=False)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fingerprints_agree_gathered_and_sliced(matrix: dict[str, Any], layout: str) -> None:
    """The same state saved gathered and as per-rank slices (DDP replicas written once, FSDP2
    row shards, TP column and row splits, several small files) has equal fingerprints, summed
    from every rank's partials: ``diff`` from the index files alone says identical."""
    from unickpt import diff_checkpoints

    res = _get(matrix, f"save:{layout}", LAYOUTS[layout][1])
    if not res.ok:
        pytest.fail(res.error, pytrace=False)
    root = matrix["root"]
    for what, kind in (("model", "model"), ("optim", "optimizer")):
        rep = diff_checkpoints(_ckpt(root, layout, True, what), _ckpt(root, layout, False, what), kind=kind)
        assert rep.identical and rep.same, rep.format()
