"""The object collectives and the error agreement of unickpt, shared by io, the manager and the booster.

Outside an initialised process group each helper behaves as a world of one, so the same
code path serves a single process and thousands of ranks; over a group of one rank (a 1-rank
world, a subgroup of one) the object collectives run no torch collective either: there is no
other rank to hear from. Every helper takes the process group
it runs over (default: the whole world); a process that is not a member of that group gets a
``DistributedError`` instead of torch's rank -1. Bulk tensor transfers (DTensor gathers, ZeRO's
and the pipeline's own collectives) call torch directly; these helpers move Python objects.

CPU data never travels over NCCL: every collective these helpers make (and every other
collective of unickpt on CPU tensors: the funnelled save's sends, the S3 parts' all-to-all) runs
on :func:`cpu_group`, the group itself when it has a gloo backend for CPU tensors (a gloo world,
torch's default ``cpu:gloo,cuda:nccl``), else its gloo twin, created once by
:func:`setup_cpu_group` over the whole world on the main thread (plugin and manager setup), never
inside a save and never from a background thread.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import pickle
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import torch.distributed as dist

from unickpt.errors import DistributedError, UnickptError

__all__ = [
    "peer_failures",
    "cpu_group",
    "setup_cpu_group",
    "is_distributed",
    "rank",
    "world_size",
    "all_gather_object",
    "broadcast_object",
    "barrier",
    "agree",
    "agreed",
    "Args",
]

T = TypeVar("T")


@contextlib.contextmanager
def peer_failures(op: str) -> Iterator[None]:
    """A collective that fails because a peer died or timed out becomes a ``DistributedError``."""
    try:
        yield
    except RuntimeError as e:
        if isinstance(e, UnickptError):
            raise
        raise DistributedError(
            f"{op} failed: a peer rank exited or did not answer in time ({type(e).__name__}: {e})"
        ) from e


def is_distributed(group: Any = None) -> bool:
    """Whether collectives over ``group`` (default: the whole world) involve a process group.

    False outside an initialised process group (a world of one). Raises ``DistributedError``
    when this process is not a member of ``group``: it must not take part in a collective over
    that group, and treating it as a world of one would make it write as rank 0. Raises
    ``DistributedError`` too for a group given explicitly once the world is destroyed.
    """
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            # A group object exists only in an initialised world: this one was destroyed
            # (``destroy_process_group()`` while a call over it, e.g. an async save's
            # background write, still runs). Carrying on as a world of one would write and
            # commit as rank 0 on every rank.
            raise DistributedError(
                "the process group of this collective checkpoint call was destroyed "
                "(torch.distributed.destroy_process_group() ran before it finished; wait for "
                "async saves, with wait(), before destroying the process group)"
            )
        return False
    if group is not None and dist.get_rank(group) < 0:  # torch's answer for a non-member
        raise DistributedError(
            f"rank {dist.get_rank()} of the world is not a member of the process group given to a "
            "collective checkpoint call; call it on the ranks of that group only"
        )
    return True


# group (None: the world) -> its gloo twin, for groups without a CPU backend (pure NCCL).
_TWINS: dict[Any, Any] = {}
_TWINS_LOCK = threading.Lock()


def _cpu_capable(group: Any) -> bool:
    """Whether ``group`` moves CPU tensors itself (gloo, or a ``cpu:gloo`` entry in its backend map)."""
    try:
        config = str(dist.get_backend_config(group)).replace(" ", "").lower()
    except (AttributeError, RuntimeError, ValueError):
        config = str(dist.get_backend(group)).lower()
    if config in ("gloo", "undefined"):
        return True
    parts = dict(p.partition(":")[::2] for p in config.split(",") if ":" in p)
    return parts.get("cpu") == "gloo"


def _twin_key(group: Any) -> Any:
    """The registry's key: the world's group object for ``None`` (a world made again after
    ``destroy_process_group`` gets a twin of its own)."""
    return dist.group.WORLD if group is None else group


def setup_cpu_group(group: Any = None) -> None:
    """Collective over the whole world (every rank, the main thread, once): create ``group``'s gloo
    twin when ``group`` has no CPU backend (``init_process_group("nccl")``). Nothing to do for a
    gloo group or one with ``cpu:gloo``, for a world of one, or when the twin exists already."""
    if not is_distributed(group) and group is None:
        return
    if _cpu_capable(group) or _twin_key(group) in _TWINS:
        return
    if threading.current_thread() is not threading.main_thread():
        raise DistributedError(
            "internal: the gloo group for CPU collectives must be created on the main thread, at setup"
        )
    ranks = None if group is None else dist.get_process_group_ranks(group)
    # A subgroup's twin is made by its members only (the others may never call this).
    twin = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=group is not None)
    with _TWINS_LOCK:
        _TWINS[_twin_key(group)] = twin


def cpu_group(group: Any = None) -> Any:
    """The group CPU tensors of a collective over ``group`` travel on: ``group`` itself when it has a
    CPU backend, else its gloo twin (:func:`setup_cpu_group`). A twin missing when first needed is
    created here on the main thread (every rank reaches the same first collective); a background
    thread never creates one: it raises ``DistributedError`` instead."""
    if not is_distributed(group) or _cpu_capable(group):
        return group
    twin = _TWINS.get(_twin_key(group))
    if twin is None:
        if threading.current_thread() is not threading.main_thread():
            raise DistributedError(
                "no gloo group for the CPU collectives of this background save: the process group has no "
                "CPU backend and its gloo twin was not created at setup (build the plugin or the "
                "CheckpointManager on the main thread first)"
            )
        setup_cpu_group(group)
        twin = _TWINS[_twin_key(group)]
    return twin


def _alone(group: Any = None) -> bool:
    """Whether this process is the only member of ``group``: a collective over it has nothing to
    exchange (no process group, or a group of one rank), so none is run."""
    return not is_distributed(group) or dist.get_world_size(group) == 1


def rank(group: Any = None) -> int:
    return dist.get_rank(group) if is_distributed(group) else 0


def world_size(group: Any = None) -> int:
    return dist.get_world_size(group) if is_distributed(group) else 1


def all_gather_object(obj: T, group: Any = None) -> list[T]:
    """Every rank's ``obj`` (pickled), in rank order.

    torch's ``all_gather_object`` makes two collectives (the sizes, then the padded data); most
    objects unickpt exchanges are small (an agreement's report, a result), so the first round
    here sends each rank's size together with up to :func:`_inline_bytes` of its pickle, and only
    when some rank's pickle is longer does a second round carry the rest: one collective instead
    of two for the usual exchange.
    """
    if _alone(group):
        return [obj]
    n = world_size(group)
    group = cpu_group(group)
    device = _object_device(group)
    if device is None:  # a backend whose object device torch does not tell: torch's own exchange
        out: list[Any] = [None] * n
        with peer_failures("all_gather_object"):
            dist.all_gather_object(out, obj, group=group)
        return out
    import torch

    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    inline = _inline_bytes(n)
    first = bytearray(8 + inline)
    first[:8] = len(data).to_bytes(8, "little")
    head = data[:inline]
    first[8 : 8 + len(head)] = head
    sent = torch.frombuffer(first, dtype=torch.uint8).to(device)
    got = [torch.empty_like(sent) for _ in range(n)]
    with peer_failures("all_gather_object"):
        dist.all_gather(got, sent, group=group)
    rows = [bytes(t.cpu().numpy()) for t in got]
    sizes = [int.from_bytes(r[:8], "little") for r in rows]
    longest = max(sizes)
    tails = [b""] * n
    if longest > inline:  # the rest of the long pickles, padded to the longest
        rest = bytearray(longest - inline)
        rest[: max(0, len(data) - inline)] = data[inline:]
        sent_rest = torch.frombuffer(rest, dtype=torch.uint8).to(device)
        got_rest = [torch.empty_like(sent_rest) for _ in range(n)]
        with peer_failures("all_gather_object"):
            dist.all_gather(got_rest, sent_rest, group=group)
        tails = [bytes(t.cpu().numpy()) for t in got_rest]
    return [
        pickle.loads(r[8 : 8 + min(size, inline)] + t[: max(0, size - inline)])
        for r, t, size in zip(rows, tails, sizes, strict=True)
    ]


def _inline_bytes(n: int) -> int:
    """Pickle bytes each rank sends in the first round: 64 KiB at small worlds, down to 2 KiB
    at thousands of ranks (the round moves ``n`` times this to every rank)."""
    return max(2 << 10, min(64 << 10, (4 << 20) // max(n, 1)))


def _object_device(group: Any) -> Any:
    """The device torch's object collectives use for ``group`` (CPU for gloo, the current CUDA
    device for NCCL), or None when this torch does not say."""
    try:
        import torch
        from torch.distributed.distributed_c10d import _get_object_coll_device

        return torch.device(_get_object_coll_device(group))
    except (ImportError, RuntimeError, ValueError):
        return None


def broadcast_object(obj: T, src: int = 0, group: Any = None) -> T:
    if _alone(group):
        return obj
    holder: list[Any] = [obj]
    with peer_failures("broadcast_object_list"):
        dist.broadcast_object_list(holder, src=src, group=cpu_group(group))
    return holder[0]  # type: ignore[no-any-return]


def barrier(group: Any = None) -> None:
    if not _alone(group):
        with peer_failures("barrier"):
            dist.barrier(group=cpu_group(group))


@dataclasses.dataclass
class Args:
    """The arguments of a collective public call, checked equal on every rank by its first agreement.

    ``values``: argument name -> value (compared by ``repr``, so ``nan`` equals ``nan``; a local
    path by its absolute form). ``check``: the call's local validation of them, run inside that
    agreement, so a bad value raises on every rank, not on one while the others wait. Ranks that
    passed different values all raise one ``DistributedError`` naming each differing argument
    and every rank's value, before any rank's own error (which the difference explains).
    """

    method: str
    values: Mapping[str, Any]
    check: Callable[[], object] | None = None

    def texts(self) -> dict[str, str]:
        return {k: repr(v) for k, v in self.values.items()}


def _check_args(method: str, sent: list[dict[str, str] | None]) -> None:
    """Every rank: raise one ``DistributedError`` when the ranks' arguments differ."""
    if all(a is None for a in sent):
        return
    if any(a is None for a in sent):
        missing = [r for r, a in enumerate(sent) if a is None]
        raise DistributedError(
            f"{method}: the ranks are out of step: rank(s) {missing} reached this agreement from another call"
        )
    rows = [a for a in sent if a is not None]
    names = list(dict.fromkeys(k for a in rows for k in a))
    diffs = []
    for name in names:
        values = [a.get(name, "<not passed>") for a in rows]
        if len(set(values)) == 1:
            continue
        by_value: dict[str, list[int]] = {}
        for r, v in enumerate(values):
            by_value.setdefault(v, []).append(r)
        parts = [
            (f"rank {rs[0]}" if len(rs) == 1 else f"ranks {_ranks_text(rs)}") + f": {name}={v}"
            for v, rs in by_value.items()
        ]
        diffs.append(f"{name} differs ({', '.join(parts)})")
    if diffs:
        raise DistributedError(
            f"{method}: every rank must pass the same arguments, but {'; '.join(diffs)}; nothing was done"
        )


