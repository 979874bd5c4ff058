"""Gathered saves without a rank-0 funnel (issue 19): every rank writes its own bytes of the
Hugging Face files, under every plugin, in one world of 4 running many cases
(``_hf_parallel_worker``): FSDP2, ZeRO-1 (flat ranges), FSDP2 over TP (``_StridedShard``),
DDP over TP, PP over TP and DDP. Each case checks the files bit for bit against the full
tensors, byte for byte against the rank-0 gathered save's files, ``verify`` clean, and a reload
with every range checked; then a flipped byte is pinpointed to its range, and a transformers
model saved under FSDP2 x4 loads in ``from_pretrained`` bit for bit.
"""

from __future__ import annotations

from typing import Any

import pytest
from harness import WorldPool

# Plain TP over 4 ranks cannot train PipeNet (34 columns); TP runs under the hybrids (Shard(1)
# row-parallel weights, moved to row slices before they are written).
LAYOUTS = ["fsdp2x4", "zero1x4", "hyb_fsdp_dp2tp2", "hyb_ddp_dp2tp2", "hyb_pp2tp2", "ddp4"]
TIMEOUT_S = 300.0
pytestmark = pytest.mark.timeout(TIMEOUT_S + 60)


def test_every_plugin_writes_its_own_bytes(tmp_path: Any, world_pool: WorldPool) -> None:
    results = world_pool.run(4, "_hf_parallel_worker:world_worker", str(tmp_path), LAYOUTS, timeout=TIMEOUT_S)
    cases = results[0]
    failed = {name: c.error for name, c in cases.items() if not c.ok}
    assert not failed, "\n\n".join(f"{k}:\n{v}" for k, v in failed.items())
    # Several ranks wrote the row-sharded tensors: their index records ranges (one per rank's run).
    assert cases["layout fsdp2x4"].value["model"]["blocks.0.up.weight"] == 4
    # ZeRO's flat ranges: each rank's range of a state tensor is one contiguous run.
    zero = cases["layout zero1x4"].value["optim"]
    assert zero and all(n <= 4 for n in zero.values()), zero
    # DDP: every tensor is written whole by one rank (replicas written once), so no ranges.
    assert cases["layout ddp4"].value == {"model": {}, "optim": {}}
    assert "blocks.0.up.weight" in cases["flipped byte"].value
    # TP's row-parallel weights (Shard(1), [16, 34]) are moved to row slices before they are
    # written (io/hf_rows.py): one range per writing rank, not one per row and rank (32).
    for lay in ("hyb_fsdp_dp2tp2", "hyb_ddp_dp2tp2", "hyb_pp2tp2"):
        got = cases[f"layout {lay}"].value
        many = {k: n for sub in ("model", "optim") for k, n in got[sub].items() if n > 4}
        assert not many, (lay, many)
    # DDP over TP: the dp replicas are written once, each TP rank its half of the rows.
    assert cases["layout hyb_ddp_dp2tp2"].value["model"]["blocks.0.down.weight"] == 2
    assert cases["layout hyb_fsdp_dp2tp2"].value["model"]["blocks.0.down.weight"] == 4
    # An async gathered save (moves in the foreground) writes the synchronous save's files.
    assert cases["async rows"].value["blocks.0.down.weight"] == 2
