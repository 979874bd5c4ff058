"""Format version 2 (fingerprint v2) beside version 1 checkpoints: saves write v2, v1 indexes
still load, verify and merge with their own fingerprints, a v1 fingerprint is never compared with
a v2 one, and ``diff --deep`` compares the data itself, streamed, with the first difference."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from unickpt import GeneralCheckpointIO, diff_checkpoints, merge_checkpoint
from unickpt.format.digest_text import hex_to_b64
from unickpt.format.hashing import fingerprint_of_array
from unickpt.format.index import FORMAT_VERSION
from unickpt.format.index_compact import as_listed, as_version
from unickpt.format.reader import open_checkpoint
from unickpt.tools import _compare
from unickpt.tools._write import SliceData, TensorData, write_checkpoint

INDEX = "model.safetensors.index.json"


def _sliced(a: np.ndarray, dtype: str, boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> TensorData:
    sl = [
        SliceData(o, s, np.ascontiguousarray(a[tuple(slice(x, x + k) for x, k in zip(o, s, strict=True))]))
        for o, s in boxes
    ]
    return TensorData(dtype, a.shape, sl)


def _weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal((40, 30)).astype(np.float32),
        "d": rng.standard_normal((6, 5)).astype(np.float64),
        "s": np.array(2.5, dtype=np.float32),
    }


DT = {"w": "F32", "d": "F64", "s": "F32"}


def _write(path: Path, w: dict[str, np.ndarray], how: str) -> Path:
    t = {}
    for n, a in w.items():
        if a.ndim == 0 or how == "whole":
            boxes = [((0,) * a.ndim, a.shape)]
        elif how == "cols":
            c = a.shape[1] // 2
            boxes = [((0, 0), (a.shape[0], c)), ((0, c), (a.shape[0], a.shape[1] - c))]
        else:  # rows
            r = a.shape[0] // 3
            boxes = [((0, 0), (r, a.shape[1])), ((r, 0), (a.shape[0] - r, a.shape[1]))]
        t[n] = _sliced(a, DT[n], boxes)
    write_checkpoint(str(path), t, sliced=how != "whole", files=2)
    return path


def _to_v1(path: Path, w: dict[str, np.ndarray]) -> None:
    """Rewrite a checkpoint's index as format version 1 would have: v1 fingerprints."""
    f = path / INDEX
    obj = as_listed(json.loads(f.read_text()), 1)
    for n, e in obj["unickpt"]["tensors"].items():
        e["fingerprint"] = fingerprint_of_array(n, DT[n], w[n].tobytes(), list(w[n].shape), version=1)
    f.write_text(json.dumps(obj))


def test_saves_write_format_version_5_with_v2_fingerprints(tmp_path: Path) -> None:
    assert FORMAT_VERSION == 5
    torch.manual_seed(0)
    m = torch.nn.Linear(6, 4)
    GeneralCheckpointIO().save_model(m, tmp_path / "c", shard=True, gather_dtensor=False)
    obj = json.loads((tmp_path / "c" / INDEX).read_text())
    assert obj["unickpt"]["format_version"] == 5
    for n, t in m.state_dict().items():
        raw = t.detach().contiguous().view(torch.uint8).numpy().tobytes()
        fp = fingerprint_of_array(n, "F32", raw, list(t.shape))
        assert obj["unickpt"]["tensors"][n]["fingerprint"] == hex_to_b64(fp)  # 11 base64url characters


def test_v1_checkpoints_still_load_and_verify(tmp_path: Path) -> None:
    torch.manual_seed(1)
    m = torch.nn.Linear(5, 3)
    io = GeneralCheckpointIO()
    io.save_model(m, tmp_path / "c", shard=True, gather_dtensor=True)
    w = {n: t.detach().numpy().copy() for n, t in m.state_dict().items()}
    f = tmp_path / "c" / INDEX
    obj = as_listed(json.loads(f.read_text()), 1)
    for n, e in obj["unickpt"]["tensors"].items():
        e["fingerprint"] = fingerprint_of_array(n, "F32", w[n].tobytes(), list(w[n].shape), version=1)
    f.write_text(json.dumps(obj))
    m2 = torch.nn.Linear(5, 3)
    io.load_model(m2, tmp_path / "c", verify=True)
    assert all(
        torch.equal(a, b) for a, b in zip(m.state_dict().values(), m2.state_dict().values(), strict=True)
    )
    with open_checkpoint(tmp_path / "c") as r:
        assert r.block.format_version == 1
    # the v1 fingerprints are checked with v1 (and hold); deep diff against itself finds nothing
    rep = diff_checkpoints(tmp_path / "c", tmp_path / "c", deep=True)
    assert rep.identical and not rep.integrity_failures, rep.format()


