"""Rank side of the save-collectives cases of tests/dist/test_dist_faults.py (run in its world).

``io.save.save_tensors`` is called directly on 2 ranks, each holding a tensor of its own,
while every ``torch.distributed`` collective unickpt calls is counted on this rank: a sliced
save in a directory makes 6 object collectives (listing, plan + preparation, writing, the
commit's 3), a gathered save 4 (listing, plan + preparation, writing, commit), no barrier.
The lock is released before the last agreement: a rank sees no lock file as soon as ``save``
returns. A plan that fails on rank 1 only, while rank 0 prepares and creates the gathered
save's staged files, fails every rank and leaves nothing in the directory.
"""

from __future__ import annotations

import collections
import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from unickpt._faults import injected
from unickpt.ckpt.reader import open_checkpoint
from unickpt.io.load import load_tensors
from unickpt.io.save import SaveOptions, save_tensors
from unickpt.io.tensors import local_slices
from unickpt.spec.index import LayoutInfo
from unickpt.store.lock import LOCK_NAME

_COUNTED = ("all_gather_object", "broadcast_object_list", "barrier", "all_gather", "broadcast", "all_reduce")


@contextlib.contextmanager
def counting() -> Iterator[collections.Counter[str]]:
    """Count the calls of the ``torch.distributed`` collectives in ``_COUNTED`` (made by unickpt)."""
    calls: collections.Counter[str] = collections.Counter()
    originals = {name: getattr(dist, name) for name in _COUNTED}

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return fn(*args, **kwargs)

        return counted

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _opts(gather: bool) -> SaveOptions:
    return SaveOptions(
        kind="model", shard=True, gather=gather, size_per_shard_mb=1.0, layout=LayoutInfo(world_size=2)
    )


def _save(tensors: dict[str, torch.Tensor], path: Path, gather: bool) -> dict[str, Any]:
    with counting() as calls:
        save_tensors(tensors, str(path), _opts(gather), local_slices)
    # No barrier between the save's return and this look: the lock must be gone already.
    return {"calls": dict(calls), "lock_left": (path / LOCK_NAME).exists()}


def _expected(r: int) -> torch.Tensor:
    return torch.arange(12, dtype=torch.float32).reshape(3, 4) + 100 * r


def _exact(path: Path) -> bool:
    """Collective: the checkpoint loads (verified) bit-exact into every rank's tensors."""
    targets = {f"w{r}": torch.zeros(3, 4) for r in range(2)}
    load_tensors(open_checkpoint(str(path), "model"), targets, local_slices, strict=True, verify=True)
    return all(torch.equal(targets[f"w{r}"], _expected(r)) for r in range(2))


def case_save_collectives(d: Path) -> dict[str, Any]:
    r = dist.get_rank()
    tensors = {f"w{r}": _expected(r)}
    obs: dict[str, Any] = {
        "sliced": _save(tensors, d / "sliced", gather=False),
        "sliced_again": _save(tensors, d / "sliced", gather=False),  # over a committed checkpoint
        "gathered": _save(tensors, d / "gathered", gather=True),
    }
    dist.barrier()
    obs["sliced"]["exact"] = _exact(d / "sliced")
    obs["gathered"]["exact"] = _exact(d / "gathered")
    # The object exchange itself: small objects in one round, a long pickle on one rank in two.
    from unickpt import _dist

    for what, size in (("small", 100), ("long", 300_000)):
        mine = {"rank": r, "data": bytes([r + 1]) * (size if r == 1 else 10)}
        with counting() as calls:
            got = _dist.all_gather_object(mine, None)
        obs[f"exchange_{what}"] = {
            "calls": dict(calls),
            "exact": got
            == [{"rank": q, "data": bytes([q + 1]) * (size if q == 1 else 10)} for q in range(2)],
        }
    return obs


def case_plan_fails_on_rank1_while_rank0_prepares(d: Path) -> dict[str, Any]:
    from _dist_faults_worker import attempt

    r = dist.get_rank()
    tensors = {f"w{r}": torch.full((2, 3), float(r))}
    target = d / "gathered"
    with injected("save.plan", 1):
        obs = attempt(lambda: save_tensors(tensors, str(target), _opts(True), local_slices))
    obs["directory"] = str(target)
    dist.barrier()
    obs["left"] = sorted(os.listdir(target)) if target.exists() else []
    obs["retry"] = attempt(lambda: save_tensors(tensors, str(target), _opts(True), local_slices))
    dist.barrier()
    obs["after_retry"] = sorted(os.listdir(target))
    return obs
