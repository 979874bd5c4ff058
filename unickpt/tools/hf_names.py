"""Do a checkpoint's tensor names match what its ``config.json``'s architecture loads?

``from_pretrained`` fills the parameters it finds under their names and initialises the rest at
random, saying nothing when the file also holds names it does not know (a ``PeftModel``'s run,
whose names carry ``base_model.model.`` and ``lora_A``, merged as it was trained). The
architecture named in ``config.json`` is built on the meta device (no memory, no weights) with
transformers, and its expected names are compared with the checkpoint's. transformers is
imported only when a ``config.json`` names an architecture it has.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from unickpt._logging import get_logger

__all__ = ["NameMismatch", "architecture_names_check"]

logger = get_logger(__name__)


class NameMismatch:
    """What ``from_pretrained`` of ``architecture`` would make of the checkpoint's names."""

    def __init__(self, architecture: str, unexpected: list[str], missing: list[str]) -> None:
        self.architecture, self.unexpected, self.missing = architecture, unexpected, missing

    def __str__(self) -> str:
        def some(names: list[str]) -> str:
            return ", ".join(repr(n) for n in names[:3]) + (
                f" and {len(names) - 3} more" if len(names) > 3 else ""
            )

        parts = []
        if self.unexpected:
            parts.append(
                f"{len(self.unexpected)} tensor(s) that {self.architecture} has no parameter for ({some(self.unexpected)}), which from_pretrained ignores"
            )
        if self.missing:
            parts.append(
                f"{len(self.missing)} parameter(s) of {self.architecture} the checkpoint lacks ({some(self.missing)}), which from_pretrained initialises at random"
            )
        hint = ""
        if any("lora_" in n or n.startswith("base_model.model.") for n in self.unexpected):
            hint = (
                "; the names are a PeftModel's: merge with --merge-adapters (merge_checkpoint(..., "
                "merge_adapters=True)) for a checkpoint the base architecture loads, or save the adapter "
                "alone (booster.save_adapter)"
            )
        return "; ".join(parts) + hint


def architecture_names_check(config_json: bytes, names: Iterable[str]) -> NameMismatch | None:
    """The mismatch between ``names`` and what ``config.json``'s first architecture loads, or
    None when they match, when the config names no architecture, or when transformers (or the
    architecture) is not available here."""
    from unickpt.io.mapping import meta_model

    built = meta_model(config_json)
    if built is None:
        return None
    arch, model = built
    expected = set(model.state_dict())
    tied = set(
        getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None) or ()
    )
    given = set(names)
    unexpected = sorted(given - expected)
    missing = sorted(n for n in expected - given if n not in tied)
    if not unexpected and not missing:
        return None
    if _hub_names_match(model, given, tied):
        return None
    return NameMismatch(str(arch), unexpected, missing)


def _hub_names_match(model: Any, given: set[str], tied: set[str]) -> bool:
    """True when ``given`` are the model's names as its Hub files hold them: transformers'
    conversion mapping reversed (fused MoE experts one tensor per expert), which
    ``from_pretrained`` maps back on load."""
    from unickpt.io.mapping import plan_save, resolve_mapping
    from unickpt.io.tensors import TORCH_TO_ST

    transforms = resolve_mapping(model, None, saving=True)
    if not transforms:
        return False
    live = {n: (TORCH_TO_ST.get(t.dtype, "F32"), tuple(t.shape)) for n, t in model.state_dict().items()}
    try:
        hub = plan_save(transforms, live)
    except Exception as e:  # a mapping unickpt cannot follow: no verdict from it
        logger.debug("cannot map the names of %s: %s", type(model).__name__, e)
        return False
    hub_tied = set(plan_save(transforms, {n: live[n] for n in tied if n in live})) if tied else set()
    expected = set(hub)
    return given <= expected and all(n in given or n in hub_tied for n in expected)
