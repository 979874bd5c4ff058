"""Resumable data loading: a dataloader position that survives a change of data-parallel size.

The position is kept in the *global* sample order of an epoch, not as per-rank iterator
state. For epoch ``e`` the global order is ``randperm(len(dataset), seed + e)`` (or
``0..N-1`` without shuffling). With ``W`` data-parallel ranks, rank ``r`` reads the global
order interleaved, ``order[start + r :: W]`` (as torch's ``DistributedSampler`` does), so
after every rank has consumed ``k`` samples the ranks together have consumed exactly the
prefix ``order[start : start + k * W]``. The saved position is::

    {"kind": "global_position", "epoch": e, "consumed_samples": c, "seed": s, "shuffle": ...,
     "dataset_len": N, "num_replicas": W, "batch_size": B, "drop_last": ...}

Resuming under any ``W'`` continues with ``order[c:]`` split over the ``W'`` ranks: every
sample of the epoch is seen exactly once, none skipped, none repeated. When the remaining
``N - c`` samples do not divide by ``W'``, the tail is padded by repeating its first samples
(``drop_last=False``, like ``DistributedSampler``) or the last ``(N - c) % W'`` are dropped
(``drop_last=True``); padding repeats a few samples at the very end of an epoch only.

Who calls what: every rank wraps its dataloader once (``Booster.boost`` calls
:func:`wrap_dataloader`); the checkpoint manager calls ``state_dict``/``load_state_dict`` on
every rank. Positions are counted when a batch is *yielded* to the training loop, so
prefetching workers never make the position run ahead.

A sampler unickpt does not know (a user's own sampler or batch sampler) is still resumable
at the *same* data-parallel size (the first batches of the epoch are skipped at the index
level, without loading data); at another size its position means nothing and loading it
raises :class:`~unickpt.errors.StateMismatchError`, unless ``on_reshard="fresh_epoch"`` is
set on the dataloader, which starts the next epoch from its beginning instead.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from unickpt._logging import get_logger
from unickpt.errors import ConfigError, StateMismatchError, UnsupportedError

__all__ = [
    "ResumableDistributedSampler",
    "ResumableDataLoader",
    "wrap_dataloader",
    "global_order",
]

logger = get_logger(__name__)
STATE_VERSION = 1
_RESHARD_POLICIES = ("error", "fresh_epoch")


def global_order(dataset_len: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    """The global sample order of one epoch (the same on every rank and every world size)."""
    if not shuffle:
        return list(range(dataset_len))
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return [int(i) for i in torch.randperm(dataset_len, generator=g).tolist()]


class ResumableDistributedSampler(Sampler[int]):
    """A ``DistributedSampler`` that can start in the middle of an epoch's global order.

    ``start`` is the number of samples of the global order already consumed by all ranks
    together; this rank yields ``order[start + rank :: num_replicas]`` (after padding or
    trimming the remainder to a multiple of ``num_replicas``). Set ``epoch`` and ``start``
    with :meth:`set_epoch` / :meth:`set_start` before iterating; every rank does the same.
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ConfigError(f"rank {rank} is not in [0, num_replicas={num_replicas})")
        self.dataset_len = len(dataset)
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def set_start(self, start: int) -> None:
        if not 0 <= start <= self.dataset_len:
            raise ConfigError(f"start {start} is outside the epoch of {self.dataset_len} samples")
        self.start = start

    def _remaining(self) -> list[int]:
        rest = global_order(self.dataset_len, self.epoch, self.seed, self.shuffle)[self.start :]
        w = self.num_replicas
        if self.drop_last:
            return rest[: len(rest) - len(rest) % w]
        pad = (-len(rest)) % w
        while pad > 0 and rest:
            take = rest[: min(pad, len(rest))]
            rest = rest + take
            pad -= len(take)
        return rest

    def __iter__(self) -> Iterator[int]:
        return iter(self._remaining()[self.rank :: self.num_replicas])

    def __len__(self) -> int:
        n = self.dataset_len - self.start
        w = self.num_replicas
        return n // w if self.drop_last else math.ceil(n / w)


