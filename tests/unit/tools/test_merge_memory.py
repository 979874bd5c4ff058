"""merge and diff --deep run in bounded memory whatever size a header claims.

- bands (``tools/_bands.py``) tile every tensor in C order within their byte budget, and each
  slice's pieces inside them come in the slice's own storage order;
- a merge rebuilt band by band is bit-exact (every layout of ``hand_made_reference``, bands
  down to one element, casts, fingerprints) and still checks every slice hash;
- a sparse file whose header claims gigabytes (a few KB on disk) merges in a subprocess whose
  peak RSS stays a few tens of MB above its baseline, through both the streamed path (row
  blocks, whole tensors) and the band path (column splits), and the output is sparse too.
"""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import xxhash
from test_merge import _check_merged, hand_made_reference

from unickpt import merge_checkpoint
from unickpt.ckpt.reader import open_checkpoint
from unickpt.errors import IntegrityError
from unickpt.spec.naming import SLICED_SENTINEL
from unickpt.tools import _merge_tensors as merge_tensors
from unickpt.tools._bands import band_first, bands, pieces
from unickpt.tools._write import write_checkpoint
from unickpt.tools.diff import diff_checkpoints


@pytest.mark.parametrize(
    ("shape", "budget"),
    [((6, 10), 4), ((6, 10), 40), ((6, 10), 1 << 20), ((5, 3, 7), 12), ((5, 3, 7), 1), ((11,), 8), ((), 4)],
)
def test_bands_tile_the_tensor_in_order_within_budget(shape: tuple[int, ...], budget: int) -> None:
    isz = 4
    pos = 0
    for b in bands(shape, isz, budget):
        n = math.prod(b.shape)
        assert band_first(b, shape) == pos
        assert n * isz <= budget or n == 1
        pos += n
    assert pos == math.prod(shape)


def test_band_pieces_follow_each_slice_in_storage_order() -> None:
    shape = (5, 3, 7)
    boxes = [((0, 0, 0), (5, 3, 2)), ((0, 0, 2), (2, 3, 5)), ((2, 0, 2), (3, 1, 5)), ((2, 1, 2), (3, 2, 5))]
    for budget in (4, 12, 28, 84, 1 << 20):
        seen = [0] * len(boxes)
        for b in bands(shape, 4, budget):
            covered = 0
            for i, (o, s) in enumerate(boxes):
                p = pieces(b, o, s)
                if p is None:
                    continue
                assert p.first == seen[i]
                seen[i] += p.count
                covered += p.count
            assert covered == math.prod(b.shape)
        assert seen == [math.prod(s) for _, s in boxes]


@pytest.mark.parametrize("band_bytes", [1, 8, 40, 1 << 20])
def test_banded_merge_bit_exact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, band_bytes: int) -> None:
    monkeypatch.setattr(merge_tensors, "_BAND_BYTES", band_bytes)
    tensors, ref = hand_made_reference()
    src = tmp_path / "src"
    write_checkpoint(str(src), tensors, sliced=True, files=3)
    merge_checkpoint(src, tmp_path / "out")
    _check_merged(tmp_path / "out", ref)
    # Cast band by band: same bytes and fingerprints as casting the whole tensor.
    monkeypatch.setattr(merge_tensors, "_BAND_BYTES", 1 << 30)
    merge_checkpoint(src, tmp_path / "whole", dtype="bf16")
    monkeypatch.setattr(merge_tensors, "_BAND_BYTES", band_bytes)
    merge_checkpoint(src, tmp_path / "banded", dtype="bf16")
    a = (tmp_path / "whole" / "model.safetensors").read_bytes()
    assert a == (tmp_path / "banded" / "model.safetensors").read_bytes()
    assert diff_checkpoints(tmp_path / "whole", tmp_path / "banded", deep=True).identical


def test_banded_merge_checks_every_slice_hash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(merge_tensors, "_BAND_BYTES", 8)
    tensors, _ = hand_made_reference()
    src = tmp_path / "src"
    write_checkpoint(str(src), tensors, sliced=True, files=2)
    r = open_checkpoint(src)
    s = r.tensors["grid.2d"].slices[3]
    path, off, n = r.key_location(s.file, s.key)
    r.close()
    with open(path, "r+b") as f:  # the last byte of the last slice: only the last band sees it
        f.seek(off + n - 1)
        b = f.read(1)
        f.seek(off + n - 1)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(IntegrityError) as ei:
        merge_checkpoint(src, tmp_path / "out")
    assert ei.value.tensor == "grid.2d" and ei.value.file == s.file
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------ sparse files
def _supports_sparse(d: Path) -> bool:
    p = d / "probe"
    with open(p, "wb") as f:
        f.truncate(64 << 20)
    ok = os.stat(p).st_blocks * 512 < (1 << 20)
    p.unlink()
    return ok


def _sparse_st(path: Path, header: dict[str, object], data_len: int, pokes: dict[int, bytes]) -> int:
    """A safetensors file of ``data_len`` data bytes, all holes but ``pokes`` (data offset -> bytes)."""
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-(8 + len(h)) % 8)
    start = 8 + len(h)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        f.truncate(start + data_len)
        for at, b in pokes.items():
            f.seek(start + at)
            f.write(b)
    return start


