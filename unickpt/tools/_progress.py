"""The byte progress bar of the offline tools (``merge``, ``verify``, ``diff --deep``, ``convert``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

__all__ = ["progress_bar"]


@contextlib.contextmanager
def progress_bar(total: int, desc: str, show: bool) -> Iterator[Callable[[int], object]]:
    """A tqdm bar of ``total`` bytes on stderr, as its ``update``; a no-op when not ``show``.

    tqdm is imported only when the bar is shown. The bar is closed (and leaves no line
    behind) when the block ends, also on an error.
    """
    if not show:
        yield lambda _n: None
        return
    from tqdm.auto import tqdm

    with tqdm(
        total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, disable=None, leave=False
    ) as bar:
        yield bar.update
