"""Multipart uploads shared by ranks (store/storage_parts.py) and a gathered save that uses them
on a real S3 API (moto's server) in one process: parts planned by owner, files of several parts
byte-identical to a local gathered save, single-part files one PUT, stores without shared
uploads keep the rank-0 funnel."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

from unickpt.io import GeneralCheckpointIO
from unickpt.store import storage_parts
from unickpt.store.storage import FsspecStorage, LocalStorage
from unickpt.store.storage_parts import MAX_PARTS, MIN_PART, part_size_for, plan_parts, supports_shared_parts

MiB = 1 << 20


def test_part_size_is_raised_to_fit_10000_parts() -> None:
    assert part_size_for(1, 8 * MiB) == 8 * MiB
    assert part_size_for(100 * MiB, 1 * MiB) == MIN_PART  # S3's minimum part
    huge = 200_000 * MiB  # 25000 parts of 8 MiB
    p = part_size_for(huge, 8 * MiB)
    assert p % MiB == 0 and -(-huge // p) <= MAX_PARTS and -(-huge // (p - MiB)) > MAX_PARTS


def test_parts_go_to_the_rank_holding_most_bytes_ties_to_the_least_loaded() -> None:
    # A 50-byte file in parts of 20: header 0-4 (rank 0), rank 1 holds 4-30, rank 2 30-50.
    load = [0, 0, 0]
    parts = plan_parts(50, [(0, 4, 0), (4, 30, 1), (30, 50, 2)], 20, load)
    assert [(p.number, p.start, p.end, p.owner) for p in parts] == [
        (1, 0, 20, 1),
        (2, 20, 40, 2),
        (3, 40, 50, 2),
    ]
    assert parts[0].runs == ((0, 4, 0), (4, 20, 1))
    assert parts[1].runs == ((20, 30, 1), (30, 40, 2))
    assert load == [0, 20, 30]
    # Column slices: every part holds equal shares; the parts spread over the ranks.
    runs = [(b, b + 5, (b // 5) % 2) for b in range(0, 80, 5)]
    owners = [p.owner for p in plan_parts(80, runs, 10, [0, 0])]
    assert owners == [0, 1, 0, 1, 0, 1, 0, 1]
    # Within its share: rank 1 holds most of every part, but a rank past its cap gets no more.
    load = [0, 0, 0]
    parts = plan_parts(60, [(0, 2, 0), (2, 56, 1), (56, 60, 2)], 10, load, cap=25)
    assert [p.owner for p in parts] == [1, 1, 0, 2, 0, 2]
    assert load == [20, 20, 20]
    # A single file's first part (its header is written last) is rank 0's whatever it holds.
    assert plan_parts(50, [(0, 4, 0), (4, 50, 1)], 20, [0, 0], first_owner=0)[0].owner == 0
    with pytest.raises(ValueError, match=r"do not cover bytes \[20, 40\)"):
        plan_parts(50, [(0, 4, 0), (4, 30, 1), (35, 50, 2)], 20, [0, 0, 0])


def test_only_s3_shares_uploads(tmp_path: Path) -> None:
    assert supports_shared_parts(FsspecStorage(fsspec.filesystem("s3", anon=True), "s3://b/x"))
    assert not supports_shared_parts(FsspecStorage(fsspec.filesystem("memory"), "memory://x"))
    assert not supports_shared_parts(FsspecStorage(fsspec.filesystem("file"), f"file://{tmp_path}"))
    assert not supports_shared_parts(LocalStorage(str(tmp_path)))
    assert not supports_shared_parts(None)


# Its own model: its size (S3 parts, a tensor across a part boundary) is what it checks.
class Big(torch.nn.Module):
    """About 7.5 MiB: two parts of 5 MiB (S3's minimum), a tensor across the boundary."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.a = torch.nn.Linear(1000, 1500)
        self.b = torch.nn.Linear(1500, 301)
        self.c = torch.nn.Linear(301, 3)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))


def _without_id(data: bytes, sid: str) -> bytes:
    return data.replace(sid.encode(), b"0" * len(sid))


