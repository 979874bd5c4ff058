"""Every loop of the compiled fingerprint kernel (AVX-512 with IFMA, AVX-512, AVX2, NEON, plain C:
each level this CPU has, forced by ``UNICKPT_FP_SIMD`` in a fresh interpreter) gives the numpy
reference's numbers, bit for bit, on many random lengths, block offsets, dtypes, chunk starts
and unaligned buffer addresses; the AArch64 loops do under an emulator where one is installed
(a plain C harness against the plain C loops); and the threaded split of one block gives the
serial numbers."""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import subprocess
import sys

import numpy as np
import pytest

from unickpt.spec import hashing

native = pytest.mark.skipif(hashing._native2 is None, reason="the compiled v2 kernel is not built here")
LEVELS = (
    ["scalar", "neon"]
    if platform.machine() in ("aarch64", "arm64")
    else ["scalar", "avx2", "avx512", "avx512-ifma"]
)
SYSROOT = "/usr/aarch64-linux-gnu"
N_CASES = 400


def _cases(seed: int = 11) -> list[dict[str, object]]:
    """Blocks of 1-3 dims with 0..~6000 limbs (lengths around the 1024-limb groups and the vector
    widths), a chunk [start, start + count) of the block's elements, and a byte misalignment."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(N_CASES):
        isz = int(rng.choice([1, 2, 4, 8]))
        per = 1 if isz == 1 else isz // 2
        nd = int(rng.integers(1, 4))
        if i % 3 == 0:  # near a group or vector boundary, in limbs
            limbs = int(rng.choice([1024, 2048, 3072, 32, 64, 8, 16])) + int(rng.integers(-9, 10))
            last = max(1, limbs // per)
        else:
            last = int(rng.integers(1, 3000 if nd == 1 else 700))
        gshape = [int(rng.integers(1, 6)) for _ in range(nd - 1)] + [last + int(rng.integers(0, 40))]
        offsets = [int(rng.integers(0, g)) for g in gshape]
        shape = [int(rng.integers(1, g - o + 1)) for g, o in zip(gshape, offsets, strict=True)]
        n = math.prod(shape)
        start = int(rng.integers(0, n))
        count = int(rng.integers(0, n - start + 1))
        out.append(
            {
                "isz": isz,
                "gshape": gshape,
                "offsets": offsets,
                "shape": shape,
                "start": start,
                "count": count,
                "shift": int(rng.integers(0, 8)),
                "seed": int(rng.integers(0, 2**32)),
                "fill": str(rng.choice(["random", "max", "sparse"])),
            }
        )
    return out


def _data(c: dict[str, object]) -> np.ndarray:
    n = math.prod(c["shape"]) * c["isz"]  # type: ignore[arg-type]
    rng = np.random.default_rng(c["seed"])  # type: ignore[arg-type]
    raw = rng.integers(0, 256, n, dtype=np.uint8)
    if c["fill"] == "max":  # every limb at its maximum: the largest products and sums
        raw[:] = 255
    elif c["fill"] == "sparse":
        raw[rng.random(n) < 0.9] = 0
    return raw


# Run in a fresh interpreter under UNICKPT_FP_SIMD=<level>: the kernel's sums of every case's chunk,
# read from a buffer placed ``shift`` bytes past an aligned address.
_CHILD = """
import json, sys
import numpy as np
sys.path.insert(0, {tests!r})
import test_fp_kernel_levels as t
from unickpt.spec import _fp2kernel
out = [_fp2kernel.simd()]
for c in t._cases():
    raw = t._data(c)
    isz, s, k = c["isz"], c["start"], c["count"]
    room = np.zeros(raw.size + 64, dtype=np.uint8)
    base = (-room.ctypes.data) % 64 + c["shift"]
    room[base : base + raw.size] = raw
    chunk = memoryview(room)[base + s * isz : base + (s + k) * isz]
    out.append(list(_fp2kernel.partial(chunk, isz, c["gshape"], c["offsets"], c["shape"], s)))
