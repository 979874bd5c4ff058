"""Validation of a checkpoint's optimizer ``param_groups`` against the live optimizer, before any change.

The saved groups are JSON written by anyone; their values end up as the optimizer's
hyperparameters. A value of the wrong type (``lr: "abc"``), a non-finite number where the live
one is finite (``lr: NaN``), a tuple of the wrong length (``betas: [1]``), a ``params`` that is
not a list of names, or groups that do not match the optimizer's
would be accepted and break training later; a key the optimizer's groups lack must hold a
plain finite value (an LR scheduler's ``initial_lr`` is kept, as torch keeps it). ``validate_param_groups`` refuses each of them
with a ``StateMismatchError`` naming the group, the key, what was expected and what was found.
A key the checkpoint lacks keeps the live value (logged): torch adds group options over
versions, and an older checkpoint must still load.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Any

import torch

from unickpt._logging import get_logger
from unickpt.errors import StateMismatchError
from unickpt.io.jsonstate import from_json_value

__all__ = ["validate_param_groups"]

logger = get_logger(__name__)


def _fail(where: str, gi: int | str, key: str, expected: str, found: Any) -> StateMismatchError:
    text = repr(found)
    if len(text) > 80:
        text = text[:77] + "..."
    return StateMismatchError(
        f"{where}: param_groups[{gi}][{key!r}]: expected {expected}, found {text}",
        mismatched=[f"param_groups[{gi}].{key}"],
    )


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _plain(v: Any, depth: int = 0) -> bool:
    if v is None or isinstance(v, (bool, str)):
        return True
    if _is_number(v):
        return math.isfinite(v)
    if isinstance(v, list) and depth == 0:
        return all(_plain(x, 1) for x in v)
    return False


def _check_value(live: Any, found: Any, path: str) -> str | None:
    """None if ``found`` can stand for ``live``; otherwise what was expected."""
    if isinstance(live, bool):
        return None if isinstance(found, bool) else "a bool"
    if isinstance(live, int):
        return None if isinstance(found, int) and not isinstance(found, bool) else "an int"
    if isinstance(live, float):
        if not _is_number(found):
            return "a number"
        if math.isfinite(live) and not math.isfinite(found):
            return "a finite number"
        return None
    if isinstance(live, str):
        return None if isinstance(found, str) else "a string"
    if live is None:
        # An unset option (torch's foreach/fused/capturable defaults): a scalar or nothing.
        return None if found is None or isinstance(found, (bool, int, float, str)) else "null or a scalar"
    if isinstance(live, (tuple, list)):
        if not isinstance(found, list) or len(found) != len(live):
            return f"a list of {len(live)} value(s) like {list(live)!r}"
        for i, (a, b) in enumerate(zip(live, found, strict=True)):
            why = _check_value(a, b, f"{path}[{i}]")
            if why is not None:
                return f"{why} at index {i}"
        return None
    if isinstance(live, torch.Tensor):
        if _is_number(found) and live.numel() == 1:
            found = torch.tensor(found)
        if not isinstance(found, torch.Tensor) or tuple(found.shape) != tuple(live.shape):
            return f"a tensor of shape {list(live.shape)}"
        if live.is_floating_point():
            if not found.is_floating_point() and found.dtype != torch.bool:
                found = found.double()
            if bool(torch.isfinite(live).all()) and not bool(torch.isfinite(found.double()).all()):
                return "finite values"
        return None
    if isinstance(live, dict):
        return None if isinstance(found, dict) else "an object"
    return None


def validate_param_groups(
    saved: Any,
    live: Sequence[dict[str, Any]],
    *,
    prefix: str,
    known: Collection[str] | None,
    where: str,
) -> None:
    """Refuse ``saved`` (the checkpoint's JSON groups) unless it fits ``live``.

    ``live`` are the optimizer's groups with ``params`` as FQN lists (this rank's parameters);
    ``known`` every FQN any rank's optimizer holds (``None``: skip that check). Saved names
    carry ``prefix``. Raises ``StateMismatchError``; returns nothing and changes nothing.
    """
    if not isinstance(saved, list):
        raise _fail(where, "*", "param_groups", "a list of groups", saved)
    owner: dict[str, int] = {}
    for gi, g in enumerate(saved):
        if not isinstance(g, dict):
            raise _fail(where, gi, "*", "an object", g)
        params = g.get("params")
        if not isinstance(params, list) or not all(isinstance(f, str) for f in params):
            raise _fail(where, gi, "params", "a list of parameter names", params)
        for f in params:
            if f in owner:
                raise _fail(
                    where, gi, "params", f"each parameter in one group ({f!r} is also in group {owner[f]})", f
                )
            owner[f] = gi
            if known is not None and f not in known:
                raise _fail(where, gi, "params", "names of the optimizer's parameters", f)
    for li, lg in enumerate(live):
        names = [prefix + f for f in lg["params"]]
        if not names:
            continue
        homes = {owner.get(f) for f in names}
        if None in homes:
            lost = [f for f in names if f not in owner]
            raise StateMismatchError(
                f"{where}: the optimizer's param group {li} holds {len(lost)} parameter(s) that no saved "
                f"group names, e.g. {lost[:3]}; the checkpoint's param_groups do not match this optimizer",
                missing=lost,
            )
        if len(homes) > 1:
            raise StateMismatchError(
                f"{where}: the optimizer's param group {li} is split over saved groups "
                f"{sorted(h for h in homes if h is not None)}; the checkpoint's param_groups do not match "
                "this optimizer",
                mismatched=[f"param_groups[{li}]"],
            )
        home = homes.pop()
        if home is None:  # never: a group of saved params has a home
            raise RuntimeError(f"{where}: param group {li} has no saved group")
        gi = home
        sg = saved[gi]
        want = set(lg) - {"params"}
        have = set(sg) - {"params"}
        # A key the optimizer's groups lack is kept, as torch keeps it (an LR scheduler's
        # ``initial_lr``, options of another torch version), when it is a plain finite value: the
        # optimizer ignores it, but a scheduler created later may read it.
        for key in sorted(have - want):
            if not _plain(sg[key]):
                raise _fail(
                    where,
                    gi,
                    key,
                    "a plain value (finite number, bool, string, null or a list of them) for a key the "
                    "optimizer's groups do not have",
                    sg[key],
                )
        # A key the checkpoint lacks (torch adds group options over versions, e.g. AdamW's
        # decoupled_weight_decay) keeps the live value: refusing would strand every older checkpoint.
        for key in sorted(want - have):
            logger.warning(
                "%s: param_groups[%s] has no %r; the optimizer keeps its own value %r",
                where,
                gi,
                key,
                lg[key],
            )
        for key in sorted(want & have):
            try:
                found = from_json_value(sg[key])
            except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as e:
                raise _fail(where, gi, key, "a valid JSON state value", f"{type(e).__name__}: {e}") from None
            why = _check_value(lg[key], found, key)
            if why is not None:
                raise _fail(where, gi, key, why, sg[key])