# Peak RSS of the merge alone: VmHWM after resetting it (clear_refs 5) once the imports are done.
# ru_maxrss would also count the parent's pages the child held between fork and exec.
_RSS_SCRIPT = textwrap.dedent(
    """
    import sys
    import huggingface_hub  # noqa: F401  (imported by the merge: part of the baseline)
    from unickpt.tools.merge import merge_checkpoint
    def status_kb(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1])
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = status_kb("VmRSS")
    merge_checkpoint(sys.argv[1], sys.argv[2])
    print(base, status_kb("VmHWM"))
    """
)


def _merge_peak_mb(src: Path, out: Path) -> float:
    res = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, str(src), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    base, peak = map(int, res.stdout.split())
    return (peak - base) / 1024


@pytest.mark.timeout(300)
@pytest.mark.parametrize("gib", [1, pytest.param(64, marks=pytest.mark.slow)])
def test_sparse_whole_tensor_merges_in_bounded_memory(tmp_path: Path, gib: int) -> None:
    if not _supports_sparse(tmp_path) or not os.path.exists("/proc/self/status"):
        pytest.skip("the temporary file system does not keep files sparse (or no /proc)")
    rows, cols = gib << 10, 1 << 18  # F32: 1 MiB rows
    n = rows * cols * 4
    src = tmp_path / "src"
    src.mkdir()
    pokes = {0: b"\x01\x02\x03\x04", n // 2 + 4: b"\xaa\xbb\xcc\xdd", n - 4: b"\x7f\x7f\x7f\x7f"}
    _sparse_st(
        src / "model.safetensors",
        {
            "__metadata__": {"format": "pt"},
            "w": {"dtype": "F32", "shape": [rows, cols], "data_offsets": [0, n]},
        },
        n,
        pokes,
    )
    out = tmp_path / "out"
    grew = _merge_peak_mb(src, out)
    assert grew < 64, f"merge of a {gib} GiB sparse tensor grew RSS by {grew:.0f} MB"
    p = out / "model.safetensors"
    r = open_checkpoint(out)
    _, off, length = r.key_location(r.tensors["w"].table.file(0), r.tensors["w"].table.key(0))
    assert length == n and os.path.getsize(p) == off + n
    with open(p, "rb") as f:
        for at, b in pokes.items():
            assert os.pread(f.fileno(), len(b), off + at) == b
        assert os.pread(f.fileno(), 8, off + n // 4) == bytes(8)
    assert os.stat(p).st_blocks * 512 < (32 << 20), "the holes of the source were written out"
    # The recorded hash is that of the whole content, holes included (computed here without the file).
    h = xxhash.xxh3_64()
    zeros = bytes(16 << 20)
    pos = 0
    for at, b in sorted(pokes.items()):
        while pos < at:
            k = min(len(zeros), at - pos)
            h.update(zeros[:k])
            pos += k
        h.update(b)
        pos += len(b)
    assert pos == n
    assert r.tensors["w"].slices[0].xxh3 == h.hexdigest()
    r.close()


@pytest.mark.timeout(300)
def test_sparse_column_split_merges_band_by_band_in_bounded_memory(tmp_path: Path) -> None:
    """Two column halves of a 1 GiB F32 tensor, in sparse files: the band path, not one buffer."""
    if not _supports_sparse(tmp_path) or not os.path.exists("/proc/self/status"):
        pytest.skip("the temporary file system does not keep files sparse (or no /proc)")
    rows, half = 1 << 10, 1 << 17  # 1024 x 2 x 128 Ki F32 = 1 GiB
    n = rows * half * 4
    src = tmp_path / "src"
    src.mkdir()
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for k, f in enumerate(files):
        hdr = {
            "__metadata__": {"format": "unickpt-sliced"},
            f"w@{k}": {"dtype": "F32", "shape": [rows, half], "data_offsets": [0, n]},
        }
        _sparse_st(src / f, hdr, n, {0: struct.pack("<f", 1.0 + k), n - 4: struct.pack("<f", 3.0 + k)})
    index = {
        "metadata": {"total_size": 2 * n},
        "weight_map": {"w": SLICED_SENTINEL},
        "unickpt": {
            "kind": "model",
            "layout": {"gathered": False},
            "tensors": {
                "w": {
                    "dtype": "F32",
                    "shape": [rows, 2 * half],
                    "slices": [
                        {"file": files[k], "key": f"w@{k}", "offsets": [0, k * half], "shape": [rows, half]}
                        for k in range(2)
                    ],
                }
            },
        },
    }
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    out = tmp_path / "out"
    grew = _merge_peak_mb(src, out)
    assert grew < 64, f"band merge of a 1 GiB column-split tensor grew RSS by {grew:.0f} MB"
    r = open_checkpoint(out)
    _, off, _n = r.key_location(r.tensors["w"].table.file(0), r.tensors["w"].table.key(0))
    p = out / "model.safetensors"
    with open(p, "rb") as f:
        row_bytes = 2 * half * 4

        def at(row: int, col: int) -> float:
            return float(struct.unpack("<f", os.pread(f.fileno(), 4, off + row * row_bytes + col * 4))[0])

        assert (at(0, 0), at(0, half), at(rows - 1, half - 1), at(rows - 1, 2 * half - 1)) == (
            1.0,
            2.0,
            3.0,
            4.0,
        )
        assert at(rows // 2, 5) == 0.0
    assert os.stat(p).st_blocks * 512 < (64 << 20)
    r.close()