print(json.dumps(out))
"""


def _run_level(level: str) -> list[object]:
    env = dict(os.environ, UNICKPT_FP_SIMD=level)
    env.pop("UNICKPT_FP_SCALAR", None)
    code = _CHILD.format(tests=os.path.dirname(__file__))
    cp = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(cp.stdout)  # type: ignore[no-any-return]


def _expected() -> list[int]:
    """The numpy reference of each chunk: the whole block with the limbs outside the chunk zeroed
    (a zero limb adds nothing), so any chunk of any block has a reference value."""
    out = []
    for c in _cases():
        raw = _data(c)
        isz, s, k = c["isz"], c["start"], c["count"]  # type: ignore[misc]
        masked = np.zeros_like(raw)
        masked[s * isz : (s + k) * isz] = raw[s * isz : (s + k) * isz]  # type: ignore[operator]
        out.append(hashing.partial_numpy(masked.tobytes(), isz, c["gshape"], c["offsets"], c["shape"]))  # type: ignore[arg-type]
    return out


@pytest.fixture(scope="module")
def expected() -> list[int]:
    return _expected()


@native
@pytest.mark.parametrize("level", LEVELS)
def test_every_loop_gives_the_numpy_numbers(level: str, expected: list[int]) -> None:
    got = _run_level(level)
    ran = got[0]
    if ran != level:  # capped to a level the CPU has: that level is tested under its own name
        assert LEVELS.index(str(ran)) < LEVELS.index(level), (ran, level)
        pytest.skip(f"this CPU has no {level}")
    assert len(got) == N_CASES + 1
    for i, ((h1, h2), want) in enumerate(zip(got[1:], expected, strict=True)):  # type: ignore[misc]
        assert hashing.encode(h1 % hashing.P1, h2 % hashing.P2) == want, (level, i, _cases()[i])


def test_cases_cover_the_edges() -> None:
    cases = _cases()
    assert {c["isz"] for c in cases} == {1, 2, 4, 8}
    assert {c["shift"] for c in cases} == set(range(8))
    assert any(c["count"] == 0 for c in cases) and any(c["start"] > 0 and c["count"] > 0 for c in cases)
    limbs = [math.prod(c["shape"]) * max(1, c["isz"] // 2) for c in cases]  # type: ignore[arg-type, operator]
    assert max(limbs) > 3 * 1024 and any(0 < n < 8 for n in limbs)
    assert any(c["offsets"][-1] > 0 for c in cases) and any(len(c["shape"]) == 3 for c in cases)  # type: ignore[index, arg-type]


# ------------------------------------------------------------------ one block over several threads


def _blocks() -> list[tuple[np.ndarray, int, tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    rng = np.random.default_rng(3)
    out = []
    for isz, gshape, offsets, shape in [
        (4, (64, 3001), (0, 0), (64, 3001)),  # whole matrix
        (2, (40, 9000), (3, 1234), (31, 5003)),  # column range: runs that do not start on a group
        (8, (70_001,), (17,), (69_000,)),  # flat range
        (1, (5, 7, 4099), (1, 2, 5), (3, 4, 4000)),
    ]:
        raw = rng.integers(0, 256, math.prod(shape) * isz, dtype=np.uint8)
        out.append((raw, isz, gshape, offsets, shape))
    return out


@native
@pytest.mark.parametrize("threads", [2, 3, 5])
def test_split_over_threads_gives_the_serial_numbers(monkeypatch: pytest.MonkeyPatch, threads: int) -> None:
    import threading

    blocks = _blocks()
    monkeypatch.setattr(hashing, "FP_THREADS", 1)
    serial = [
        hashing.hash_block(b, isz, g, o, s, xxh3=x) for b, isz, g, o, s in blocks for x in (True, False)
    ]
    numpy_ref = [hashing.partial_numpy(b.tobytes(), isz, g, o, s) for b, isz, g, o, s in blocks]
    assert [t for _, t in serial[1::2]] == numpy_ref
    monkeypatch.setattr(hashing, "FP_THREADS", threads)
    monkeypatch.setattr(hashing, "_SPLIT_MIN_BYTES", 4096)  # these small blocks split too
    assert len(hashing._parts(100_000, 4, xxh3=True)) == threads - 1
    assert len(hashing._parts(100_000, 4, xxh3=False)) == threads
    assert hashing._parts(1000, 4, xxh3=False) == []  # 4000 bytes: one share, no split
    split = [hashing.hash_block(b, isz, g, o, s, xxh3=x) for b, isz, g, o, s in blocks for x in (True, False)]
    assert split == serial
    assert any(t.name.startswith("unickpt-fp") for t in threading.enumerate())  # helpers really ran


def test_thread_count_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from unickpt.errors import ConfigError

    monkeypatch.setenv("UNICKPT_FP_THREADS", "3")
    assert hashing._fp_threads() == 3
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("UNICKPT_FP_THREADS", bad)
        with pytest.raises(ConfigError, match=f"UNICKPT_FP_THREADS must be a whole number >= 1, not '{bad}'"):
            hashing._fp_threads()
    monkeypatch.delenv("UNICKPT_FP_THREADS")
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert hashing._fp_threads() == max(1, min(4, cores - 1))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores))  # one core per rank: the writer's
    assert hashing._fp_threads() == 1


def _child_hash(q: object) -> None:
    b, isz, g, o, s = _blocks()[0]
    q.put(hashing.hash_block(b, isz, g, o, s))  # type: ignore[attr-defined]


@native
@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_forked_child_makes_its_own_helpers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A child forked after the helpers started has none of their threads: it must not wait on them."""
    import multiprocessing

    monkeypatch.setattr(hashing, "FP_THREADS", 3)
    monkeypatch.setattr(hashing, "_SPLIT_MIN_BYTES", 4096)
    b, isz, g, o, s = _blocks()[0]
    want = hashing.hash_block(b, isz, g, o, s)  # the parent's pool now exists
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_hash, args=(q,))
    p.start()
    try:
        got = q.get(timeout=60)
    finally:
        p.join(timeout=10)
        if p.is_alive():  # pragma: no cover - the bug this test is for
            p.kill()
    assert got == want