def _ranks_text(ranks: list[int]) -> str:
    if len(ranks) <= 8:
        return ", ".join(map(str, ranks))
    return ", ".join(map(str, ranks[:8])) + f", ... ({len(ranks)} ranks)"


def agree(error: BaseException | None, what: str, group: Any = None, args: Args | None = None) -> None:
    """Collective: if any rank hit an error, raise one on every rank, naming each rank's problem.

    Every rank must call this at the same point. The error of the lowest failing rank is
    raised on every rank (same type and attributes, e.g. ``IntegrityError.failures``), with a
    message listing every failing rank, so that no rank waits in a later collective for a
    peer that already gave up. An error that is neither a ``UnickptError`` nor an ``OSError``
    (a bug, a user callback's own exception) is raised unchanged on the rank where it happened;
    the other ranks raise a ``DistributedError`` naming that rank and its message.
    """
    if _alone(group):
        if error is not None:
            raise error
        return
    if args is None:
        _raise_reports(error, all_gather_object(_report(error), group), what)
        return
    # The arguments travel with the reports: one exchange.
    sent = all_gather_object(_WithReport(_report(error), args.texts()), group)
    _check_args(args.method, [x.obj if isinstance(x, _WithReport) else None for x in sent])
    _raise_reports(error, [x.report if isinstance(x, _WithReport) else x for x in sent], what)


