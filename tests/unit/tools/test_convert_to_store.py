"""Every ``convert`` target written onto an object store (moto's S3 server) through the one Sink:
the same names and contents as the same conversion into a local directory, read back by the
peer's reader, nothing left by a failure part way, a used prefix refused."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from unickpt import CheckpointManager, GeneralCheckpointIO, OptimizerWrapper
from unickpt.ckpt.reader import open_checkpoint
from unickpt.errors import OutputExistsError
from unickpt.tools._torch import full_tensors
from unickpt.tools.convert import convert_checkpoint

DATA = Path(__file__).resolve().parents[2] / "data"
COLO = DATA / "colossalai" / "one_group" / "optimizer"
DS = DATA / "deepspeed" / "zero2_ws2" / "ckpt"


def _tree(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _strip_ids(v: Any) -> Any:
    """A JSON value without its save ids (random per save: the one difference of two writes)."""
    if isinstance(v, dict):
        return {k: _strip_ids(x) for k, x in v.items() if k not in ("save_id", "unickpt_save")}
    if isinstance(v, list):
        return [_strip_ids(x) for x in v]
    return v


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (
            type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
        )
    return bool(a == b)


def _same_file(name: str, a: bytes, b: bytes) -> None:
    """``a`` (the store's object) holds what ``b`` (the local file) holds: the same bytes where the
    format is deterministic; a save's own id aside for unickpt's files; torch.save archives loaded."""
    if a == b:
        return
    if name.endswith(".pt") or name.endswith(".bin"):
        assert _equal(
            torch.load(io.BytesIO(a), weights_only=True), torch.load(io.BytesIO(b), weights_only=True)
        ), name
    elif name.endswith(".safetensors"):
        from safetensors.torch import load

        ta, tb = load(a), load(b)
        assert _equal(dict(sorted(ta.items())), dict(sorted(tb.items()))), name
        n = int.from_bytes(a[:8], "little")
        ha = json.loads(a[8 : 8 + n])["__metadata__"]
        hb = json.loads(b[8 : 8 + int.from_bytes(b[:8], "little")])["__metadata__"]
        meta = {
            k: _strip_ids(json.loads(v)) if k == "unickpt" else v
            for k, v in ha.items()
            if k != "unickpt_save"
        }
        assert meta == {
            k: _strip_ids(json.loads(v)) if k == "unickpt" else v
            for k, v in hb.items()
            if k != "unickpt_save"
        }, name
    elif name.endswith(".json"):
        assert _strip_ids(json.loads(a)) == _strip_ids(json.loads(b)), name
    else:
        raise AssertionError(f"{name}: {len(a)} bytes on the store, {len(b)} locally, different")


def _same_as_local(s3: Any, url: str, local: Path) -> dict[str, bytes]:
    got = s3.objects(url)
    ref = _tree(local)
    assert sorted(got) == sorted(ref)
    for name in ref:
        _same_file(name, got[name], ref[name])
    assert s3.open_uploads(s3.bucket) == []
    return got


def _download(objects: dict[str, bytes], d: Path) -> Path:
    for name, data in objects.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(data)
    return d


def test_dcp_to_run_on_a_store_is_the_local_run_and_the_manager_resumes(
    s3, tmp_path, dcp_run: Any, fresh_training: Any
) -> None:
    src, m, opt = dcp_run.src, dcp_run.model, dcp_run.optimizer
    convert_checkpoint(src, tmp_path / "run", source="dcp", target="run")
    url = f"s3://{s3.bucket}/run"
    assert convert_checkpoint(src, url, source="dcp", target="run") == url
    got = _same_as_local(s3, url, tmp_path / "run")
    assert got["latest"] == b'{"step": 3}' and "step-3/COMMIT" in got
    assert "step-3/model/model.safetensors.index.json" in got
    assert "step-3/optimizer/optimizer.safetensors.index.json" in got
    mgr = CheckpointManager(url)
    assert mgr.all_steps() == [3]
    m2, opt2 = fresh_training
    assert mgr.load(m2, OptimizerWrapper(opt2, m2)) == 3
    for pid, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            assert torch.equal(opt2.state_dict()["state"][pid][k], v), (pid, k)
    for k, v in m.state_dict().items():
        assert torch.equal(m2.state_dict()[k], v), k
    with pytest.raises(OutputExistsError, match=f"{url} already holds"):
        convert_checkpoint(src, url, source="dcp", target="run")


@pytest.mark.parametrize("target", ["unickpt", "run"])
def test_deepspeed_import_onto_a_store(s3, tmp_path, target: str) -> None:
    local = tmp_path / "out"
    convert_checkpoint(DS, local, source="deepspeed", target=target)
    url = f"s3://{s3.bucket}/ds-{target}"
    assert convert_checkpoint(DS, url, source="deepspeed", target=target) == url
    _same_as_local(s3, url, local)
    where = url if target == "unickpt" else f"{url}/step-3"
    with open_checkpoint(f"{where}/model" if target == "run" else where, "model") as r:
        ours = full_tensors(r)
    with open_checkpoint(str(local / "step-3" / "model") if target == "run" else str(local), "model") as r:
        assert _equal(dict(sorted(ours.items())), dict(sorted(full_tensors(r).items())))


def test_colossalai_import_onto_a_store(s3, tmp_path) -> None:
    convert_checkpoint(COLO, tmp_path / "opt", source="colossalai")
    url = f"s3://{s3.bucket}/colo"
    convert_checkpoint(COLO, url, source="colossalai")
    _same_as_local(s3, url, tmp_path / "opt")


def _unickpt_run(tmp_path: Path) -> Path:
    torch.manual_seed(1)
    m = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.LayerNorm(6), torch.nn.Linear(6, 2))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    for _ in range(2):
        m(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    root = tmp_path / "ck"
    ckio = GeneralCheckpointIO()
    ckio.save_model(m, str(root / "model"), shard=True, size_per_shard=0.0001)
    ckio.save_optimizer(OptimizerWrapper(opt, m), str(root / "optimizer"), shard=True)
    ckio.save_lr_scheduler(sched, str(root / "lr_scheduler.json"))
    return root


@pytest.mark.parametrize("target", ["deepspeed", "colossalai"])
def test_export_onto_a_store_is_the_local_export_and_reads_back(s3, tmp_path, target: str) -> None:
    ck = _unickpt_run(tmp_path)
    kw: dict[str, Any] = {"source": "unickpt", "target": target, "max_shard_size": 300}
    convert_checkpoint(ck, tmp_path / "local", **kw)
    url = f"s3://{s3.bucket}/{target}"
    assert convert_checkpoint(ck, url, **kw) == url
    got = _same_as_local(s3, url, tmp_path / "local")
    assert got == _tree(tmp_path / "local")  # no save id in these formats: the very same bytes
    back = _download(got, tmp_path / "down")
    if target == "deepspeed":  # DeepSpeed's layout read back by the importer: every tensor bit-exact
        assert got["latest_universal"] == b"global_step2_universal"
        convert_checkpoint(back, tmp_path / "back", source="deepspeed")
        with (
            open_checkpoint(str(tmp_path / "back"), "model") as r,
            open_checkpoint(str(ck / "model"), "model") as o,
        ):
            assert _equal(dict(sorted(full_tensors(r).items())), dict(sorted(full_tensors(o).items())))
    else:  # Colossal-AI's model directory is a Hugging Face checkpoint; its optimizer index names every shard
        with (
            open_checkpoint(str(back / "model"), "model") as r,
            open_checkpoint(str(ck / "model"), "model") as o,
        ):
            assert _equal(dict(sorted(full_tensors(r).items())), dict(sorted(full_tensors(o).items())))
        index = json.loads(got["optimizer/optimizer.safetensors.index.json"])
        assert set(index["weight_map"].values()) <= set(n.split("/")[-1] for n in got)
        assert isinstance(torch.load(back / "lr_scheduler.pt", weights_only=True), dict)
    with pytest.raises(OutputExistsError, match=f"{url} already holds"):
        convert_checkpoint(ck, url, **kw)


def _fail_on(monkeypatch: pytest.MonkeyPatch, module: Any, name: str, after: int) -> None:
    real = getattr(module, name)
    calls = []

    def failing(*a: Any, **k: Any) -> Any:
        calls.append(1)
        if len(calls) > after:
            raise OSError(f"injected failure of {name}")
        return real(*a, **k)

    monkeypatch.setattr(module, name, failing)


@pytest.mark.parametrize("target", ["run", "deepspeed", "colossalai"])
def test_a_failure_part_way_leaves_nothing_on_the_store(
    s3, tmp_path, monkeypatch, request: pytest.FixtureRequest, target: str
) -> None:
    import unickpt.ckpt.run_layout as run_layout
    import unickpt.tools.export_colossalai as colo
    import unickpt.tools.export_deepspeed as ds

    url = f"s3://{s3.bucket}/failed-{target}"
    if target == "run":  # model and optimizer uploaded, then the step's COMMIT record fails
        src = request.getfixturevalue("dcp_run").src
        _fail_on(monkeypatch, run_layout, "commit_record", 0)
        args: tuple[Any, ...] = (src, url)
        kw: dict[str, Any] = {"source": "dcp", "target": "run"}
    else:
        args, kw = (
            (_unickpt_run(tmp_path), url),
            {"source": "unickpt", "target": target, "max_shard_size": 300},
        )
        if target == "deepspeed":  # the fourth .pt file fails as it is streamed
            _fail_on(monkeypatch, ds.torch, "save", 3)
        else:  # model/ and optimizer/ written, then the scheduler's file fails
            _fail_on(monkeypatch, colo, "_pickled", 1)
    s3.reset()
    with pytest.raises(OSError, match="injected failure"):
        convert_checkpoint(*args, **kw)
    assert s3.received("PUT") > 0  # something was uploaded before the failure
    assert s3.objects(url) == {}
    assert s3.open_uploads(s3.bucket) == []


def _upload(s3: Any, local: Path, prefix: str) -> str:
    import boto3

    client = boto3.client("s3", endpoint_url=s3.endpoint)
    for f in sorted(local.rglob("*")):
        if f.is_file():
            client.put_object(
                Bucket=s3.bucket, Key=f"{prefix}/{f.relative_to(local).as_posix()}", Body=f.read_bytes()
            )
    return f"s3://{s3.bucket}/{prefix}"


@pytest.mark.parametrize(
    "case", ["zero1_ws2", "zero3_ws2", "bf16_zero1_ws2", "ucp_zero2_ws2/ckpt/global_step3_universal"]
)
def test_deepspeed_import_from_a_store_is_the_local_import(s3, tmp_path, case: str) -> None:
    """A DeepSpeed checkpoint read in place on a store (its ``latest`` tag, rank files and, for a
    universal checkpoint, its per-parameter files; every pickle through the same allowlist)
    converts to exactly the checkpoint its local copy converts to: every tensor bit-exact."""
    src = DATA / "deepspeed" / case if "/" in case else DATA / "deepspeed" / case / "ckpt"
    url = _upload(s3, src, f"in-{case.split('/')[0]}")
    local = tmp_path / "local"
    convert_checkpoint(src, local, source="deepspeed")
    out = tmp_path / "from-url"
    convert_checkpoint(url, out, source="deepspeed")
    for kind in ("model", "optimizer"):
        with open_checkpoint(str(out), kind) as a, open_checkpoint(str(local), kind) as b:
            ta, tb = full_tensors(a), full_tensors(b)
            assert _equal(dict(sorted(ta.items())), dict(sorted(tb.items()))), kind
    assert (out / "lr_scheduler.json").exists() == (local / "lr_scheduler.json").exists()
    # A tag that names no directory of the store is refused naming it.
    import boto3

    if "/" not in case:
        boto3.client("s3", endpoint_url=s3.endpoint).put_object(
            Bucket=s3.bucket, Key=f"in-{case}/latest", Body=b"global_step99"
        )
        from unickpt.errors import IncompleteCheckpointError

        with pytest.raises(IncompleteCheckpointError, match=r"the tag 'global_step99' names no directory"):
            convert_checkpoint(url, tmp_path / "none", source="deepspeed")


@pytest.mark.parametrize("model_given", [False, True], ids=["model-beside", "model-url"])
def test_colossalai_import_from_a_store_is_the_local_import(s3, tmp_path, model_given: bool) -> None:
    """A Colossal-AI optimizer checkpoint and its model, read in place on a store (the optimizer
    index, its pickled shards through the allowlist, the model's tensor shapes from its index and
    files; the model found beside the optimizer or given as a URL): exactly what its local copy
    converts to, every tensor bit-exact."""
    src = DATA / "colossalai" / "one_group"
    url = _upload(s3, src, f"colo-in-{model_given}")
    local = tmp_path / "local"
    convert_checkpoint(src / "optimizer", local, source="colossalai")
    out = tmp_path / "from-url"
    model = f"{url}/model" if model_given else None
    convert_checkpoint(f"{url}/optimizer", out, source="colossalai", model=model)
    with open_checkpoint(str(out), "optimizer") as a, open_checkpoint(str(local), "optimizer") as b:
        ta, tb = full_tensors(a), full_tensors(b)
        assert ta and _equal(dict(sorted(ta.items())), dict(sorted(tb.items())))


def test_dcp_layouts_on_a_store_convert_and_load_in_place(s3, tmp_path, dcp_run: Any) -> None:
    """A torchtitan folder of ``step-<N>/`` DCP directories and the per-rank files of
    ``HuggingFaceStorageWriter(save_distributed=True)``, read in place on a store: each converts
    to exactly what its local copy converts to, and the per-rank files load from the URL, their
    headers read through the store (no local copy)."""
    from safetensors.torch import save_file

    folder = tmp_path / "titan"
    folder.mkdir()
    (folder / "step-1").mkdir()  # an older step without .metadata: passed over
    dcp_run.src.rename(folder / "step-3")
    hf = tmp_path / "hf"
    hf.mkdir()
    full = {k: v.detach() for k, v in dcp_run.model.state_dict().items()}
    for r, rows in enumerate((slice(0, 2), slice(2, None))):
        info = {k: {"saved_offsets": [rows.start] + [0] * (v.dim() - 1)} for k, v in full.items()}
        save_file(
            {k: v[rows].contiguous() for k, v in full.items()},
            str(hf / f"shard-0000{r + 1}-model-00001-of-00001.safetensors"),
            metadata={"format": "pt", "DCP_VERSION": "1.0", "DCP_SHARDING_INFO": json.dumps(info)},
        )
    for name, src in (("titan", folder), ("hf", hf)):
        url = _upload(s3, src, f"in-{name}")
        convert_checkpoint(src, tmp_path / f"{name}-local", source="dcp")
        convert_checkpoint(url, tmp_path / f"{name}-url", source="dcp")
        with (
            open_checkpoint(str(tmp_path / f"{name}-url"), "model") as a,
            open_checkpoint(str(tmp_path / f"{name}-local"), "model") as b,
        ):
            ta, tb = full_tensors(a), full_tensors(b)
            assert sorted(ta) == sorted(tb) and _equal(ta, tb), name
    m = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 3))
    GeneralCheckpointIO(storage_options=s3.storage_options()).load_model(m, f"s3://{s3.bucket}/in-hf")
    for k, v in full.items():
        assert torch.equal(m.state_dict()[k], v), k
