"""ExpertParallelPlugin in real gloo worlds: stacked experts ``Shard(0)`` over ``ep``, FSDP2 for the rest.

- Training: a tiny own MoE (``MoENet``) and a tiny transformers Mixtral, at EP 2 (a 2-D
  ``(efsdp 2, ep 2)`` mesh) and EP 4 on 4 ranks, give the losses and parameters of the unsharded
  model trained on the same global batches (AdamW).
- Checkpoints: model and AdamW state saved with no EP (one process), at EP 2 (2 ranks) and EP 4
  (4 ranks) load bit-exact at EP 4, at EP 2 x efsdp 2, at EP 2 and in a plain single process (the
  own MoE; the Mixtral, marked slow, saved with no EP and at EP 4, loaded at EP 4, EP 2 x efsdp 2,
  EP 2 and plain); the
  EP 2 load from S3 fetches per rank only its own experts' bytes (and its share of the rest), as
  the S3 server (``tests/s3server.py``) counts them; ``unickpt merge`` of the EP 4 checkpoints
  writes the full stacked expert tensors under their live (fused) names.
- Idle expert ranks (every token routed to experts 0 and 1 at EP 4) and transformers' "no
  expert" id still train like the unsharded model; two experts on 4 ranks at EP 2 are FSDP
  ``Shard(1)`` over efsdp.
- Refusals: an ``ep_size`` that does not divide the world or ``num_experts``, a named module that
  is not stacked experts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from harness import WorldPool, run_cases
from torch import nn

WORLD_TIMEOUT_S = 240.0
pytestmark = pytest.mark.timeout(6 * WORLD_TIMEOUT_S + 60)

E, H, INTER, TOP_K, LAYERS, IN, OUT = 4, 16, 128, 2, 2, 8, 3
ROWS_PER_RANK, SEQ, STEPS = 2, 5, 2


class StackedExperts(nn.Module):
    """``num_experts`` SwiGLU experts stacked as ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``."""

    def __init__(self, num_experts: int = E) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.randn(num_experts, 2 * INTER, H) * 0.2)
        self.down_proj = nn.Parameter(torch.randn(num_experts, H, INTER) * 0.2)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> Any:
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            token, slot = torch.where(top_k_index == e)
            if token.numel() == 0:
                continue
            gate, up = F.linear(hidden_states[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e]) * top_k_weights[token, slot, None]
            out = out.index_add(0, token, y)
        return out


class MoE(nn.Module):
    """Top-k routing. ``skewed``: every token picks experts 0 and 1 (the others get no token), and
    every other token's second slot is ``num_experts``, transformers' "no expert"."""

    def __init__(self, num_experts: int = E, skewed: bool = False) -> None:
        super().__init__()
        self.router = nn.Linear(H, num_experts, bias=False)
        self.experts = StackedExperts(num_experts)
        self.skewed = skewed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, H)
        logits = self.router(flat)
        if self.skewed:
            logits = logits + torch.tensor([40.0, 20.0] + [-40.0] * (logits.shape[-1] - 2))
        weights, index = logits.softmax(-1).topk(TOP_K, dim=-1)
        if self.skewed:
            index = index.clone()
            index[::2, 1] = logits.shape[-1]
        y = self.experts(flat, index, weights / weights.sum(-1, keepdim=True))
        return x + y.reshape(x.shape)


class MoENet(nn.Module):
    def __init__(self, num_experts: int = E, skewed: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(IN, H)
        self.layers = nn.ModuleList([MoE(num_experts, skewed) for _ in range(LAYERS)])
        self.head = nn.Linear(H, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def moe_net(seed: int, num_experts: int = E, skewed: bool = False) -> MoENet:
    torch.manual_seed(seed)
    return MoENet(num_experts, skewed)


def _make(kind: str, seed: int) -> Any:
    """``own``, ``own_e2`` (two experts: Shard(1) over efsdp at EP 2 on 4 ranks), ``skewed`` or ``mixtral``."""
    if kind == "mixtral":
        return mixtral(seed)
    return moe_net(seed, num_experts=2 if kind == "own_e2" else E, skewed=kind == "skewed")


def mixtral(seed: int) -> Any:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    cfg = MixtralConfig(
        vocab_size=64,
        hidden_size=H,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=E,
        num_experts_per_tok=TOP_K,
    )
    return MixtralForCausalLM(cfg)


def _batch(kind: str, step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    n = world * ROWS_PER_RANK
    if kind == "mixtral":
        ids = torch.randint(0, 64, (n, SEQ), generator=g)
        return ids, ids
    return torch.randn(n, SEQ, IN, generator=g), torch.randn(n, SEQ, OUT, generator=g)


def _loss(kind: str, model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if kind == "mixtral":
        return model(input_ids=x, labels=y).loss  # type: ignore[no-any-return]
    return F.mse_loss(model(x), y)


def _boost(kind: str, ep: int | None, seed: int, lr: float = 0.01) -> tuple[Any, Any, Any]:
    from unickpt.booster import Booster
    from unickpt.plugins import ExpertParallelPlugin

    booster = Booster(None if ep is None else ExpertParallelPlugin(ep_size=ep))
    model = _make(kind, seed)
    optim = torch.optim.AdamW(model.parameters(), lr=lr)
    m, o, *_ = booster.boost(model, optim)
    return booster, m, o


def _train(kind: str, booster: Any, m: Any, o: Any, steps: range) -> list[float]:
    """Each rank trains on its rows of the global batch; returns the world's mean losses."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    losses = []
    for step in steps:
        x, y = _batch(kind, step, world)
        rows = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
        loss = _loss(kind, m, x[rows], y[rows])
        booster.backward(loss, o)
        o.step()
        o.zero_grad()
        mean = loss.detach().clone()
        if world > 1:
            dist.all_reduce(mean)
        losses.append(float(mean) / world)
    return losses