def test_v1_against_v2_is_computed_or_incomparable_with_index_only(tmp_path: Path) -> None:
    w = _weights()
    a = _write(tmp_path / "a", w, "rows")
    b = _write(tmp_path / "b", w, "cols")
    _to_v1(a, w)
    # By default B's fingerprints are computed from its data with A's algorithm (v1).
    computed = diff_checkpoints(a, b)
    assert computed.identical and sorted(computed.same) == sorted(w), computed.format()
    rep = diff_checkpoints(a, b, index_only=True)
    assert rep.fingerprint_versions == (1, 2)
    assert sorted(rep.incomparable) == sorted(w) and not rep.same and not rep.changed
    assert rep.exit_code == 2 and not rep.identical
    text = rep.format()
    assert "fingerprints cannot be compared (A has fingerprint v1, B v2: different algorithms" in text
    assert "--deep" in text
    assert rep.to_dict()["incomparable"] == rep.incomparable
    deep = diff_checkpoints(a, b, deep=True)
    assert deep.identical and not deep.integrity_failures, deep.format()
    # v1 against v1 compares by fingerprint again
    _to_v1(b, w)
    assert diff_checkpoints(a, b).identical


def test_v1_collision_is_caught_by_deep_only(tmp_path: Path) -> None:
    """Two sign flips in an F64 tensor cancel in v1 (documented flaw): the index-only diff of two
    version 1 checkpoints says 'same'; --deep compares the data and names both elements."""
    w = _weights()
    w2 = {k: v.copy() for k, v in w.items()}
    w2["d"][1, 2] = -w2["d"][1, 2]
    w2["d"][4, 0] = -w2["d"][4, 0]
    a = _write(tmp_path / "a", w, "rows")
    b = _write(tmp_path / "b", w2, "cols")
    assert diff_checkpoints(a, b).changed == ["d"]  # v2 sees it from the index alone
    _to_v1(a, w)
    _to_v1(b, w2)
    assert diff_checkpoints(a, b).identical  # v1 cannot
    deep = diff_checkpoints(a, b, deep=True)
    assert deep.changed == ["d"] and not deep.integrity_failures
    (d,) = deep.data_differences
    assert (d.name, d.first_index, d.first_flat, d.count, d.numel) == ("d", [1, 2], 7, 2, 30)
    assert "d: 2 of 30 element(s) differ, first at index [1, 2] (flat 7)" in deep.format()


@pytest.mark.parametrize("chunk_bytes", [4, 28, 1000, 16 << 20])
def test_deep_diff_streams_and_counts_every_difference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk_bytes: int
) -> None:
    """Chunks much smaller than a row, a row, or the tensor: same first index and count."""
    monkeypatch.setattr(_compare, "CHUNK_BYTES", chunk_bytes)
    w = _weights(3)
    w2 = {k: v.copy() for k, v in w.items()}
    flat = w2["w"].reshape(-1)
    changed = [17, 18, 599, 600, 1199]
    flat[changed] = np.float32(-0.0)  # -0.0 differs from anything but itself, bit for bit
    flat[[3]] = w["w"].reshape(-1)[3]  # writing the same value back changes nothing
    a = _write(tmp_path / "a", w, "cols")
    b = _write(tmp_path / "b", w2, "rows")
    deep = diff_checkpoints(a, b, deep=True)
    (d,) = deep.data_differences
    assert (d.first_flat, d.first_index, d.count) == (17, [0, 17], 5)
    assert deep.changed == ["w"] and sorted(deep.same) == ["d", "s"]


def test_deep_diff_compares_bits_not_values(tmp_path: Path) -> None:
    w = {"w": np.zeros((3, 4), np.float32), "d": np.zeros((6, 5)), "s": np.array(0.0, np.float32)}
    w2 = {k: v.copy() for k, v in w.items()}
    w2["s"] = np.array(-0.0, np.float32)  # equal as numbers, different bits
    a = _write(tmp_path / "a", w, "whole")
    b = _write(tmp_path / "b", w2, "whole")
    deep = diff_checkpoints(a, b, deep=True)
    assert deep.changed == ["s"]
    (d,) = deep.data_differences
    assert (d.first_index, d.count, d.numel) == ([], 1, 1)


