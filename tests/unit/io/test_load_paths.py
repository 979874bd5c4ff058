"""Load reads blocks in place, and only what each block needs, on every read path: a whole stored
slice, a contiguous row range of one, a column range (through safetensors), a destination that is
not contiguous or has another dtype. In-place loads add one block's memory, atomic loads a share's."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from unickpt import GeneralCheckpointIO
from unickpt.ckpt.reader import open_checkpoint
from unickpt.io.load import _Files, read_box
from unickpt.spec.boxes import contiguous_start


def test_contiguous_start_detection() -> None:
    assert contiguous_start((4, 6), (1, 0), (2, 6)) == 6  # rows 1..2, full width
    assert contiguous_start((4, 6), (1, 2), (1, 3)) == 8  # part of one row
    assert contiguous_start((4, 6), (1, 2), (2, 3)) is None  # a column range of two rows
    assert contiguous_start((2, 1, 5), (1, 0, 0), (1, 1, 5)) == 5
    assert contiguous_start((3, 4, 5), (0, 1, 0), (2, 3, 5)) is None
    assert contiguous_start((3, 4, 5), (1, 0, 0), (2, 4, 5)) == 20
    assert contiguous_start((), (), ()) == 0


def _sliced_checkpoint(tmp_path: Path, full: torch.Tensor) -> Path:
    """A checkpoint of ``w`` stored as two row blocks (as FSDP saves it)."""
    from unickpt.io.save import SaveOptions, save_tensors
    from unickpt.io.tensors import LocalSlice
    from unickpt.spec.index import LayoutInfo

    def boxes(name: str, t: torch.Tensor) -> list[LocalSlice]:
        half = full.shape[0] // 2
        return [
            LocalSlice(name, "F32", tuple(full.shape), (0, 0), (half, full.shape[1]), full[:half]),
            LocalSlice(
                name, "F32", tuple(full.shape), (half, 0), (full.shape[0] - half, full.shape[1]), full[half:]
            ),
        ]

    out = tmp_path / "ckpt"
    save_tensors({"w": full}, str(out), SaveOptions("model", True, False, 1024, LayoutInfo()), boxes)
    return out


@pytest.mark.parametrize(
    ("offsets", "shape"),
    [
        ((0, 0), (6, 8)),  # whole tensor across both stored slices
        ((0, 0), (3, 8)),  # exactly one stored slice
        ((2, 0), (3, 8)),  # rows across the boundary
        ((1, 2), (4, 5)),  # a column range: through get_slice
        ((5, 7), (1, 1)),
    ],
)
def test_read_box_is_exact_on_every_path(
    tmp_path: Path, offsets: tuple[int, int], shape: tuple[int, int]
) -> None:
    full = torch.arange(48, dtype=torch.float32).reshape(6, 8) * 1.5
    ckpt = _sliced_checkpoint(tmp_path, full)
    reader = open_checkpoint(ckpt)
    assert len(reader.tensors["w"].slices) == 2
    want = full[offsets[0] : offsets[0] + shape[0], offsets[1] : offsets[1] + shape[1]]
    files = _Files(reader)
    try:
        got = read_box(files, reader.tensors["w"], offsets, shape)
        assert torch.equal(got, want)
        into = torch.full(shape, -1.0)
        assert read_box(files, reader.tensors["w"], offsets, shape, out=into) is into
        assert torch.equal(into, want)
    finally:
        files.close()
        reader.close()


# Its own model: a non-contiguous parameter (loads read it through a buffer) is what it checks.
class _M(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(16, 12))
        self.b = nn.Parameter(torch.randn(12, 16).t())  # not contiguous: read through a buffer
        self.register_buffer("c", torch.arange(7, dtype=torch.int64))


@pytest.mark.parametrize("atomic", [False, True])
def test_in_place_and_atomic_loads_are_bit_exact(tmp_path: Path, atomic: bool) -> None:
    torch.manual_seed(0)
    src = _M()
    GeneralCheckpointIO().save_model(src, tmp_path / "m", shard=True)
    dst = _M()
    b_storage = dst.b.data_ptr()
    GeneralCheckpointIO(atomic_load=atomic).load_model(dst, tmp_path / "m", verify=True)
    for k, v in src.state_dict().items():
        assert torch.equal(v, dst.state_dict()[k]), k
    assert dst.b.data_ptr() == b_storage and not dst.b.is_contiguous()


def test_dtype_cast_load_in_place(tmp_path: Path) -> None:
    src = nn.Linear(8, 4).to(torch.bfloat16)
    GeneralCheckpointIO().save_model(src, tmp_path / "m", shard=True)
    dst = nn.Linear(8, 4)
    GeneralCheckpointIO().load_model(dst, tmp_path / "m", allow_dtype_cast=True)
    assert torch.equal(dst.weight, src.weight.float())


def test_blocks_not_read_in_place_share_two_pooled_buffers(tmp_path: Path) -> None:
    """A cast load of twelve tensors goes through the load's two host buffers of the pool (the
    code a CUDA load runs, its device step a copy on CPU): two allocations, none larger than the
    largest block, handed back after the load and reused by the next one."""
    from unickpt.io.pinned import POOL

    torch.manual_seed(0)
    src = nn.Sequential(*[nn.Linear(16, 16, bias=False) for _ in range(12)]).to(torch.bfloat16)
    GeneralCheckpointIO().save_model(src, tmp_path / "m", shard=True)
    POOL.release()
    try:
        for again in (False, True):
            before = POOL.allocations
            dst = nn.Sequential(*[nn.Linear(16, 16, bias=False) for _ in range(12)])
            GeneralCheckpointIO().load_model(dst, tmp_path / "m", allow_dtype_cast=True)
            for a, b in zip(src.parameters(), dst.parameters(), strict=True):
                assert torch.equal(b, a.float())
            (held,) = [s for s in POOL.sets() if s.tag == "load"]
            assert not held.leased and len(held) == 2 and held.nbytes == 2 * 16 * 16 * 2
            assert POOL.allocations == (before if again else 2)
    finally:
        POOL.release()


_MEASURE = textwrap.dedent(
    """
    import json, sys, torch
    from torch import nn
    from unickpt import GeneralCheckpointIO

    def hwm():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM"):
                return int(line.split()[1]) * 1024
    def reset():
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    model = nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(16)])  # 64 MiB
    GeneralCheckpointIO(atomic_load=sys.argv[2] == "1").load_model(model, sys.argv[1])
    model2 = nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(16)])
    reset(); base = hwm()
    GeneralCheckpointIO(atomic_load=sys.argv[2] == "1").load_model(model2, sys.argv[1])
    print(json.dumps({"added": hwm() - base}))
    """
)


def test_in_place_load_adds_no_copy_of_the_model(tmp_path: Path) -> None:
    model = nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(16)])
    GeneralCheckpointIO().save_model(model, tmp_path / "m", shard=True, size_per_shard=16)
    size = 64 << 20
    added = {}
    for atomic in ("0", "1"):
        out = subprocess.run(
            [sys.executable, "-c", _MEASURE, str(tmp_path / "m"), atomic],
            capture_output=True,
            text=True,
            check=True,
        )
        added[atomic] = json.loads(out.stdout)["added"]
    # In place: file reads land in the parameters (no mapping, no staging copy).
    assert added["0"] < 0.15 * size, added
    # Atomic: the whole share is staged in CPU memory before copying.
    assert added["1"] > 0.9 * size, added
