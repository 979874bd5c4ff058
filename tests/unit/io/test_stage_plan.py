"""What an async save stages (io/stage.py), as pure functions: the writers the save itself picks,
the boxes several ranks hold, and the digest of a replica that is not copied."""

from __future__ import annotations

import pytest
import torch
import xxhash

from unickpt.io.planner import plan_save
from unickpt.io.replicas import digest_live, replica_digests
from unickpt.io.stage import written_keys
from unickpt.io.tensors import LocalSlice, Staged, as_bytes


def _ddp_metas(world: int) -> list[list[tuple]]:
    boxes = [
        ("a", "F32", (8, 4), (0, 0), (8, 4)),
        ("b", "F32", (3,), (0,), (3,)),
        ("c", "BF16", (5, 5), (0, 0), (5, 5)),
    ]
    return [list(boxes) for _ in range(world)]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_replica_is_staged_by_its_writer_only(world: int) -> None:
    metas = _ddp_metas(world)
    plan = plan_save(metas, kind="model", size_per_shard_bytes=1 << 20, sliced=False)
    staged = [written_keys(metas, r)[0] for r in range(world)]
    for name, sls in plan.slices.items():
        (ps,) = sls
        holders = [
            r for r in range(world) if ps.local_index in staged[r] and metas[r][ps.local_index][0] == name
        ]
        assert holders == [ps.rank], (name, holders, ps.rank)
    assert sum(len(s) for s in staged) == 3
    replicated = written_keys(metas, 0)[1]
    assert replicated == (
        frozenset({("a", (0, 0), (8, 4)), ("b", (0,), (3,)), ("c", (0, 0), (5, 5))})
        if world > 1
        else frozenset()
    )


def test_sharded_slices_are_not_replicated_and_each_rank_stages_its_own() -> None:
    # FSDP-like: rows split over 2 ranks, plus a bias both hold.
    r0 = [("w", "F32", (4, 2), (0, 0), (2, 2)), ("bias", "F32", (2,), (0,), (2,))]
    r1 = [("w", "F32", (4, 2), (2, 0), (2, 2)), ("bias", "F32", (2,), (0,), (2,))]
    mine0, rep = written_keys([r0, r1], 0)
    mine1, _ = written_keys([r0, r1], 1)
    assert rep == frozenset({("bias", (0,), (2,))})
    assert 0 in mine0 and 0 in mine1  # each writes its own rows
    assert (1 in mine0) != (1 in mine1)  # the bias: exactly one of them


def test_digest_live_is_the_xxh3_of_the_c_order_bytes() -> None:
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    view = t.t()  # not contiguous: digested in C order of the view
    assert digest_live(t) == xxhash.xxh3_64_hexdigest(t.numpy().tobytes())
    assert digest_live(view) == xxhash.xxh3_64_hexdigest(view.contiguous().numpy().tobytes())
    assert digest_live(torch.empty(0, 3)) is None


def test_a_staged_report_digests_replicated_boxes_only() -> None:
    a = torch.ones(4)
    b = torch.arange(3.0)
    meta = torch.empty(2, device="meta")
    slices = {
        "a": [LocalSlice("a", "F32", (4,), (0,), (4,), a)],  # replicated, written here: digested now
        "b": [LocalSlice("b", "F32", (3,), (0,), (3,), b)],  # held here alone: presence only
        "c": [LocalSlice("c", "F32", (2,), (0,), (2,), meta)],  # replicated, written elsewhere
    }
    staged = Staged(
        4 * 4 + 3 * 4, frozenset({("a", (0,), (4,)), ("c", (0,), (2,))}), {("c", (0,), (2,)): "feed"}
    )
    got = replica_digests(slices, staged)
    assert got == {
        ("a", (0,), (4,)): xxhash.xxh3_64_hexdigest(memoryview(as_bytes(a))),
        ("b", (0,), (3,)): "held",
        ("c", (0,), (2,)): "feed",
    }
    # Without staging information every slice held is digested, as a synchronous save does.
    assert set(replica_digests({k: v for k, v in slices.items() if k != "c"})) == {
        ("a", (0,), (4,)),
        ("b", (0,), (3,)),
    }