def test_deep_diff_names_a_wrong_v1_fingerprint(tmp_path: Path) -> None:
    w = _weights()
    a = _write(tmp_path / "a", w, "rows")
    _to_v1(a, w)
    obj = json.loads((a / INDEX).read_text())
    good = obj["unickpt"]["tensors"]["w"]["fingerprint"]
    obj["unickpt"]["tensors"]["w"]["fingerprint"] = "0123456789abcdef"
    (a / INDEX).write_text(json.dumps(obj))
    deep = diff_checkpoints(a, a, deep=True)
    assert deep.same == list(w)  # the data are the same; the index is what is wrong
    assert any(
        "tensor 'w': recorded fingerprint 0123456789abcdef (v1), data gives " + good in x
        for x in deep.integrity_failures
    ), deep.integrity_failures


def test_merge_of_a_v1_checkpoint_stays_v1_and_consistent(tmp_path: Path) -> None:
    w = _weights()
    a = _write(tmp_path / "a", w, "cols")
    _to_v1(a, w)
    merge_checkpoint(a, tmp_path / "m")
    with open_checkpoint(tmp_path / "m") as r:
        assert r.block.format_version == 1
    assert diff_checkpoints(a, tmp_path / "m").identical
    deep = diff_checkpoints(tmp_path / "m", a, deep=True)
    assert deep.identical and not deep.integrity_failures, deep.format()
    # a cast recomputes the fingerprint with the source's algorithm
    merge_checkpoint(a, tmp_path / "m16", dtype="fp16")
    with open_checkpoint(tmp_path / "m16") as r:
        assert r.block.format_version == 1 and r.block.tensors["w"].dtype == "F16"
    deep = diff_checkpoints(tmp_path / "m16", tmp_path / "m16", deep=True)
    assert deep.identical and not deep.integrity_failures, deep.format()


@pytest.mark.parametrize(
    "version,ok", [(1, True), (2, True), (3, True), (4, True), (5, True), (6, False), (0, False)]
)
def test_index_parsers_take_versions_1_to_5_only(tmp_path: Path, version: int, ok: bool) -> None:
    from unickpt.errors import IndexFileError
    from unickpt.format.index import parse_index, parse_index_validated

    a = _write(tmp_path / "a", _weights(), "rows")
    obj = json.loads((a / INDEX).read_text())
    if version in (1, 2, 3, 4):  # in the text form of that version (hex digits below 5)
        as_version(obj, version)
    obj["unickpt"]["format_version"] = version
    raw = json.dumps(obj).encode()
    for parse in (parse_index, parse_index_validated):
        if ok:
            assert parse(raw, "x.json").unickpt is not None
            assert parse(raw, "x.json").unickpt.format_version == version  # type: ignore[union-attr]
        else:
            with pytest.raises(IndexFileError, match="format_version"):
                parse(raw, "x.json")


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc peak-RSS reset")
def test_deep_diff_memory_stays_bounded(tmp_path: Path) -> None:
    """Two 64 MiB tensors in different layouts: deep diff's peak RSS grows by a few chunks,
    not by the tensors (measured in a fresh process)."""
    import subprocess
    import sys

    rng = np.random.default_rng(9)
    big = rng.integers(0, 2**32, (2048, 8192), dtype=np.uint32).view(np.float32)
    other = big.copy()
    other[2047, 8191] = np.float32(1.5)
    write_checkpoint(
        str(tmp_path / "a"), {"w": _sliced(big, "F32", [((0, 0), (2048, 4096)), ((0, 4096), (2048, 4096))])}
    )
    write_checkpoint(
        str(tmp_path / "b"), {"w": _sliced(other, "F32", [((0, 0), (1000, 8192)), ((1000, 0), (1048, 8192))])}
    )
    del big, other
    code = (
        "import json, sys\n"
        "from unickpt import diff_checkpoints\n"
        "def kib(key):\n"
        "    return [int(x.split()[1]) for x in open('/proc/self/status') if x.startswith(key)][0]\n"
        "base = kib('VmRSS')\n"
        "open('/proc/self/clear_refs', 'w').write('5')  # the peak (VmHWM) starts again from here\n"
        "rep = diff_checkpoints(sys.argv[1], sys.argv[2], deep=True)\n"
        "d = rep.data_differences[0]\n"
        "print(json.dumps([(kib('VmHWM') - base) / 1024, d.first_index, d.count]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "a"), str(tmp_path / "b")],
        capture_output=True,
        text=True,
        check=True,
    )
    grown_mib, first, count = json.loads(out.stdout.strip().splitlines()[-1])
    assert (first, count) == ([2047, 8191], 1)
    print(f"deep diff of two 64 MiB tensors: peak RSS +{grown_mib:.0f} MiB")
    assert grown_mib < 100, f"deep diff of two 64 MiB tensors grew RSS by {grown_mib:.0f} MiB"
