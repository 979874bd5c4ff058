"""The process's snapshot buffers (``unickpt/io/pinned.py``), the snapshot's fences and the device
loader (``unickpt/io/load.py``), on CPU: the code CUDA runs, with ``torch.cuda.is_available()``
false (no pinning, synchronous copies, CPU-side fences).

- the pool holds exactly the bytes of the last async save (no rounding), reuses them on the next
  save of the same state (no allocation, the same addresses), drops what a new layout no longer
  uses, frees them on ``release_staging()``, and never hands one set to two saves at once;
- an optimizer step, ``CheckpointIO.synchronize()`` and a writer wait for a snapshot's copy
  still in progress (a fence not yet complete), and go on once it completes;
- the device loader fills a target chunk by chunk through two reused host buffers, with the cast
  after the copy, bit-exact, from a real checkpoint file.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from unickpt.ckpt.reader import open_checkpoint
from unickpt.io import GeneralCheckpointIO
from unickpt.io.load import DeviceLoader, copy_cast, off_host
from unickpt.io.pinned import POOL, Fence, pending, stage_copy, track, wait_staged
from unickpt.io.stage import guard_buffers, stage_written
from unickpt.manager import CheckpointManager
from unickpt.wrappers import OptimizerWrapper

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def io() -> Iterator[GeneralCheckpointIO]:
    """One IO (one writer process, started once) for the module's async saves."""
    io = GeneralCheckpointIO()
    yield io
    io.close()


@pytest.fixture(autouse=True)
def _empty_pool() -> Iterator[None]:
    wait_staged()
    POOL.release()
    yield
    wait_staged()
    POOL.release()


def _model(seed: int, sizes: tuple[int, ...] = (7, 13, 5)) -> torch.nn.Module:
    """Odd sizes: a buffer rounded up (to a power of two, a page) would show in the bytes held."""
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(a, b) for a, b in itertools.pairwise(sizes)]
    return torch.nn.Sequential(*layers)


def _state_bytes(m: torch.nn.Module) -> int:
    return sum(v.numel() * v.element_size() for v in m.state_dict().values())


def _model_sets() -> list:
    return [s for s in POOL.sets() if s.tag == "model"]


