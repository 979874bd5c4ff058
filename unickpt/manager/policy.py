"""The manager's decisions from step numbers alone: when to save, which step to load, which to delete."""

from __future__ import annotations

from unickpt._logging import get_logger
from unickpt.errors import ConfigError, IncompleteCheckpointError

__all__ = ["check_settings", "should_save", "latest_of", "pick_step", "retired_steps"]

logger = get_logger("unickpt.manager")


def check_settings(save_steps: int, keep_last: int | None) -> None:
    if save_steps < 1:
        raise ConfigError(f"save_steps must be a positive number of steps, got {save_steps}")
    if keep_last is not None and keep_last < 0:
        raise ConfigError(f"keep_last must be >= 0 (0 or None keeps all), got {keep_last}")


def should_save(step: int, save_steps: int, force: bool) -> bool:
    return force or step % save_steps == 0


def latest_of(steps: list[int] | dict[int, str], recorded: int | None) -> int | None:
    """The ``latest`` record when it names a committed step, else the highest committed step."""
    if not steps:
        return None
    return recorded if recorded in steps else max(steps)


def pick_step(dirs: dict[int, str], recorded: int | None, wanted: int | str, where: str) -> tuple[int, str]:
    """(step, its directory) to resume from among the committed ``dirs``; (0, "") when there is none.

    Raises ``IncompleteCheckpointError`` when ``latest`` records a save but no committed step
    is left: resuming from scratch would silently throw the run away.
    """
    if not dirs:
        if recorded is not None:
            raise IncompleteCheckpointError(
                f"{where}: 'latest' records a save of step {recorded}, but no committed step "
                "is left (step-<N> directories without COMMIT, or deleted); pass "
                "resume_from_checkpoint=None to start afresh"
            )
        return 0, ""
    newest = max(dirs)
    if recorded is not None and recorded not in dirs:
        logger.warning(
            "%s: 'latest' records step %s, which is not committed (deleted or damaged); "
            "the highest committed step is %s",
            where,
            recorded,
            newest,
        )
    latest = recorded if recorded in dirs else newest
    if wanted == "latest":
        return latest, dirs[latest]
    if int(wanted) in dirs:
        return int(wanted), dirs[int(wanted)]
    logger.warning(
        "step %s is not a committed checkpoint in %s; resuming from the latest committed step %s",
        wanted,
        where,
        latest,
    )
    return latest, dirs[latest]


def retired_steps(committed: list[int], saved: int, keep_last: int | None) -> list[int]:
    """The committed steps ``keep_last`` retires once ``saved`` is committed (oldest first)."""
    if keep_last is None:
        return []
    steps = [s for s in committed if s != saved]
    return steps[: max(0, len(steps) - (keep_last - 1))]