# ------------------------------------------------------------------ the loops in a plain C harness

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
HARNESS = os.path.join(REPO, "tests", "data", "fp_harness")


def _build_harness(cc: str, out: str) -> None:
    kernel = os.path.join(REPO, "unickpt", "spec", "_fp2kernel.c")
    cmd = [cc, "-O2", "-std=c99", "-w", "-I", HARNESS, "-include", kernel, os.path.join(HARNESS, "harness.c")]
    subprocess.run([*cmd, "-o", out], check=True, capture_output=True, text=True)


@pytest.mark.skipif(
    not (shutil.which("aarch64-linux-gnu-gcc") and shutil.which("qemu-aarch64") and os.path.isdir(SYSROOT)),
    reason="no AArch64 cross compiler and emulator here (apt: gcc-aarch64-linux-gnu qemu-user)",
)
@pytest.mark.parametrize("level", ["neon", "scalar"])
def test_aarch64_loops_under_an_emulator(tmp_path: object, level: str) -> None:
    exe = os.path.join(str(tmp_path), "harness")
    _build_harness("aarch64-linux-gnu-gcc", exe)
    env = dict(os.environ, UNICKPT_FP_SIMD=level)
    cp = subprocess.run(
        ["qemu-aarch64", "-L", SYSROOT, exe], env=env, capture_output=True, text=True, timeout=120
    )
    assert cp.stdout.strip() == f"{level}: 40000 spans, 0 mismatches", cp.stdout
    assert cp.returncode == 0


@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or not shutil.which("cc"), reason="x86 only"
)
def test_x86_loops_in_the_c_harness(tmp_path: object) -> None:
    exe = os.path.join(str(tmp_path), "harness")
    _build_harness("cc", exe)
    ran = []
    for level in LEVELS:
        cp = subprocess.run(
            [exe], env=dict(os.environ, UNICKPT_FP_SIMD=level), capture_output=True, text=True
        )
        got, _, tail = cp.stdout.strip().partition(": ")
        assert tail == "40000 spans, 0 mismatches" and cp.returncode == 0, cp.stdout
        ran.append(got)
    assert ran[0] == "scalar" and ran == sorted(ran, key=LEVELS.index)  # each capped level or below
