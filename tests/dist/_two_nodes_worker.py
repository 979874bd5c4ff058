"""Workers of tests/dist/test_two_nodes.py: run under two torchrun launchers (one per "node").

Each node has its own working directory and TMPDIR; nothing is shared but the S3 store
(reached through AWS_ENDPOINT_URL and the key variables of the environment).
"""

from __future__ import annotations

import io
from typing import Any


def _fs() -> Any:
    import fsspec

    return fsspec.filesystem("s3", skip_instance_cache=True)


def _boost(kind: str, seed: int, lr_scale: float = 1.0) -> tuple[Any, Any, Any, Any]:
    import torch
    from conftest import make_model, make_optimizer, make_plugin

    from unickpt.booster import Booster

    booster = Booster(make_plugin(kind))
    model = make_model(seed)
    optim = make_optimizer(model)
    for g in optim.param_groups:
        g["lr"] *= lr_scale
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0 / (1 + s))
    m, o, _, _, s = booster.boost(model, optim, lr_scheduler=sched)
    return booster, m, o, s


def save_phase(url: str) -> dict[str, Any]:
    """FSDP2 over every rank: train two steps, save model and optimizer sliced to ``url``."""
    import torch
    import torch.distributed as dist
    from conftest import batch, full_model_state, full_optim_state, loss_fn

    booster, m, o, s = _boost("fsdp2", seed=0)
    for step in range(2):
        x, y = batch(step)
        loss = loss_fn(m(x), y)
        booster.backward(loss, o)
        o.step()
        o.zero_grad()
        s.step()
    booster.save_model(m, f"{url}/model", shard=True, gather_dtensor=False, size_per_shard=0.004)
    booster.save_optimizer(o, f"{url}/optim", shard=True, gather_dtensor=False, size_per_shard=0.004)
    ref = {"model": full_model_state(m), "optim": full_optim_state(m, o)}
    if dist.get_rank() == 0:
        buf = io.BytesIO()
        torch.save(ref, buf)  # test reference only: checkpoints themselves are never pickled
        _fs().pipe_file(f"{url}/ref.pt"[len("s3://") :], buf.getvalue())
    dist.barrier()
    return {}


def load_phase(url: str) -> dict[str, Any]:
    """TP over every rank: load both checkpoints from ``url``, compare bit for bit."""
    import torch
    from conftest import assert_same_tensors, full_model_state, full_optim_state

    ref = torch.load(io.BytesIO(_fs().cat_file(f"{url}/ref.pt"[len("s3://") :])), weights_only=True)
    booster, m, o, _ = _boost("tp", seed=7, lr_scale=3.0)
    booster.load_model(m, f"{url}/model")
    booster.load_optimizer(o, f"{url}/optim")
    assert_same_tensors(full_model_state(m), ref["model"], "model")
    got = full_optim_state(m, o)
    assert_same_tensors(got["state"], ref["optim"]["state"], "optim.state")
    assert got["param_groups"] == ref["optim"]["param_groups"]
    return {}
