"""A resharded load from a real S3 API: saved by FSDP2 on 4 ranks, loaded by FSDP2 on 2 (and by
TP on 2) from ``s3://``, bit-exact for model and optimizer, each rank fetching about its share.

The S3 server (moto, ``tests/s3server.py``) runs in this test process and counts the body bytes
it serves per client; each rank names itself ``rank-<r>`` in its requests. The 4-rank save is
written locally and uploaded (a checkpoint is just files), so this tests the read side alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from harness import run_cases

WORLD_TIMEOUT_S = 240.0
pytestmark = pytest.mark.timeout(3 * WORLD_TIMEOUT_S + 60)

ROWS, COLS, LAYERS = 202, 190, 4  # about 0.6 MB of fp32 weights; rows split unevenly over 4


def _model(seed: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(COLS, ROWS)]
    for _ in range(LAYERS - 2):
        layers += [nn.ReLU(), nn.Linear(ROWS, ROWS)]
    layers += [nn.ReLU(), nn.Linear(ROWS, COLS)]
    return nn.Sequential(*layers)


def _boost(kind: str, seed: int, lr: float) -> tuple[Any, Any, Any]:
    import torch
    from conftest import make_plugin

    from unickpt.booster import Booster

    if kind == "tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        from unickpt.plugins import TPPlugin

        plan = {
            "0": ColwiseParallel(),
            "2": RowwiseParallel(),
            "4": ColwiseParallel(),
            "6": RowwiseParallel(),
        }
        booster = Booster(TPPlugin(plan))
    else:
        booster = Booster(make_plugin(kind))
    model = _model(seed)
    optim = torch.optim.AdamW(model.named_parameters(), lr=lr)
    m, o, *_ = booster.boost(model, optim)
    return booster, m, o


def save_phase(root: str, endpoint: str, bucket: str) -> dict[str, Any]:
    """FSDP2 x4: train one step, save model and optimizer as per-rank slices, upload to S3."""
    import torch
    import torch.distributed as dist
    from conftest import full_model_state, full_optim_state

    booster, m, o = _boost("fsdp2", seed=0, lr=0.01)
    torch.manual_seed(1)
    m(torch.randn(8, COLS)).square().mean().backward()
    o.step()
    o.zero_grad()
    local = Path(root) / "ckpt"
    booster.save_model(m, str(local / "model"), shard=True, gather_dtensor=False)
    booster.save_optimizer(o, str(local / "optim"), shard=True, gather_dtensor=False)
    ref = {"model": full_model_state(m), "optim": full_optim_state(m, o)}
    if dist.get_rank() == 0:
        torch.save(ref, Path(root) / "ref.pt")
        import s3fs

        fs = s3fs.S3FileSystem(**_options(endpoint, "uploader"))
        fs.put(str(local), f"{bucket}/ckpt", recursive=True)
    dist.barrier()
    return {}


def _options(endpoint: str, client: str) -> dict[str, Any]:
    return {
        "endpoint_url": endpoint,
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"region_name": "us-east-1"},
        "skip_instance_cache": True,
        "config_kwargs": {"user_agent_extra": f"unickpt-client/{client}"},
    }


def load_case(root: str, endpoint: str, bucket: str, kind: str, tag: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from conftest import assert_local_state_matches, live_model_state, live_optim_state

    ref = torch.load(Path(root) / "ref.pt", weights_only=True)
    booster, m, o = _boost(kind, seed=3, lr=0.5)
    booster.checkpoint_io.storage_options = _options(endpoint, f"{tag}-{dist.get_rank()}")
    url = f"s3://{bucket}/ckpt"
    # The reader (locate, and its check of the committed index) calls fetch_index by this name.
    import unickpt.ckpt.reader as rd

    fetched: list[str] = []
    real = rd.fetch_index

    def counting(storage: Any, path: str) -> bytes:
        fetched.append(path)
        return real(storage, path)

    rd.fetch_index = counting  # type: ignore[assignment]
    try:
        booster.load_model(m, f"{url}/model")
        booster.load_optimizer(o, f"{url}/optim")
    finally:
        rd.fetch_index = real  # type: ignore[assignment]
    assert_local_state_matches(live_model_state(m), ref["model"], "model")
    got = live_optim_state(m, o)
    assert got["state"], "no optimizer state after the load"
    assert_local_state_matches(got["state"], ref["optim"]["state"], "optim.state")
    assert got["param_groups"] == ref["optim"]["param_groups"], got["param_groups"]
    return {"index_fetches": fetched}


def refused_case(endpoint: str, bucket: str) -> dict[str, Any]:
    """A missing checkpoint (found by rank 0 alone) and a truncated object (seen by the ranks that
    read it) raise the same error, naming the URL, on every rank; nothing is half-loaded."""
    import torch
    import torch.distributed as dist

    from unickpt.errors import HeaderError, IncompleteCheckpointError

    booster, m, _ = _boost("fsdp2", seed=3, lr=0.5)
    booster.checkpoint_io.storage_options = _options(endpoint, f"refused-{dist.get_rank()}")
    before = {k: v.to_local().clone() for k, v in m.state_dict().items()}
    url = f"s3://{bucket}"
    with pytest.raises(
        IncompleteCheckpointError,
        match=rf"\[rank 0\] .*no checkpoint at {url}/nothing: the path does not exist",
    ):
        booster.load_model(m, f"{url}/nothing")
    if dist.get_rank() == 0:
        import s3fs

        fs = s3fs.S3FileSystem(**_options(endpoint, "uploader"))
        fs.copy(f"{bucket}/ckpt/model", f"{bucket}/cut/model", recursive=True)
        victim = sorted(f for f in fs.ls(f"{bucket}/cut/model") if f.endswith(".safetensors"))[-1]
        fs.pipe_file(victim, fs.cat_file(victim)[:-100])
    dist.barrier()
    with pytest.raises(
        HeaderError, match=rf"{url}/cut/model/model-\S+\.safetensors: tensor '[^']+': data_offsets"
    ):
        booster.load_model(m, f"{url}/cut/model")
    after = {k: v.to_local() for k, v in m.state_dict().items()}
    assert all(torch.equal(before[k], after[k]) for k in before)
    # A store that one rank alone cannot make (its storage options refused): the other rank has
    # a store that fetches ahead and takes the rank-0-locates path; both raise the same error,
    # naming the failing rank, within seconds, and nothing is loaded. Either rank failing.
    import time

    from unickpt.errors import ConfigError

    for bad in (1, 0):
        options = _options(endpoint, f"refused-{dist.get_rank()}")
        if dist.get_rank() == bad:
            options["unickpt_timeout"] = "soon"
        booster.checkpoint_io.storage_options = options
        start = time.monotonic()
        with pytest.raises(
            ConfigError, match=rf"\[rank {bad}\] .*unickpt_timeout: expected seconds .* got 'soon'"
        ):
            booster.load_model(m, f"{url}/ckpt/model")
        assert time.monotonic() - start < 10.0
        after = {k: v.to_local() for k, v in m.state_dict().items()}
        assert all(torch.equal(before[k], after[k]) for k in before)
    dist.barrier()  # still in step: the world goes on to its next collective
    return {}


def load_phase(root: str, endpoint: str, bucket: str) -> dict[str, Any]:
    cases = [
        ("fsdp2", lambda: load_case(root, endpoint, bucket, "fsdp2", "fsdp")),
        ("tp", lambda: load_case(root, endpoint, bucket, "tp", "tp")),
        ("refused", lambda: refused_case(endpoint, bucket)),
    ]
    return {name: (r.ok, r.error, r.value) for name, r in run_cases(cases).items()}


# -- parent side ---------------------------------------------------------------------------------


def _data_bytes(local: Path) -> int:
    from unickpt.ckpt.reader import open_checkpoint

    total = 0
    for part, kind in (("model", "model"), ("optim", "optimizer")):
        with open_checkpoint(local / part, kind) as r:
            total += sum(t.nbytes for t in r.tensors.values())
    return total


def test_resharded_load_from_s3(world_pool, s3, tmp_path) -> None:
    root = str(tmp_path)
    world_pool.run(
        4, "test_storage_read_dist:save_phase", root, s3.endpoint, s3.bucket, timeout=WORLD_TIMEOUT_S
    )
    s3.reset()
    results = world_pool.run(
        2, "test_storage_read_dist:load_phase", root, s3.endpoint, s3.bucket, timeout=WORLD_TIMEOUT_S
    )
    failed = {k: err for k, (ok, err, _) in results[0].items() if not ok}
    assert not failed, json.dumps(failed, indent=1)[:4000]
    data = _data_bytes(tmp_path / "ckpt")
    fsdp = [s3.served("GET", f"fsdp-{r}") for r in range(2)]
    # Row slices saved by 4 ranks, loaded by 2: the checkpoint about once in total (headers and
    # the index on top), never 2x, and each rank about its own half.
    assert data <= sum(fsdp) <= 1.1 * data, (fsdp, data)
    assert all(0.4 * data <= n <= 0.6 * data for n in fsdp), (fsdp, data)
    # The index is fetched once per load, by rank 0, and broadcast: rank 1 fetches none.
    url = f"s3://{s3.bucket}/ckpt"
    want = [f"{url}/model/model.safetensors.index.json", f"{url}/optim/optimizer.safetensors.index.json"]
    assert results[0]["fsdp2"][2] == {"index_fetches": want}
    assert results[1]["fsdp2"][2] == {"index_fetches": []}
    # TP's column blocks of stored rows are many short runs, coalesced into whole-slice requests
    # (gaps under COALESCE_GAP are read and dropped): at most every stored slice a rank touches.
    tp = [s3.served("GET", f"tp-{r}") for r in range(2)]
    print(f"data {data} B; fetched per rank: fsdp2 x2 {fsdp}, tp x2 {tp}")
    assert all(n <= 1.1 * data for n in tp), (tp, data)
