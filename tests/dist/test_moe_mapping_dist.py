"""A Hub Mixtral checkpoint (per-expert keys) loaded into a 2-rank FSDP2 model, in a real gloo world.

``gate_up_proj`` [E, 2I, H] and ``down_proj`` are ``Shard(0)`` DTensors: rank r holds experts
2r and 2r+1. Each rank must read the Hub tensors of its own experts (whole, once) and not one
byte of the others'; the loaded model equals ``from_pretrained`` bit for bit. The FSDP2 model
then saves sliced and ``merge`` writes exactly what ``save_pretrained`` wrote, as does its
gathered save (every rank writing the experts it holds under their Hub names).
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Any

import pytest
from harness import WorldPool, run_cases

WORLD = 2


def _mixtral(seed: int) -> Any:
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    cfg = MixtralConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    return MixtralForCausalLM(cfg)


def _sharded(model: Any) -> Any:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _load_case(hub: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from transformers import MixtralForCausalLM

    from unickpt import GeneralCheckpointIO
    from unickpt.ckpt.reader import CheckpointReader

    rank = dist.get_rank()
    ref = MixtralForCausalLM.from_pretrained(hub).state_dict()
    model = _sharded(_mixtral(seed=1))
    reads: list[tuple[str, int, int]] = []
    original = CheckpointReader.read_key_bytes, CheckpointReader.read_key, CheckpointReader.read_runs

    def read_key_bytes(self: Any, file: str, key: str, rel: int, n: int, out: Any = None) -> Any:
        reads.append((key, rel, n))
        return original[0](self, file, key, rel, n, out)

    def read_key(self: Any, file: str, key: str, out: Any = None) -> Any:
        reads.append((key, 0, -1))
        return original[1](self, file, key, out)

    def read_runs(self: Any, file: str, key: str, runs: Any, out: Any) -> Any:
        reads.extend((key, o, k) for o, k in runs)
        return original[2](self, file, key, runs, out)

    CheckpointReader.read_key_bytes, CheckpointReader.read_key, CheckpointReader.read_runs = (  # type: ignore[method-assign]
        read_key_bytes,
        read_key,
        read_runs,
    )
    try:
        report = GeneralCheckpointIO().load_model(model, hub)
    finally:
        CheckpointReader.read_key_bytes, CheckpointReader.read_key, CheckpointReader.read_runs = original  # type: ignore[method-assign]
    assert report.missing == [] and report.unexpected == [], report
    expert_reads = [r for r in reads if ".experts." in r[0]]
    mine = {2 * rank, 2 * rank + 1}
    want = sorted(
        (f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight", 0, (24 * 16) * 4)
        for layer in range(2)
        for e in sorted(mine)
        for w in ("w1", "w2", "w3")
    )
    assert sorted(expert_reads) == want, (rank, sorted(expert_reads))
    for name, p in model.state_dict().items():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        assert torch.equal(full, ref[name]), name
    return {"expert_bytes": sum(n for _, _, n in expert_reads)}


def _merge_case(hub: str, root: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from unickpt import GeneralCheckpointIO, merge_checkpoint

    model = _sharded(_mixtral(seed=2))
    io = GeneralCheckpointIO()
    io.load_model(model, hub)
    ck = os.path.join(root, "sliced")
    io.save_model(model, ck, shard=True, gather_dtensor=False)
    gathered = os.path.join(root, "gathered")
    io.save_model(model, gathered, shard=True)  # each rank writes the experts it holds
    dist.barrier()
    if dist.get_rank() == 0:
        import json

        # The architecture as transformers names it, not the class FSDP2 made of it.
        with open(os.path.join(ck, "config.json")) as f:
            assert json.load(f)["architectures"] == ["MixtralForCausalLM"]
        out = os.path.join(root, "merged")
        merge_checkpoint(ck, out)

        def files(d: str) -> dict[str, torch.Tensor]:
            got: dict[str, torch.Tensor] = {}
            for p in glob.glob(os.path.join(d, "*.safetensors")):
                got.update(load_file(p))
            return got

        b = files(hub)
        for a in (files(out), files(gathered)):
            assert sorted(a) == sorted(b), (sorted(set(a) ^ set(b))[:6], os.listdir(ck))
            for k in a:
                assert torch.equal(a[k], b[k]), k
    dist.barrier()
    return {}


def moe_worker(hub: str, root: str) -> dict[str, Any]:
    return run_cases([("load", lambda: _load_case(hub)), ("merge", lambda: _merge_case(hub, root))])


@pytest.fixture(scope="module")
def results(world_pool: WorldPool, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("transformers")
    root: Path = tmp_path_factory.mktemp("moe")
    hub = root / "hub"
    _mixtral(seed=0).save_pretrained(hub)
    return world_pool.run(WORLD, "test_moe_mapping_dist:moe_worker", str(hub), str(root), timeout=240)[0]  # type: ignore[no-any-return]


@pytest.mark.parametrize("case", ["load", "merge"])
def test_fsdp2_hub_moe(results: dict[str, Any], case: str) -> None:
    res = results[case]
    if not res.ok:
        pytest.fail(f"case {case} failed:\n{res.error}", pytrace=False)
    if case == "load":
        # Two layers x two own experts x three projections of 24x16 float32.
        assert res.value["expert_bytes"] == 2 * 2 * 3 * 24 * 16 * 4