@pytest.mark.parametrize("shard", [True, False])
def test_gathered_save_on_s3_in_parts_is_byte_identical_to_the_local_one(
    s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shard: bool
) -> None:
    from unickpt.ckpt.reader import open_checkpoint

    monkeypatch.setattr(storage_parts, "PART_SIZE", MIN_PART)
    model = Big()
    io = GeneralCheckpointIO(storage_options=s3.storage_options("w"))
    local = tmp_path / "local"
    target = "" if shard else "/model.safetensors"
    io.save_model(model, f"{local}{target}", shard=shard, size_per_shard=10)
    io.save_model(model, f"s3://{s3.bucket}/p{target}", shard=shard, size_per_shard=10)
    fs = fsspec.filesystem("s3", **s3.storage_options("check"))
    fs.invalidate_cache()
    fs.get(f"{s3.bucket}/p/", str(tmp_path / "dl") + "/", recursive=True)
    names = sorted(p.name for p in local.iterdir())
    assert names == sorted(p.name for p in (tmp_path / "dl").iterdir())
    with open_checkpoint(local, "model") as r:
        sid_local = r.block.save_id
    with open_checkpoint(tmp_path / "dl", "model") as r:
        sid_s3 = r.block.save_id
        assert r.verify() == []
    assert sid_local and sid_s3 and sid_local != sid_s3
    for n in names:
        a = _without_id((local / n).read_bytes(), sid_local)
        b = _without_id((tmp_path / "dl" / n).read_bytes(), sid_s3)
        assert a == b, n
    # The file of two parts went up as a multipart upload (its create and complete are POSTs).
    assert s3.requests[("POST", "w")] >= 2
    assert fs.call_s3("list_multipart_uploads", Bucket=s3.bucket).get("Uploads", []) == []


@pytest.mark.parametrize(
    "stage",
    [
        pytest.param("save.hf_create", marks=pytest.mark.slow),
        "save.hf_write",
        pytest.param("save.commit", marks=pytest.mark.slow),
    ],
)
def test_failed_save_in_parts_aborts_every_upload_and_keeps_the_previous(
    s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stage: str
) -> None:
    from unickpt._faults import InjectedFault, injected

    monkeypatch.setattr(storage_parts, "PART_SIZE", MIN_PART)
    io = GeneralCheckpointIO(storage_options=s3.storage_options("w"))
    url = f"s3://{s3.bucket}/f"
    io.save_model(Big(), url, shard=True, size_per_shard=10)
    fs = fsspec.filesystem("s3", **s3.storage_options("check"))
    fs.invalidate_cache()
    before = {p: fs.cat_file(p) for p in fs.find(f"{s3.bucket}/f")}
    changed = Big()
    with torch.no_grad():
        changed.a.weight.add_(1)
    with injected(stage, 0), pytest.raises(InjectedFault, match=f"'{stage}'"):
        io.save_model(changed, url, shard=True, size_per_shard=10)
    fs.invalidate_cache()
    assert {p: fs.cat_file(p) for p in fs.find(f"{s3.bucket}/f")} == before
    assert fs.call_s3("list_multipart_uploads", Bucket=s3.bucket).get("Uploads", []) == []
    m = Big()
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
    GeneralCheckpointIO().load_model(m, _download(fs, f"{s3.bucket}/f", tmp_path / "dl"), verify=True)
    assert all(
        torch.equal(a, b) for a, b in zip(m.state_dict().values(), Big().state_dict().values(), strict=True)
    )


def _download(fs: Any, prefix: str, dest: Path) -> Path:
    fs.get(prefix + "/", str(dest) + "/", recursive=True)
    return dest


@pytest.mark.parametrize("stage", ["save.hf_write", pytest.param("save.commit", marks=pytest.mark.slow)])
def test_failed_single_file_save_keeps_the_old_file(s3: Any, stage: str) -> None:
    """A single file of one part is put at the commit: a failure before it leaves the old file."""
    from unickpt._faults import InjectedFault, injected

    io = GeneralCheckpointIO(storage_options=s3.storage_options("w"))
    url = f"s3://{s3.bucket}/one/model.safetensors"
    io.save_model(torch.nn.Linear(5, 3), url)
    fs = fsspec.filesystem("s3", **s3.storage_options("check"))
    old = fs.cat_file(f"{s3.bucket}/one/model.safetensors")
    with injected(stage, 0), pytest.raises(InjectedFault):
        io.save_model(torch.nn.Linear(5, 3), url)
    fs.invalidate_cache()
    assert fs.find(f"{s3.bucket}/one") == [f"{s3.bucket}/one/model.safetensors"]
    assert fs.cat_file(f"{s3.bucket}/one/model.safetensors") == old