@dataclasses.dataclass
class _WithReport:
    """What :func:`agree_gather` sends: a rank's error report and its object."""

    report: BaseException | None
    obj: Any


def agree_gather(
    error: BaseException | None, obj: T, what: str, group: Any = None, args: Args | None = None
) -> list[T]:
    """Collective: :func:`agree` and :func:`all_gather_object` of ``obj`` in one exchange.

    Raises as ``agree`` does when any rank hit an error; otherwise every rank's ``obj``.
    ``args``: as for :func:`agree` (its ``check`` is the caller's to run).
    """
    if _alone(group):
        if error is not None:
            raise error
        return [obj]
    payload = obj if error is None else None
    sent = all_gather_object(
        _WithReport(_report(error), payload if args is None else (payload, args.texts())), group
    )
    if args is not None:
        _check_args(
            args.method,
            [x.obj[1] if isinstance(x, _WithReport) and isinstance(x.obj, tuple) else None for x in sent],
        )
        sent = [_WithReport(x.report, x.obj[0]) if isinstance(x, _WithReport) else x for x in sent]
    reports = [
        x.report if isinstance(x, _WithReport) else DistributedError(f"out of step: sent {type(x).__name__}")
        for x in sent
    ]
    _raise_reports(error, reports, what)
    return [x.obj for x in sent if isinstance(x, _WithReport)]