class _SkipBatches(Sampler[list[int]]):
    """Yields the batches of ``inner`` after skipping the first ``skip`` (index level only)."""

    def __init__(self, inner: Any, skip: int = 0) -> None:
        self.inner = inner
        self.skip = skip

    def __iter__(self) -> Iterator[list[int]]:
        for i, batch in enumerate(self.inner):
            if i >= self.skip:
                yield batch

    def __len__(self) -> int:
        return max(0, len(self.inner) - self.skip)


class ResumableDataLoader:
    """A dataloader whose position the checkpoint manager saves and restores.

    Iterate it like the wrapped ``DataLoader``; each completed pass advances ``epoch``.
    ``state_dict()``/``load_state_dict()`` are called by every rank (via the manager).
    ``on_reshard`` ("error" or "fresh_epoch") decides what loading a position saved under
    another data-parallel size does when the sampler cannot be resharded.
    """

    def __init__(
        self,
        dataloader: DataLoader[Any],
        sampler: ResumableDistributedSampler | None,
        *,
        dp_size: int,
        dp_rank: int,
        on_reshard: str = "error",
    ) -> None:
        self.dataloader = dataloader
        self.sampler = sampler
        self.dp_size = dp_size
        self.dp_rank = dp_rank
        self.on_reshard = on_reshard
        self.epoch = 0
        self._start_samples = 0  # global samples consumed when the current pass began
        self._start_batches = 0  # for samplers unickpt cannot reshard: batches skipped
        self._yielded = 0  # batches yielded in the current pass
        self._batch_size = int(dataloader.batch_size or 1)
        # Set when wrap_dataloader gave the inner DataLoader a private generator (see _prepare_pass).
        self._own_generator: torch.Generator | None = None

    # -- iteration ---------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Jump to the start of ``epoch`` (every rank)."""
        if epoch != self.epoch:
            self.epoch = epoch
            self._start_samples = self._start_batches = self._yielded = 0

    def _prepare_pass(self) -> DataLoader[Any]:
        # Starting a DataLoader iterator draws its workers' base seed from a generator: from
        # torch's global one, a resumed run would draw once more than an uninterrupted run and
        # every later random number would differ. A private generator seeded by the epoch keeps
        # the global stream untouched and gives each epoch's workers the same base seed.
        if self._own_generator is not None:
            seed = self.sampler.seed if self.sampler is not None else 0
            self._own_generator.manual_seed(seed * 1_000_003 + self.epoch)
        if self.sampler is not None:
            self.sampler.set_epoch(self.epoch)
            self.sampler.set_start(self._start_samples)
            return self.dataloader
        bs = self.dataloader.batch_sampler
        inner = getattr(bs, "inner", bs)
        set_epoch = getattr(getattr(inner, "sampler", None), "set_epoch", None)
        if set_epoch is not None:
            set_epoch(self.epoch)
        if isinstance(bs, _SkipBatches):
            bs.skip = self._start_batches
        return self.dataloader

    def __iter__(self) -> Iterator[Any]:
        loader = self._prepare_pass()
        self._yielded = 0
        for batch in loader:
            self._yielded += 1
            yield batch
        self.epoch += 1
        self._start_samples = self._start_batches = self._yielded = 0

    def __len__(self) -> int:
        return len(self.dataloader)

    def __getattr__(self, name: str) -> Any:
        if name in ("dataloader", "sampler"):
            raise AttributeError(name)
        return getattr(self.dataloader, name)

    # -- position ------------------------------------------------------------------------------
    def consumed_samples(self) -> int:
        """Samples of this epoch's global order consumed by all data-parallel ranks together."""
        s = self.sampler
        if s is None:
            raise UnsupportedError("this dataloader's sampler has no global position (not resharding)")
        local_total = len(s)
        local_done = min(self._yielded * self._batch_size, local_total)
        return min(s.dataset_len, self._start_samples + local_done * s.num_replicas)

    def state_dict(self) -> dict[str, Any]:
        """The position (JSON-able). The same on every rank for the global-position kind."""
        if self.sampler is not None:
            s = self.sampler
            return {
                "unickpt_dataloader": STATE_VERSION,
                "kind": "global_position",
                "epoch": self.epoch,
                "consumed_samples": self.consumed_samples(),
                "seed": s.seed,
                "shuffle": s.shuffle,
                "drop_last": s.drop_last,
                "dataset_len": s.dataset_len,
                "num_replicas": s.num_replicas,
                "batch_size": self._batch_size,
            }
        return {
            "unickpt_dataloader": STATE_VERSION,
            "kind": "batch_count",
            "epoch": self.epoch,
            "consumed_batches": self._start_batches + self._yielded,
            "dp_size": self.dp_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position saved by :meth:`state_dict`, possibly under another dp size."""
        if not isinstance(state, dict) or state.get("unickpt_dataloader") != STATE_VERSION:
            raise StateMismatchError(f"not a unickpt dataloader position: {state!r:.200}")
        self._yielded = 0
        kind = state.get("kind")
        if kind == "global_position" and self.sampler is not None:
            s = self.sampler
            if int(state["dataset_len"]) != s.dataset_len:
                raise StateMismatchError(
                    f"the saved dataloader position is for a dataset of {state['dataset_len']} samples, "
                    f"this dataset has {s.dataset_len}; set dataloader.load_state_dict aside "
                    "(do not pass the dataloader to load) to start from the beginning"
                )
            if bool(state["shuffle"]) != s.shuffle or int(state["seed"]) != s.seed:
                logger.warning(
                    "dataloader resumed with the saved shuffle=%s seed=%s (the live sampler had "
                    "shuffle=%s seed=%s)",
                    state["shuffle"],
                    state["seed"],
                    s.shuffle,
                    s.seed,
                )
                s.shuffle = bool(state["shuffle"])
                s.seed = int(state["seed"])
            self.epoch = int(state["epoch"])
            self._start_samples = int(state["consumed_samples"])
            self._start_batches = 0
            if self._start_samples >= s.dataset_len:
                self.epoch += 1
                self._start_samples = 0
            return
        if kind == "global_position" or int(state.get("dp_size", -1)) != self.dp_size:
            saved = state.get("dp_size", state.get("num_replicas"))
            if self.on_reshard == "fresh_epoch":
                logger.warning(
                    "dataloader position saved under data-parallel size %s cannot be resharded to %s; "
                    "starting epoch %s from its beginning (on_reshard='fresh_epoch')",
                    saved,
                    self.dp_size,
                    int(state["epoch"]) + 1,
                )
                self.epoch = int(state["epoch"]) + 1
                self._start_samples = self._start_batches = 0
                return
            raise StateMismatchError(
                f"the dataloader position was saved under data-parallel size {saved} (kind {kind!r}) and "
                f"cannot be resharded to size {self.dp_size} with this sampler: use "
                "unickpt.data.ResumableDistributedSampler (or a plain/Distributed sampler, which "
                "wrap_dataloader converts), or set dataloader.on_reshard = 'fresh_epoch' to start the "
                "next epoch from its beginning"
            )
        self.epoch = int(state["epoch"])
        self._start_batches = int(state["consumed_batches"])
        self._start_samples = 0


def _rebuild(dl: DataLoader[Any], **override: Any) -> DataLoader[Any]:
    generator = dl.generator if dl.generator is not None else torch.Generator()
    kwargs: dict[str, Any] = dict(
        num_workers=dl.num_workers,
        collate_fn=dl.collate_fn,
        pin_memory=dl.pin_memory,
        timeout=dl.timeout,
        worker_init_fn=dl.worker_init_fn,
        generator=generator,
        persistent_workers=dl.persistent_workers,
    )
    if dl.num_workers > 0:
        kwargs["prefetch_factor"] = dl.prefetch_factor
        kwargs["multiprocessing_context"] = dl.multiprocessing_context
    kwargs.update(override)
    return DataLoader(dl.dataset, **kwargs)


def wrap_dataloader(dataloader: Any, plugin: Any = None, *, on_reshard: str = "error") -> Any:
    """Make ``dataloader`` resumable; called by every rank (``Booster.boost`` does it for you).

    - A dataloader with its own ``state_dict``/``load_state_dict`` (torchdata's
      ``StatefulDataLoader``, or one already wrapped) is returned unchanged.
    - A ``DataLoader`` over a map-style dataset with a sequential, random, ``DistributedSampler``
      or :class:`ResumableDistributedSampler` sampler gets a :class:`ResumableDistributedSampler`
      sharded over the plugin's data-parallel ranks (``plugin.dp_size``/``dp_rank``; one rank
      without a plugin), keeping its batch size, ``drop_last``, workers and collate function.
      A random sampler becomes a shuffle with seed 0 (the seed is saved with the position);
      a ``DistributedSampler`` keeps its seed, shuffle and ``drop_last``.
    - Any other sampler or batch sampler is wrapped as is (not resharded): resumable at the
      same data-parallel size only, see ``on_reshard``.
    - Anything else (an ``IterableDataset``, a plain iterable) is returned unchanged; saving it
      with the manager raises ``UnsupportedError``.
    """
    if on_reshard not in _RESHARD_POLICIES:
        raise ConfigError(f"on_reshard must be one of {_RESHARD_POLICIES}, got {on_reshard!r}")
    if hasattr(dataloader, "state_dict") and hasattr(dataloader, "load_state_dict"):
        return dataloader
    if not isinstance(dataloader, DataLoader) or isinstance(dataloader.dataset, IterableDataset):
        logger.info("dataloader of type %s is not made resumable", type(dataloader).__name__)
        return dataloader
    dp_size = int(getattr(plugin, "dp_size", 1)) if plugin is not None else 1
    dp_rank = int(getattr(plugin, "dp_rank", 0)) if plugin is not None else 0
    sampler = dataloader.sampler
    bs = dataloader.batch_sampler
    plain_batches = type(bs) is BatchSampler and bs is not None and bs.sampler is sampler
    new_sampler: ResumableDistributedSampler | None = None
    if plain_batches and dataloader.batch_size is not None:
        if isinstance(sampler, ResumableDistributedSampler):
            new_sampler = sampler
        elif isinstance(sampler, DistributedSampler):
            new_sampler = ResumableDistributedSampler(
                dataloader.dataset,  # type: ignore[arg-type]
                num_replicas=sampler.num_replicas,
                rank=sampler.rank,
                shuffle=sampler.shuffle,
                seed=sampler.seed,
                drop_last=sampler.drop_last,
            )
        elif type(sampler) in (SequentialSampler, RandomSampler):
            seed = 0
            if isinstance(sampler, RandomSampler) and sampler.generator is not None:
                seed = int(sampler.generator.initial_seed())
            new_sampler = ResumableDistributedSampler(
                dataloader.dataset,  # type: ignore[arg-type]
                num_replicas=dp_size,
                rank=dp_rank,
                shuffle=isinstance(sampler, RandomSampler),
                seed=seed,
                drop_last=False,
            )
    if new_sampler is None and bs is None:
        logger.info("dataloader without batching (batch_size=None) is not made resumable")
        return dataloader
    if new_sampler is not None:
        inner = _rebuild(
            dataloader, batch_size=dataloader.batch_size, sampler=new_sampler, drop_last=dataloader.drop_last
        )
        out = ResumableDataLoader(
            inner,
            new_sampler,
            dp_size=new_sampler.num_replicas,
            dp_rank=new_sampler.rank,
            on_reshard=on_reshard,
        )
    else:
        inner = _rebuild(dataloader, batch_sampler=_SkipBatches(bs))
        out = ResumableDataLoader(inner, None, dp_size=dp_size, dp_rank=dp_rank, on_reshard=on_reshard)
    if dataloader.generator is None:
        out._own_generator = inner.generator
    return out
