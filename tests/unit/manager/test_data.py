"""Dataloader positions in the global sample order (ranks simulated with rank/num_replicas)."""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, Sampler

from unickpt.data import ResumableDataLoader, ResumableDistributedSampler, global_order, wrap_dataloader
from unickpt.errors import StateMismatchError


class _Plugin:
    def __init__(self, dp_size: int, dp_rank: int) -> None:
        self.dp_size = dp_size
        self.dp_rank = dp_rank


def _loader(n: int, batch: int, dp: int, rank: int, shuffle: bool = True) -> ResumableDataLoader:
    dl = DataLoader(list(range(n)), batch_size=batch, shuffle=shuffle)
    out = wrap_dataloader(dl, _Plugin(dp, rank))
    assert isinstance(out, ResumableDataLoader)
    return out


def _take(dl: ResumableDataLoader, k: int) -> list[int]:
    seen: list[int] = []
    it = iter(dl)
    for _ in range(k):
        seen.extend(int(x) for x in next(it))
    return seen


def test_global_order_is_deterministic_and_epoch_dependent() -> None:
    a, b = global_order(50, 0, 7, True), global_order(50, 1, 7, True)
    assert sorted(a) == list(range(50)) and a == global_order(50, 0, 7, True) and a != b
    assert global_order(5, 3, 0, False) == [0, 1, 2, 3, 4]


def test_resume_mid_epoch_gives_exactly_the_remaining_batches() -> None:
    full = [[int(x) for x in b] for b in _loader(23, 4, 1, 0)]
    dl = _loader(23, 4, 1, 0)
    it = iter(dl)
    first = [[int(x) for x in next(it)] for _ in range(3)]
    state = dl.state_dict()
    assert state["consumed_samples"] == 12 and state["epoch"] == 0
    fresh = _loader(23, 4, 1, 0)
    fresh.load_state_dict(state)
    rest = [[int(x) for x in b] for b in fresh]
    assert first + rest == full
    assert fresh.epoch == 1  # the pass completed
    # The next epoch is a new permutation, whole.
    nxt = [int(x) for b in fresh for x in b]
    assert sorted(nxt) == list(range(23)) and nxt != [x for b in full for x in b]


@pytest.mark.parametrize(("n", "drop_last"), [(40, False), (37, False), (37, True)])
def test_dp4_to_dp2_sees_every_sample_of_the_epoch_once(n: int, drop_last: bool) -> None:
    def make(dp: int, r: int) -> ResumableDataLoader:
        sampler = DistributedSampler(list(range(n)), num_replicas=dp, rank=r, shuffle=True, seed=3)
        sampler.drop_last = drop_last
        out = wrap_dataloader(DataLoader(list(range(n)), batch_size=2, sampler=sampler), None)
        assert isinstance(out, ResumableDataLoader)
        return out

    seen: list[int] = []
    states = []
    for r in range(4):
        dl = make(4, r)
        seen += _take(dl, 3)
        states.append(dl.state_dict())
    assert all(s == states[0] for s in states)  # a global position: the same on every rank
    assert states[0]["consumed_samples"] == 24
    for r in range(2):
        dl = make(2, r)
        dl.load_state_dict(states[0])
        seen += [int(x) for b in dl for x in b]
    counts = collections.Counter(seen)
    if n % 2 == 0 or drop_last:
        # 13 samples remain after 24 (n=37): drop_last drops the last one of the global order.
        expected = set(global_order(n, 0, 3, True)[: 24 + (n - 24) // 2 * 2])
        assert set(counts) == expected and all(c == 1 for c in counts.values())
    else:
        # Padding repeats exactly one sample at the end of the epoch, as DistributedSampler does.
        assert set(counts) == set(range(n)) and sum(counts.values()) == n + 1
        assert sorted(counts.values())[-1] == 2


def test_dp2_to_dp3_with_different_batch_size_never_repeats() -> None:
    n = 62  # 20 consumed by dp 2, 42 left: divisible by 3, no padding
    seen: list[int] = []
    state: dict[str, Any] = {}
    for r in range(2):
        dl = _loader(n, 5, 2, r)
        seen += _take(dl, 2)
        state = dl.state_dict()
    for r in range(3):
        dl = _loader(n, 4, 3, r)
        dl.load_state_dict(state)
        seen += [int(x) for b in dl for x in b]
    assert sorted(seen) == list(range(n))


def test_sampler_start_and_len() -> None:
    s = ResumableDistributedSampler(list(range(10)), num_replicas=3, rank=1, shuffle=False)
    s.set_start(4)
    assert list(s) == [5, 8] and len(s) == 2
    with pytest.raises(ValueError):
        s.set_start(11)
    with pytest.raises(ValueError):
        ResumableDistributedSampler(list(range(3)), num_replicas=2, rank=2)


class _Evens(Sampler[int]):
    """A user sampler unickpt cannot reshard."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.epoch % 2, self.n, 2))

    def __len__(self) -> int:
        return len(range(self.epoch % 2, self.n, 2))


def _custom(dp: int) -> ResumableDataLoader:
    out = wrap_dataloader(DataLoader(list(range(20)), batch_size=3, sampler=_Evens(20)), _Plugin(dp, 0))
    assert isinstance(out, ResumableDataLoader) and out.sampler is None
    return out


def test_custom_sampler_resumes_at_the_same_dp_size() -> None:
    full = [[int(x) for x in b] for b in _custom(1)]
    dl = _custom(1)
    first = _take(dl, 2)
    fresh = _custom(1)
    fresh.load_state_dict(dl.state_dict())
    rest = [[int(x) for x in b] for b in fresh]
    assert [first[:3], first[3:], *rest] == full


def test_custom_sampler_at_another_dp_size_raises_naming_fresh_epoch() -> None:
    dl = _custom(2)
    _take(dl, 1)
    state = dl.state_dict()
    other = _custom(4)
    with pytest.raises(StateMismatchError, match="fresh_epoch"):
        other.load_state_dict(state)
    other.on_reshard = "fresh_epoch"
    other.load_state_dict(state)
    assert other.epoch == 1
    assert [int(x) for b in other for x in b] == list(range(1, 20, 2))


def test_stateful_dataloader_and_iterables_pass_through() -> None:
    class Stateful:
        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, s: dict[str, Any]) -> None:
            pass

    obj = Stateful()
    assert wrap_dataloader(obj, None) is obj
    it = [torch.zeros(1)]
    assert wrap_dataloader(it, None) is it
    with pytest.raises(ValueError):
        wrap_dataloader(it, None, on_reshard="skip")