def _report(error: BaseException | None) -> BaseException | None:
    """The error as it travels to the other ranks (its text, when it cannot be pickled)."""
    if error is None:
        return None
    try:
        pickle.dumps(error)
        return error
    except Exception:  # an unpicklable error travels as its text
        return DistributedError(f"{type(error).__name__}: {error}")


def _raise_reports(error: BaseException | None, reports: list[Any], what: str) -> None:
    """Raise on this rank when any rank's report is an error (or not a report: out of step)."""
    # A report that is not an error means the ranks reached different collectives.
    bad = [
        (
            r,
            rep
            if isinstance(rep, BaseException)
            else DistributedError(f"out of step: sent {type(rep).__name__}"),
        )
        for r, rep in enumerate(reports)
        if rep is not None
    ]
    if not bad:
        return
    lines = "\n".join(f"[rank {r}] {type(rep).__name__}: {rep}" for r, rep in bad)
    message = f"{what} failed on {len(bad)} of {len(reports)} rank(s):\n{lines}"
    first = bad[0][1]
    raised: BaseException
    if isinstance(first, UnickptError):
        raised = copy.copy(first)
        raised.args = (message,)
    elif isinstance(first, OSError):
        # Keep errno and file name: callers handle ENOSPC and EACCES differently.
        raised = type(first)(first.errno, message, first.filename)
    else:
        raised = DistributedError(message)
    if error is not None and not isinstance(error, (UnickptError, OSError)):
        raise error
    raise raised from error


def agreed(fn: Callable[[], T], what: str, group: Any = None, args: Args | None = None) -> T:
    """Collective: run the local phase ``fn`` on every rank, then :func:`agree` on its outcome.

    Any exception ``fn`` raises on any rank reaches every rank before the next collective.
    ``args``: the calling method's arguments, validated (``args.check``) before ``fn`` and
    checked equal on every rank in the same exchange.
    """
    err: BaseException | None = None
    out: Any = None
    try:
        if args is not None and args.check is not None:
            args.check()
        out = fn()
    except BaseException as e:
        err = e
    agree(err, what, group, args)
    return out  # type: ignore[no-any-return]
