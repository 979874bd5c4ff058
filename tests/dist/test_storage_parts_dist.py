"""Gathered saves to ``s3://`` (moto's server) in which every rank uploads parts of the same
multipart uploads (io/parts_save.py), in one 4-rank world running several cases:

- FSDP2 (row slices, a sharded save of two files) and TP (column slices, a single file whose
  header part rank 0 uploads last): the objects are byte-identical to a local gathered save of
  the same model (save ids aside), read bit-exact by safetensors (what transformers reads),
  verify clean; each rank uploaded about its share of the bytes;
- a failure on one rank between rounds of uploads, on rank 0 creating the uploads and at the
  commit: every rank raises, nothing is committed, no multipart upload is left open, the
  previous checkpoint loads unchanged;
- the rank-0 funnel (stores without shared uploads; forced here on S3): each fault stage it
  reaches fails on each rank that reaches it, with the same guarantees.

``make test`` runs the quick cases (a 7.3 MiB model: one file of two parts, one failure); the
36 MiB cases and the funnel's stages are ``slow``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 420.0
pytestmark = pytest.mark.timeout(TIMEOUT_S + 60)
MiB = 1 << 20


def _net(quick: bool = False) -> torch.nn.Module:
    """About 36 MiB of fp32 in three layers (odd sizes: uneven slices): 8 parts of 5 MiB.
    ``quick``: about 7.3 MiB, two parts whose owners receive bytes of every other rank."""
    g = torch.Generator().manual_seed(5)
    net = (
        torch.nn.Sequential(torch.nn.Linear(1000, 1500), torch.nn.Linear(1500, 281), torch.nn.Linear(281, 3))
        if quick
        else torch.nn.Sequential(
            torch.nn.Linear(1280, 2048), torch.nn.Linear(2048, 2048), torch.nn.Linear(2048, 1283)
        )
    )
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return net


def _small() -> torch.nn.Module:
    g = torch.Generator().manual_seed(6)
    net = torch.nn.Sequential(torch.nn.Linear(33, 18), torch.nn.Linear(18, 7))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return net


def _options(endpoint_opts: dict[str, Any], client: str) -> dict[str, Any]:
    return {**endpoint_opts, "config_kwargs": {"user_agent_extra": f"unickpt-client/{client}"}}


def _fs(opts: dict[str, Any]) -> Any:
    fs = fsspec.filesystem("s3", **_options(opts, "check"))
    fs.invalidate_cache()
    return fs


def _boost(kind: str, net: torch.nn.Module, opts: dict[str, Any]) -> tuple[Any, Any]:
    import unickpt
    from unickpt.plugins import FSDP2Plugin, TPPlugin

    if kind == "fsdp2":
        plugin: Any = FSDP2Plugin()
    else:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        plugin = TPPlugin({"0": ColwiseParallel(), "1": RowwiseParallel(), "2": RowwiseParallel()})
    booster = unickpt.Booster(plugin, storage_options=opts)
    model, *_ = booster.boost(net, torch.optim.SGD(net.parameters(), lr=0.1))
    return booster, model


def _state_of(directory: Path) -> tuple[dict[str, torch.Tensor], str]:
    """Every tensor of a downloaded checkpoint read by safetensors (as transformers reads it) and its save id."""
    from safetensors.torch import load_file

    from unickpt.ckpt.reader import open_checkpoint

    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(f)))
    with open_checkpoint(directory, "model") as r:
        assert r.verify() == []
        sid = r.block.save_id
    assert sid
    return out, sid


def _download(opts: dict[str, Any], prefix: str, dest: Path) -> Path:
    _fs(opts).get(prefix.rstrip("/") + "/", str(dest) + "/", recursive=True)
    return dest


def _open_uploads(opts: dict[str, Any], bucket: str) -> list[Any]:
    return list(_fs(opts).call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", []) or [])


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(torch.uint8).numpy().tobytes()


def _header_without_ranges(raw: bytes) -> tuple[Any, bytes]:
    """A single file as (its header without the tensors' range hashes, its data bytes)."""
    import json

    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    meta = header.get("__metadata__", {})
    block = json.loads(meta["unickpt"])
    for t in block["tensors"].values():
        t.pop("ranges", None)
        for sl in t.get("slices", []):
            sl.pop("ranges", None)
    meta["unickpt"] = block
    offsets = {
        k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"
    }
    return (meta, offsets), raw[8 + n :]


def _same_case(
    kind: str, shard: bool, bucket: str, endpoint: dict[str, Any], root: str, quick: bool = False
) -> dict[str, Any]:
    """Save the same model gathered locally and to S3; compare on rank 0."""
    import torch.distributed as dist
    from conftest import full_model_state

    rank = dist.get_rank()
    booster, model = _boost(kind.split("-")[0], _net(quick), _options(endpoint, f"{kind}-rank-{rank}"))
    full = full_model_state(model)
    local = Path(root) / f"local-{kind}"
    target = "" if shard else "/model.safetensors"
    booster.save_model(model, f"{local}{target}", shard=shard, gather_dtensor=True, size_per_shard=20)
    booster.save_model(
        model, f"s3://{bucket}/{kind}{target}", shard=shard, gather_dtensor=True, size_per_shard=20
    )
    out: dict[str, Any] = {}
    if rank == 0:
        dl = _download(endpoint, f"{bucket}/{kind}", Path(root) / f"dl-{kind}")
        names = sorted(p.name for p in dl.iterdir())
        assert names == sorted(p.name for p in local.iterdir()), names
        got, sid = _state_of(dl)
        _, sid_local = _state_of(local)
        for n in names:
            a = (local / n).read_bytes().replace(sid_local.encode(), b"0" * len(sid))
            b = (dl / n).read_bytes().replace(sid.encode(), b"0" * len(sid))
            if n == "model.safetensors" and not shard:
                # A single file's header holds the range hashes: the local save moves column
                # slices to rows (one range per rank), the S3 save keeps one range per row.
                a, b = _header_without_ranges(a), _header_without_ranges(b)
            assert a == b, f"{n} differs from the local gathered save's"
        assert got.keys() == full.keys()
        for k, v in full.items():
            assert _bits(got[k]) == _bits(v), k  # safetensors, as transformers reads the files
        assert _open_uploads(endpoint, bucket) == []
        out = {"files": names, "bytes": sum((dl / n).stat().st_size for n in names)}
    dist.barrier()
    # unickpt's load on every rank (a plain module: replicated), every hash checked
    from unickpt.io import GeneralCheckpointIO

    fresh = _net(quick)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    dl = Path(root) / f"dl-{kind}"
    GeneralCheckpointIO().load_model(fresh, dl if shard else dl / "model.safetensors", verify=True)
    for k, v in full.items():
        assert _bits(fresh.state_dict()[k]) == _bits(v), k
    return out


def _failure_case(bucket: str, endpoint: dict[str, Any], root: str, quick: bool = False) -> dict[str, Any]:
    """Failures over the committed FSDP2 checkpoint and in a fresh directory: nothing changes.
    ``quick``: over the quick FSDP2 checkpoint, one failure on rank 1 between the exchange and
    the agreement."""
    import torch.distributed as dist

    from unickpt._faults import InjectedFault, injected
    from unickpt.io import parts_save

    rank = dist.get_rank()
    booster, model = _boost("fsdp2", _net(quick), _options(endpoint, f"fail-rank-{rank}"))
    committed = "fsdp2-quick" if quick else "fsdp2"
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # a failed save must not leave these bytes anywhere
    fs = _fs(endpoint)
    before = {p: fs.cat_file(p) for p in fs.find(f"{bucket}/{committed}")} if rank == 0 else {}
    seen: dict[str, Any] = {}
    old = parts_save.IN_FLIGHT
    parts_save.IN_FLIGHT = 1  # rounds of 4 parts: the failure comes between rounds
    try:
        stages = [
            ("save.hf_write", 2, "fsdp2"),
            ("save.hf_create", 0, "fsdp2"),
            ("save.commit", 0, "fsdp2"),
            ("save.hf_write", 1, "fresh"),
        ]
        for stage, fail, where in [("save.hf_write", 1, "fsdp2")] if quick else stages:
            where = committed if where == "fsdp2" else where
            raised = None
            with injected(stage, fail):
                try:
                    booster.save_model(
                        model, f"s3://{bucket}/{where}", shard=True, gather_dtensor=True, size_per_shard=20
                    )
                except Exception as e:  # every rank raises
                    raised = e
            assert raised is not None, (stage, fail)
            if rank == fail:
                assert isinstance(raised, InjectedFault), repr(raised)
            else:
                assert f"injected fault at stage '{stage}' on rank {fail}" in str(raised), str(raised)
            if rank == 0:
                assert _open_uploads(endpoint, bucket) == [], (stage, fail)
                fs.invalidate_cache()
                after = {p: fs.cat_file(p) for p in fs.find(f"{bucket}/{committed}")}
                assert after == before, (stage, fail, sorted(set(after) ^ set(before)))
                assert fs.find(f"{bucket}/fresh") == [], (stage, fail)
            seen[f"{stage}@{fail}"] = type(raised).__name__
            dist.barrier()
    finally:
        parts_save.IN_FLIGHT = old
    if rank == 0:  # the previous checkpoint still loads, bit for bit
        _state_of(_download(endpoint, f"{bucket}/{committed}", Path(root) / "dl-after-failures"))
    return seen


def _funnel_case(bucket: str, endpoint: dict[str, Any], root: str) -> dict[str, Any]:
    """The rank-0 funnel (forced): every fault stage it reaches, failing on each rank reaching it."""
    import torch.distributed as dist

    from unickpt._faults import injected, tracing
    from unickpt.io import save as save_mod

    rank = dist.get_rank()
    real = save_mod.supports_shared_parts
    save_mod.supports_shared_parts = lambda store: False  # type: ignore[assignment]
    out: dict[str, Any] = {}
    try:
        booster, model = _boost("fsdp2", _small(), _options(endpoint, f"funnel-rank-{rank}"))
        fs = _fs(endpoint)
        for shard, target in ((True, "funnel"), (False, "funnel1/model.safetensors")):
            url = f"s3://{bucket}/{target}"
            booster.save_model(model, url, shard=shard, gather_dtensor=True)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
            prefix = f"{bucket}/{target.split('/')[0]}"
            before = {p: fs.cat_file(p) for p in fs.find(prefix)} if rank == 0 else {}
            with tracing() as reached:
                booster.save_model(model, f"s3://{bucket}/probe-{shard}", shard=shard, gather_dtensor=True)
            # model.hf_config fails after the commit by design (config.json beside the weights)
            stages = [sorted(set(s) - {"model.hf_config"}) for s in _all_gather(reached)]
            tried = []
            for r, ss in enumerate(stages):
                for stage in ss:
                    raised = None
                    with injected(stage, r):
                        try:
                            booster.save_model(model, url, shard=shard, gather_dtensor=True)
                        except Exception as e:  # every rank raises
                            raised = e
                    assert raised is not None and f"'{stage}' on rank {r}" in str(raised), (stage, r, raised)
                    if rank == 0:
                        assert _open_uploads(endpoint, bucket) == [], (stage, r)
                        fs.invalidate_cache()
                        after = {p: fs.cat_file(p) for p in fs.find(prefix)}
                        assert after == before, (stage, r, sorted(set(after) ^ set(before)))
                    tried.append(f"{stage}@{r}")
                    dist.barrier()
            out[target] = tried
    finally:
        save_mod.supports_shared_parts = real
    return out


def _all_gather(obj: Any) -> list[Any]:
    import torch.distributed as dist

    got: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(got, obj)
    return got


def parts_world(bucket: str, endpoint: dict[str, Any], root: str, which: str) -> Any:
    from harness import run_cases

    from unickpt.store import storage_parts

    os.makedirs(root, exist_ok=True)
    old = storage_parts.PART_SIZE
    storage_parts.PART_SIZE = storage_parts.MIN_PART  # 8 parts of 5 MiB (S3's minimum) per model
    cases = [
        ("fsdp2 sharded", lambda: _same_case("fsdp2", True, bucket, endpoint, root)),
        ("tp single file", lambda: _same_case("tp", False, bucket, endpoint, root)),
        ("failures", lambda: _failure_case(bucket, endpoint, root)),
    ]
    if which == "funnel":
        cases = [("funnel faults", lambda: _funnel_case(bucket, endpoint, root))]
    if which == "quick":
        cases = [
            ("fsdp2 quick", lambda: _same_case("fsdp2-quick", True, bucket, endpoint, root, quick=True)),
            ("failure quick", lambda: _failure_case(bucket, endpoint, root, quick=True)),
        ]
    try:
        return run_cases(cases)
    finally:
        storage_parts.PART_SIZE = old


def _run(world_pool: Any, s3: Any, tmp_path: Path, which: str) -> dict[str, Any]:
    endpoint = s3.storage_options()
    results = world_pool.run(
        4, "test_storage_parts_dist:parts_world", s3.bucket, endpoint, str(tmp_path), which, timeout=TIMEOUT_S
    )
    cases: dict[str, Any] = results[0]
    print({name: round(c.seconds, 1) for name, c in cases.items()})
    failed = {name: c.error for name, c in cases.items() if not c.ok}
    assert not failed, "\n\n".join(f"{k}:\n{v}" for k, v in failed.items())
    return cases


def test_four_ranks_upload_parts_of_one_file(world_pool: Any, s3: Any, tmp_path: Path) -> None:
    """The quick cases (make test): a 7.3 MiB FSDP2 model, two parts of one file."""
    cases = _run(world_pool, s3, tmp_path, "quick")
    sent = [s3.received("PUT", f"fsdp2-quick-rank-{r}") for r in range(4)]
    assert sum(1 for n in sent if n >= 5 * MiB) == 1 and sum(1 for n in sent if n > 0) == 2, sent
    # one file of two parts: part 1 to rank 0 (no holder can take 5 MiB within its share), part 2
    # to a holder of its bytes; the index PUT is rank 0's
    assert cases["fsdp2 quick"].value["files"] == [
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
    ]
    assert set(cases["failure quick"].value) == {"save.hf_write@1"}


@pytest.mark.slow  # 45 to 90 s on the shared 2 cores (36 MiB models, moto); test_storage_parts.py runs in make test
def test_every_rank_uploads_parts_of_a_gathered_save(world_pool: Any, s3: Any, tmp_path: Path) -> None:
    cases = _run(world_pool, s3, tmp_path, "parts")
    for kind in ("fsdp2", "tp"):
        total = cases["fsdp2 sharded" if kind == "fsdp2" else "tp single file"].value["bytes"]
        # Uploaded body bytes per rank (parts and one-part PUTs; rank 0 also the index).
        sent = [s3.received("PUT", f"{kind}-rank-{r}") for r in range(4)]
        assert total <= sum(sent) <= total + 64 * 1024, (kind, sent, total)
        # each rank its share, give or take one part (5 MiB; rank 0 also the index)
        assert all(abs(n - total / 4) <= 5 * MiB + 64 * 1024 for n in sent), (kind, sent, total)
        print(f"{kind}: bytes uploaded per rank {sent} of {total}")
    # 20 MB shards: three files, each uploaded in parts by several ranks
    assert cases["fsdp2 sharded"].value["files"] == [
        *(f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)),
        "model.safetensors.index.json",
    ]
    assert set(cases["failures"].value) == {
        "save.hf_write@2",
        "save.hf_create@0",
        "save.commit@0",
        "save.hf_write@1",
    }


@pytest.mark.slow
def test_funnel_fails_cleanly_at_every_stage(world_pool: Any, s3: Any, tmp_path: Path) -> None:
    funnel = _run(world_pool, s3, tmp_path, "funnel")["funnel faults"].value
    for target in ("funnel", "funnel1/model.safetensors"):
        tried = funnel[target]
        # rank 0 writes every file; the other ranks take part in the gathers
        assert {"save.list@0", "save.list@1", "save.plan@3", "save.write@0"} <= set(tried), tried