def _assert_bits(m: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    got = m.state_dict()
    assert sorted(got) == sorted(expected)
    for k, v in expected.items():
        assert torch.equal(got[k].view(-1).view(torch.uint8), v.view(-1).view(torch.uint8)), k


def test_async_saves_hold_exact_bytes_reuse_them_and_release_them(
    tmp_path: Path, io: GeneralCheckpointIO
) -> None:
    model = _model(0)
    io.save_model(model, str(tmp_path / "a"), shard=True, use_async=True)
    io.wait()
    (held,) = _model_sets()
    assert not held.leased
    assert POOL.nbytes == held.nbytes == _state_bytes(model) == 4 * (7 * 13 + 13 + 13 * 5 + 5)
    first = {k: t.data_ptr() for k, t in held.items()}
    allocations = POOL.allocations
    assert allocations == len(model.state_dict())

    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    io.save_model(model, str(tmp_path / "b"), shard=True, use_async=True)
    io.wait()
    assert _model_sets() == [held]
    assert POOL.allocations == allocations  # the second save of the same state allocates nothing
    assert {k: t.data_ptr() for k, t in held.items()} == first
    fresh = _model(1)
    io.load_model(fresh, str(tmp_path / "b"))
    _assert_bits(fresh, expected)

    assert io.release_staging() == _state_bytes(model)
    assert POOL.nbytes == 0 and POOL.sets() == []
    io.save_model(model, str(tmp_path / "c"), shard=True, use_async=True)
    io.wait()
    assert POOL.nbytes == _state_bytes(model)
    assert POOL.allocations == len(model.state_dict())  # allocated again, once


def test_a_new_layout_drops_the_buffers_it_no_longer_uses(tmp_path: Path, io: GeneralCheckpointIO) -> None:
    big = _model(0, (9, 31, 17, 3))
    io.save_model(big, str(tmp_path / "big"), shard=True, use_async=True)
    io.wait()
    assert POOL.nbytes == _state_bytes(big)
    small = _model(0, (9, 4))
    io.save_model(small, str(tmp_path / "small"), shard=True, use_async=True)
    io.wait()
    (held,) = _model_sets()
    assert POOL.nbytes == held.nbytes == _state_bytes(small)
    assert sorted(k[0] for k in held) == sorted(small.state_dict())


def test_the_manager_and_the_io_share_the_pool(tmp_path: Path, io: GeneralCheckpointIO) -> None:
    model = _model(0)
    opt = OptimizerWrapper(torch.optim.Adam(model.parameters(), lr=0.1), model)
    model(torch.randn(2, 7)).sum().backward()
    opt.step()
    mgr = CheckpointManager(tmp_path / "run", save_steps=1, async_save=True)
    mgr.save(1, model, opt)
    mgr.wait()
    (held,) = _model_sets()
    allocations = POOL.allocations
    # The IO's async save of the same model reuses the manager's model buffers.
    io.save_model(model, str(tmp_path / "io"), shard=True, use_async=True)
    io.wait()
    assert _model_sets() == [held] and POOL.allocations == allocations
    assert held.nbytes == _state_bytes(model)
    held_now = POOL.nbytes
    assert held_now == _state_bytes(model) + sum(s.nbytes for s in POOL.sets() if s.tag == "optimizer") > 0
    assert mgr.release_staging() == held_now
    assert POOL.nbytes == 0
    mgr.close()


def test_a_set_in_use_is_never_leased_again_and_release_waits_for_it() -> None:
    a = POOL.lease("model", shared=False)
    src = torch.arange(10, dtype=torch.float32)
    stage_copy(src, a, ("w", 0))
    b = POOL.lease("model", shared=False)
    assert b is not a
    stage_copy(src, b, ("w", 0))  # the same keys: still two sets, never compared by contents
    assert a != b and POOL.sets() == [a, b] and len({id(s) for s in POOL.sets()}) == 2
    assert POOL.release() == 0  # both in use: nothing freed now
    assert POOL.nbytes == 80
    POOL.give_back(a)  # released meanwhile: goes now
    POOL.give_back(b)
    assert POOL.sets() == [] and POOL.nbytes == 0


def test_stage_copy_is_exact_and_a_plain_dict_keeps_its_buffer() -> None:
    staging: dict = {}
    src = torch.arange(3, dtype=torch.float16)
    out = stage_copy(src, staging, "k")
    assert out.untyped_storage().nbytes() == 6 and torch.equal(out, src)
    again = stage_copy(src + 1, staging, "k")
    assert again.data_ptr() == out.data_ptr() and torch.equal(again, src + 1)


class Watched(Fence):
    """A CPU fence that notes when someone starts waiting for it."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = threading.Event()

    def wait(self) -> None:
        self.waiting.set()
        super().wait()


def _blocked(fn, fence: Watched, while_waiting=None, hold_s: float = 0.2):
    """Run ``fn`` in a thread while ``fence`` is incomplete: it must reach the fence and wait
    there (not return) until the fence completes, then return. ``while_waiting()`` runs while
    ``fn`` waits, before the fence completes; its result is returned."""
    finished = threading.Event()
    errors: list[BaseException] = []
    result = None

    def run() -> None:
        try:
            fn()
        except BaseException as e:
            errors.append(e)
        finished.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        assert fence.waiting.wait(20), "never waited for the snapshot's copy"
        assert not finished.wait(hold_s), "returned before the snapshot's copy was done"
        if while_waiting is not None:
            result = while_waiting()
    finally:
        fence.complete()  # never left pending for the next test
    assert finished.wait(20)
    t.join()
    assert not errors, errors
    return result


def test_an_optimizer_step_waits_for_a_snapshot_still_being_copied() -> None:
    model = _model(0)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model(torch.randn(2, 7)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    fence = track(Watched())
    assert pending() == 1
    seen: list[bool] = []

    def step() -> None:
        opt.step()
        seen.append(fence.done())

    _blocked(step, fence)
    assert seen == [True]  # the step ran after the copy was done
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert pending() == 0
    t0 = time.monotonic()
    opt.step()  # nothing pending: no wait
    assert time.monotonic() - t0 < 1.0


def test_synchronize_and_the_writer_wait_for_the_copy(tmp_path: Path, io: GeneralCheckpointIO) -> None:
    fence = track(Watched())
    _blocked(io.synchronize, fence)
    # The background write starts only once the copy is done (the writer reads the buffers).
    model = _model(0)
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    fence = track(Watched())
    io.save_model(model, str(tmp_path / "m"), shard=True, use_async=True)
    _blocked(io.wait, fence)
    fresh = _model(1)
    io.load_model(fresh, str(tmp_path / "m"))
    _assert_bits(fresh, expected)


def test_a_foreground_write_of_a_snapshot_waits_for_its_copy(tmp_path: Path, io: GeneralCheckpointIO) -> None:
    model = _model(0)
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    staging = POOL.lease("model", shared=False)
    staged = stage_written(io.plan_model(model), staging, io.group)
    fence = track(Watched())
    out = str(tmp_path / "fg")
    _blocked(lambda: io.write(staged, out, shard=True, gather_dtensor=False, size_per_shard=1024), fence)
    POOL.give_back(staging)
    fresh = _model(1)
    io.load_model(fresh, out)
    _assert_bits(fresh, expected)


def test_a_cpu_snapshot_leaves_nothing_pending(tmp_path: Path, io: GeneralCheckpointIO) -> None:
    io.save_model(_model(0), str(tmp_path / "m"), shard=True, use_async=True)
    assert pending() == 0
    io.wait()


def _bn_model(seed: int) -> torch.nn.Module:
    """Two modules with buffers a forward changes (BatchNorm's running statistics, its count)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(7, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 3), torch.nn.BatchNorm1d(3)
    ).train()


def _live_slices(io: GeneralCheckpointIO, model: torch.nn.Module) -> list[torch.Tensor]:
    return [sl.tensor for sls in io.plan_model(model).slices.values() for sl in sls]


def _hooked(model: torch.nn.Module) -> list[int]:
    return [i for i, m in enumerate(model.modules()) if m._forward_pre_hooks]


def _stats(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "running" in k or "batches" in k}


def test_a_forward_waits_for_the_copy_of_the_buffers_it_changes(io: GeneralCheckpointIO) -> None:
    model = _bn_model(0)
    before = _stats(model)
    assert len(before) == 6
    fence = track(Watched())
    assert guard_buffers(fence, model, _live_slices(io, model)) == 2
    assert _hooked(model) == [2, 4]  # the two BatchNorms (0 is the Sequential), not the Linears
    x = torch.randn(4, 7)

    def copy_while_the_forward_waits():
        for k, v in before.items():  # nothing changed yet
            assert torch.equal(model.state_dict()[k], v), k
        # The copy the fence stands for, made while the forward waits for it.
        return stage_written(io.plan_model(model), {}, io.group)

    staged = _blocked(lambda: model(x), fence, copy_while_the_forward_waits, hold_s=0.3)
    assert _hooked(model) == []  # every hook of the fence went with it
    for k, v in before.items():  # the copy holds the statistics from before the forward, bit for bit
        copy = staged.slices[k][0].tensor
        assert torch.equal(copy.view(-1).view(torch.uint8), v.view(-1).view(torch.uint8)), k
    after = _stats(model)
    assert int(after["1.num_batches_tracked"]) == int(before["1.num_batches_tracked"]) + 1
    assert not torch.equal(after["1.running_mean"], before["1.running_mean"])
    t0 = time.monotonic()
    model(x)  # the fence is done: no hook, no wait
    assert time.monotonic() - t0 < 1.0
    assert pending() == 0


def test_a_fence_waited_for_elsewhere_takes_its_forward_hooks_with_it(io: GeneralCheckpointIO) -> None:
    model = _bn_model(0)
    fence = track(Fence())
    assert guard_buffers(fence, model, _live_slices(io, model)) == 2
    again = track(Fence())
    assert guard_buffers(again, model, _live_slices(io, model)) == 2
    assert len(model[1]._forward_pre_hooks) == 2
    fence.complete()  # one fence done: its hooks go, the other's stay
    assert len(model[1]._forward_pre_hooks) == 1 and len(model[3]._forward_pre_hooks) == 1
    threading.Timer(0.2, again.complete).start()
    wait_staged()  # an optimizer step, synchronize() or the writer waiting for it
    assert _hooked(model) == []


def test_only_the_owners_of_the_copied_buffers_are_hooked(io: GeneralCheckpointIO) -> None:
    model = _bn_model(0)
    fence = track(Fence())
    try:
        # Only the first BatchNorm's buffers (another rank would copy the rest).
        assert guard_buffers(fence, model, list(model[1].buffers())) == 1
        assert _hooked(model) == [2]
        plain = _model(0)  # no buffers at all
        assert guard_buffers(fence, plain, _live_slices(io, plain)) == 0
        assert _hooked(plain) == []
    finally:
        fence.complete()
    assert _hooked(model) == []
    done = Fence()
    done.complete()
    assert guard_buffers(done, model, _live_slices(io, model)) == 0  # done already: no hook
    assert _hooked(model) == []


def test_async_saves_pass_the_model_to_the_guard_and_hook_nothing_on_cpu(
    tmp_path: Path, io: GeneralCheckpointIO, monkeypatch: pytest.MonkeyPatch
) -> None:
    import unickpt.io.stage as stage

    seen: list[tuple[bool, object]] = []
    real = stage.guard_buffers

    def spy(fence: Fence, model: torch.nn.Module, copied: list[torch.Tensor]) -> int:
        n = real(fence, model, copied)
        seen.append((fence.done(), model))
        assert n == 0  # on CPU the copy is done when the guard runs
        return n

    monkeypatch.setattr(stage, "guard_buffers", spy)
    model = _bn_model(0)
    io.save_model(model, str(tmp_path / "m"), shard=True, use_async=True)
    io.wait()
    mgr = CheckpointManager(tmp_path / "run", save_steps=1, async_save=True)
    try:
        mgr.save(1, model, None)
        mgr.wait()
    finally:
        mgr.close()
    assert seen == [(True, model), (True, model)]
    assert _hooked(model) == []
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    fresh = _bn_model(1)
    io.load_model(fresh, str(tmp_path / "m"))
    _assert_bits(fresh, expected)


def _row_reader(src: torch.Tensor, calls: list[tuple]):
    def read(offsets: tuple[int, ...], shape: tuple[int, ...], out: torch.Tensor) -> None:
        calls.append((offsets, shape))
        assert out.is_contiguous() and out.dtype == src.dtype and tuple(out.shape) == shape
        index = tuple(slice(o, o + n) for o, n in zip(offsets, shape, strict=True))
        out.copy_(src[index])

    return read


def test_the_device_loader_copies_chunks_through_two_reused_buffers() -> None:
    assert not off_host(torch.empty(1)) and not off_host(torch.empty(1, device="meta"))
    src = torch.randn(40, 6, dtype=torch.float32).to(torch.bfloat16)
    calls: list[tuple] = []
    target = torch.zeros(30, 6, dtype=torch.float32)
    with DeviceLoader(chunk_bytes=4 * 6 * 2) as loader:  # 4 rows of bf16 a chunk
        loader.load(target, (5, 0), (30, 6), torch.bfloat16, _row_reader(src, calls))
        assert loader.chunks == 8
    assert calls[0] == ((5, 0), (4, 6)) and calls[-1] == ((33, 0), (2, 6))
    assert torch.equal(target, src[5:35].to(torch.float32))
    (held,) = [s for s in POOL.sets() if s.tag == "load"]
    assert sorted(held) == [("load", 0), ("load", 1)] and held.nbytes == 2 * 48
    allocations = POOL.allocations
    # A second load reuses both buffers; a target that is a non-contiguous view is one chunk.
    wide = torch.zeros(6, 8, dtype=torch.bfloat16)
    view = wide.t()[:6]  # (6, 6) view, not contiguous
    calls.clear()
    with DeviceLoader(chunk_bytes=48) as loader:
        loader.load(view, (0, 0), (3, 12), torch.bfloat16, _row_reader(src.reshape(20, 12), calls))
    assert calls == [((0, 0), (3, 12))]
    assert torch.equal(view, src.reshape(20, 12)[:3].reshape(6, 6))
    # Slot 0 grew to the larger chunk (72 bytes); slot 1, unused, was dropped when handed back.
    assert POOL.allocations == allocations + 1
    assert sorted(held) == [("load", 0)] and held.nbytes == 72
    # A scalar.
    scalar = torch.zeros((), dtype=torch.float64)
    with DeviceLoader() as loader:
        loader.load(scalar, (), (), torch.float32, lambda o, s, out: out.fill_(2.5))
    assert scalar.item() == 2.5


def test_the_device_loader_reads_a_real_checkpoint_bit_exact(tmp_path: Path, io: GeneralCheckpointIO) -> None:
    torch.manual_seed(0)
    w = torch.randn(37, 11, dtype=torch.float16)
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(w.clone(), requires_grad=False)  # type: ignore[attr-defined]
    io.save_model(model, str(tmp_path / "ck"), shard=True)
    reader = open_checkpoint(str(tmp_path / "ck"))
    try:
        (entry,) = [e for n, e in reader.tensors.items() if n.endswith("w")]
        (s,) = entry.slices
        row = 11 * 2

        def read(offsets: tuple[int, ...], shape: tuple[int, ...], out: torch.Tensor) -> None:
            mv = memoryview(out.reshape(-1).view(torch.uint8).numpy())
            reader.read_key_bytes(s.file, s.key, offsets[0] * row, shape[0] * row, mv)

        target = torch.zeros(37, 11, dtype=torch.float32)
        with DeviceLoader(chunk_bytes=5 * row) as loader:
            loader.load(target, (0, 0), (37, 11), torch.float16, read)
            assert loader.chunks == 8
        assert torch.equal(target, w.to(torch.float32))
        same = torch.zeros(37, 11, dtype=torch.float16)
        copy_cast(same, w)
        assert torch.equal(same.view(torch.int16), w.view(torch.int16))
    finally:
        reader.close()