# -- training equivalence (world 4) -----------------------------------------------------------


def _train_case(kind: str, ep: int) -> dict[str, Any]:
    import torch.distributed as dist
    from conftest import full_model_state

    from unickpt.plugins import ExpertParallelPlugin

    world = dist.get_world_size()
    ref = _make(kind, 0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    booster, m, o = _boost(kind, ep, seed=0)
    plugin = booster.plugin
    assert isinstance(plugin, ExpertParallelPlugin)
    experts = [n for n, _ in ref.named_modules() if n.endswith("experts")]
    assert plugin.expert_modules == experts, plugin.expert_modules
    inner = m.unwrap()
    for fqn in experts:
        for name, p in inner.get_submodule(fqn).named_parameters():
            # Shard(0) over ep (rank r of the group holds experts r*E/ep ..), FSDP over efsdp.
            assert p.device_mesh.mesh_dim_names == ("efsdp", "ep"), (fqn, name, p.device_mesh)
            assert p.placements[1].is_shard(0), (fqn, name, p.placements)
            n = inner.get_submodule(fqn).num_experts
            if world // ep * ep > n:  # fewer experts than ranks: FSDP shards the experts' rows
                assert p.placements[0].is_shard(1), (fqn, name, p.placements)
            assert p.to_local().shape[0] <= n // ep, (fqn, name, p.to_local().shape)
    got = _train(kind, booster, m, o, range(STEPS))
    want = []
    for step in range(STEPS):
        x, y = _batch(kind, step, world)
        parts = [
            _loss(
                kind,
                ref,
                x[r * ROWS_PER_RANK : (r + 1) * ROWS_PER_RANK],
                y[r * ROWS_PER_RANK : (r + 1) * ROWS_PER_RANK],
            )
            for r in range(world)
        ]
        loss = torch.stack(parts).mean()
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        want.append(float(loss))
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
    full = full_model_state(m)
    for k, v in ref.state_dict().items():
        # AdamW normalises each element's step: atol is 1% of one step (lr 0.01).
        torch.testing.assert_close(full[k], v, rtol=1e-4, atol=1e-4, msg=lambda s, k=k: f"{k}: {s}")
    return {"losses": got}


def _refusals() -> dict[str, Any]:
    from unickpt.errors import UnsupportedError
    from unickpt.plugins import ExpertParallelPlugin

    with pytest.raises(UnsupportedError, match=r"ep_size=3\): the world size 4 is not a multiple of it"):
        ExpertParallelPlugin(ep_size=3).configure(moe_net(0))
    with pytest.raises(
        UnsupportedError,
        match=r"experts module 'layers.0.experts' has num_experts=6, not divisible by ep_size=4",
    ):
        ExpertParallelPlugin(ep_size=4).configure(moe_net(0, num_experts=6))
    with pytest.raises(
        UnsupportedError, match=r"cannot shard experts of 'layers.0.router' \(Linear\) has no"
    ):
        ExpertParallelPlugin(ep_size=2, experts=["layers.0.router"]).configure(moe_net(0))
    mixed = moe_net(0)
    experts = mixed.layers[0].experts
    experts.down_proj = nn.Parameter(experts.down_proj.detach().to(torch.bfloat16))
    with pytest.raises(
        UnsupportedError,
        match=r"fully_shard\('layers.0.experts'\) would manage trainable parameters of several dtypes",
    ):
        ExpertParallelPlugin(ep_size=2).configure(mixed)
    # Refused before anything changed: no parameter became a DTensor, no forward was replaced.
    assert not any(hasattr(p, "placements") for p in mixed.parameters())
    assert "forward" not in vars(experts)
    with pytest.raises(UnsupportedError, match=r"found no stacked-experts module"):
        ExpertParallelPlugin(ep_size=2).configure(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(UnsupportedError, match=r"ep_size=0\): a positive integer expected"):
        ExpertParallelPlugin(ep_size=0)
    return {}


def train_worker() -> dict[str, Any]:
    cases = [
        ("own_ep2", lambda: _train_case("own", 2)),
        ("own_ep4", lambda: _train_case("own", 4)),
        ("mixtral_ep2", lambda: _train_case("mixtral", 2)),
        ("mixtral_ep4", lambda: _train_case("mixtral", 4)),
        ("own_e2_ep2_shard1", lambda: _train_case("own_e2", 2)),
        ("skewed_ep4_idle_ranks", lambda: _train_case("skewed", 4)),
        ("refusals", _refusals),
    ]
    return {k: (r.ok, r.error, r.value) for k, r in run_cases(cases).items()}


# -- checkpoints across EP sizes --------------------------------------------------------------


def _reference(m: Any, o: Any) -> dict[str, Any]:
    from conftest import full_model_state, full_optim_state

    return {"model": full_model_state(m), "optim": full_optim_state(m, o)}


def _kind_of(tag: str) -> str:
    """Checkpoints ``mix_*`` hold the tiny Mixtral, the others the own MoE."""
    return "mixtral" if tag.startswith("mix_") else "own"


def save_worker(root: str, tag: str, ep: int | None) -> dict[str, Any]:
    """Train STEPS steps at ``ep`` (None: no plugin) and save model and optimizer sharded."""
    import torch.distributed as dist

    kind = _kind_of(tag)
    booster, m, o = _boost(kind, ep, seed=0)
    losses = _train(kind, booster, m, o, range(STEPS))
    out = Path(root) / tag
    booster.save_model(m, str(out / "model"), shard=True, gather_dtensor=False)
    booster.save_optimizer(o, str(out / "optim"), shard=True, gather_dtensor=False)
    if tag == "ep4":  # and a Hugging Face checkpoint: full tensors, each rank writing its own bytes
        booster.save_model(m, str(out / "hf"), shard=True, gather_dtensor=True)
    ref = _reference(m, o)
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(ref, out / "ref.pt")
    if dist.is_initialized():
        dist.barrier()
    return {"losses": losses}


def _own_bytes(m: Any, o: Any) -> int:
    """Bytes of the model and optimizer tensors this rank holds (its blocks; replicated ones whole)."""
    from conftest import live_model_state, live_optim_state

    total = 0
    tensors = list(live_model_state(m).values())
    for state in live_optim_state(m, o)["state"].values():
        tensors += [v for v in state.values() if torch.is_tensor(v)]
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def load_case(
    src: str, ep: int | None, url: str | None = None, storage_options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Load the model and optimizer saved in ``src`` (or its copy at ``url``) at ``ep`` and check
    every bit against the full reference saved beside them."""
    from conftest import assert_local_state_matches, live_model_state, live_optim_state

    ref = torch.load(Path(src) / "ref.pt", weights_only=True)
    url = url or src
    kind = _kind_of(Path(src).name)
    booster, m, o = _boost(kind, ep, seed=7, lr=0.5)
    if storage_options is not None:
        booster.checkpoint_io.storage_options = storage_options
    booster.load_model(m, f"{url}/model")
    booster.load_optimizer(o, f"{url}/optim")
    assert_local_state_matches(live_model_state(m), ref["model"], "model")
    got = live_optim_state(m, o)
    assert got["state"], "no optimizer state after the load"
    assert_local_state_matches(got["state"], ref["optim"]["state"], "optim.state")
    assert got["param_groups"] == ref["optim"]["param_groups"], got["param_groups"]
    # Training goes on from the loaded state (the experts' forward and the optimizer work).
    losses = _train(kind, booster, m, o, range(STEPS, STEPS + 1))
    return {"own_bytes": _own_bytes(m, o), "losses": losses}


def world_worker(root: str, phase: str, endpoint: str = "", bucket: str = "") -> dict[str, Any]:
    """The own MoE's checkpoints: saved with no EP, at EP 2 and EP 4; each loaded at the others."""
    import torch.distributed as dist

    world = dist.get_world_size()
    cases: list[tuple[str, Any]] = []
    if phase == "save":
        tag = {1: "plain", 2: "ep2", 4: "ep4"}[world]
        cases.append((f"save_{tag}", lambda: save_worker(root, tag, None if world == 1 else world)))
    elif world == 4:
        for src in ("plain", "ep2"):
            cases.append((f"{src}_to_ep4", lambda src=src: load_case(f"{root}/{src}", 4)))
        cases.append(("ep2_to_ep2xefsdp2", lambda: load_case(f"{root}/ep2", 2)))
        cases.append(("plain_to_ep2xefsdp2", lambda: load_case(f"{root}/plain", 2)))
    elif world == 2:
        rank = dist.get_rank()
        opts = _options(endpoint, f"ep2-{rank}")
        cases.append(("ep4_to_ep2_s3", lambda: load_case(f"{root}/ep4", 2, f"s3://{bucket}/ep4", opts)))
        cases.append(("plain_to_ep2", lambda: load_case(f"{root}/plain", 2)))
    else:
        for src in ("ep4", "ep2"):
            cases.append((f"{src}_to_plain", lambda src=src: load_case(f"{root}/{src}", None)))
    return {k: (r.ok, r.error, r.value) for k, r in run_cases(cases).items()}


def mixtral_worker(root: str, phase: str) -> dict[str, Any]:
    """The tiny Mixtral's checkpoints: saved with no EP and at EP 4; loaded at EP 4, EP 2, plain."""
    import torch.distributed as dist

    world = dist.get_world_size()
    cases: list[tuple[str, Any]] = []
    if phase == "save":
        tag = {1: "mix_plain", 4: "mix_ep4"}[world]
        cases.append((f"save_{tag}", lambda: save_worker(root, tag, None if world == 1 else world)))
    elif world == 4:
        cases.append(("mix_plain_to_ep4", lambda: load_case(f"{root}/mix_plain", 4)))
        cases.append(("mix_ep4_to_ep2xefsdp2", lambda: load_case(f"{root}/mix_ep4", 2)))
    elif world == 2:
        cases.append(("mix_ep4_to_ep2", lambda: load_case(f"{root}/mix_ep4", 2)))
    else:
        cases.append(("mix_ep4_to_plain", lambda: load_case(f"{root}/mix_ep4", None)))
    return {k: (r.ok, r.error, r.value) for k, r in run_cases(cases).items()}


def _options(endpoint: str, client: str) -> dict[str, Any]:
    return {
        "endpoint_url": endpoint,
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"region_name": "us-east-1"},
        "skip_instance_cache": True,
        "config_kwargs": {"user_agent_extra": f"unickpt-client/{client}"},
    }


# -- parent side ------------------------------------------------------------------------------


def _check(results: dict[str, Any]) -> dict[str, Any]:
    failed = {k: err for k, (ok, err, _) in results.items() if not ok}
    assert not failed, json.dumps(failed, indent=1)[:6000]
    return {k: v for k, (_, _, v) in results.items()}


def test_training_matches_unsharded(world_pool: WorldPool) -> None:
    values = _check(world_pool.run(4, "test_expert_parallel:train_worker", timeout=WORLD_TIMEOUT_S)[0])
    assert set(values) == {
        "own_ep2",
        "own_ep4",
        "mixtral_ep2",
        "mixtral_ep4",
        "own_e2_ep2_shard1",
        "skewed_ep4_idle_ranks",
        "refusals",
    }


def _metadata_bytes(ckpt: Path) -> int:
    """Bytes of a checkpoint that are not tensor data: headers and indexes, every file."""
    from unickpt.ckpt.reader import open_checkpoint

    data = 0
    for part, kind in (("model", "model"), ("optim", "optimizer")):
        with open_checkpoint(ckpt / part, kind) as r:
            data += sum(t.nbytes for t in r.tensors.values())
    files = sum(
        p.stat().st_size for part in ("model", "optim") for p in (ckpt / part).rglob("*") if p.is_file()
    )
    return files - data


def _expert_bytes(ckpt: Path) -> int:
    from unickpt.ckpt.reader import open_checkpoint

    total = 0
    for part, kind in (("model", "model"), ("optim", "optimizer")):
        with open_checkpoint(ckpt / part, kind) as r:
            total += sum(t.nbytes for n, t in r.tensors.items() if ".experts." in n)
    return total


def test_checkpoints_across_ep_sizes(world_pool: WorldPool, s3: Any, tmp_path: Path) -> None:
    root = str(tmp_path)
    for world in (1, 2, 4):
        _check(
            world_pool.run(world, "test_expert_parallel:world_worker", root, "save", timeout=WORLD_TIMEOUT_S)[
                0
            ]
        )
    import s3fs

    fs = s3fs.S3FileSystem(**_options(s3.endpoint, "uploader"))
    fs.put(str(tmp_path / "ep4"), f"{s3.bucket}/ep4", recursive=True)
    for world in (4, 1):
        _check(
            world_pool.run(world, "test_expert_parallel:world_worker", root, "load", timeout=WORLD_TIMEOUT_S)[
                0
            ]
        )
    s3.reset()
    res = world_pool.run(
        2, "test_expert_parallel:world_worker", root, "load", s3.endpoint, s3.bucket, timeout=WORLD_TIMEOUT_S
    )
    values = [_check(r) for r in res]
    # Each EP 2 rank fetches its own blocks (its two experts of every stacked tensor, its half of
    # the FSDP rows, the replicated step counters) and, on top, the metadata, the first
    # HEADER_PROBE bytes of each file it opens (its header, whatever data follows) and what a
    # prefetch may bridge; nothing of the other rank's experts: half of those would be more.
    from unickpt.ckpt.reader import HEADER_PROBE, PREFETCH_WASTE

    ckpt = tmp_path / "ep4"
    meta, experts = _metadata_bytes(ckpt), _expert_bytes(ckpt)
    probes = HEADER_PROBE * sum(len(list((ckpt / part).glob("*.safetensors"))) for part in ("model", "optim"))
    served = [s3.served("GET", f"ep2-{r}") for r in range(2)]
    own = [v["ep4_to_ep2_s3"]["own_bytes"] for v in values]
    print(
        f"EP 2 load from S3: fetched {served} B, own blocks {own} B, metadata {meta} B, experts {experts} B"
    )
    for r in range(2):
        slack = int(own[r] * PREFETCH_WASTE) + meta + probes
        assert slack < experts // 2, (slack, experts)
        assert own[r] <= served[r] <= own[r] + slack, (r, served, own, slack)

    merged = _merge(tmp_path, "ep4")
    assert merged["layers.0.experts.gate_up_proj"].shape == (E, 2 * INTER, H)
    assert merged["layers.1.experts.down_proj"].shape == (E, H, INTER)
    _assert_full(tmp_path / "ep4" / "hf", tmp_path / "ep4" / "ref.pt")  # the gathered save at EP 4


@pytest.mark.slow
def test_mixtral_checkpoints_across_ep_sizes(world_pool: WorldPool, tmp_path: Path) -> None:
    root = str(tmp_path)
    for world, phase in ((1, "save"), (4, "save"), (4, "load"), (2, "load"), (1, "load")):
        _check(
            world_pool.run(
                world, "test_expert_parallel:mixtral_worker", root, phase, timeout=WORLD_TIMEOUT_S
            )[0]
        )
    merged = _merge(tmp_path, "mix_ep4")
    assert merged["model.layers.0.mlp.experts.gate_up_proj"].shape == (E, 2 * 32, H)
    assert merged["model.layers.1.mlp.experts.down_proj"].shape == (E, H, 32)


def _merge(tmp_path: Path, tag: str) -> dict[str, torch.Tensor]:
    """``unickpt merge`` of an EP checkpoint: the full stacked tensors, bit for bit."""
    from unickpt.cli.main import main

    out = tmp_path / f"merged_{tag}"
    assert main(["merge", "-q", str(tmp_path / tag / "model"), str(out)]) == 0
    return _assert_full(out, tmp_path / tag / "ref.pt")


def _assert_full(out: Path, ref_path: Path) -> dict[str, torch.Tensor]:
    """The safetensors files in ``out`` hold exactly the reference's full tensors, bit for bit."""
    from safetensors.torch import load_file

    ref = torch.load(ref_path, weights_only=True)
    merged: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        merged.update(load_file(f))
    assert merged.keys() == ref["model"].keys()
    for k, v in ref["model"].items():
        assert merged[k].dtype == v.dtype and merged[k].shape == v.shape, k
        assert torch.equal(merged[k].view(torch.uint8), v.view(torch.uint8)), k
    return merged
